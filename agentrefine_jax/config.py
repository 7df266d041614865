"""Typed run configuration: plain Python files in `configs/` return a `Config`.

A config file defines `def config() -> Config`. The CLI resolves `NAME` or `NAME.py` inside
`configs/`, a path (with a `/`) as that file (`resolve_config_path`), then applies
`--set a.b=value` overrides; values are parsed against the field's declared type so a typo
fails at start-up instead of mid-run. A config file is Python run with the user's privileges;
`--set` changes a shared config without running new code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import types
import typing
from typing import Any

from agentrefine_jax import objective_table
from agentrefine_jax.config_checks import ConfigError, ConfigKeyError, ConfigNotFoundError, validate
from agentrefine_jax.models.config import ModelConfig, RopeScaling
from agentrefine_jax.sharding import DEFAULT_RULES


def _configs_dir() -> pathlib.Path:
    """The repository's `configs/` in a source checkout or editable install; the copy the wheel
    ships as `agentrefine_jax/configs/` (see setup.py) after a regular install."""
    package = pathlib.Path(__file__).resolve().parent
    in_checkout = package.parent / "configs"
    return in_checkout if in_checkout.is_dir() else package / "configs"


CONFIGS_DIR = _configs_dir()


@dataclasses.dataclass
class DataConfig:
    # Training files (JSONL / JSON / parquet) or `datasets` names; see docs/data.md.
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    # Fraction of training rows held out for eval loss when no eval_files are given.
    eval_fraction: float = 0.0
    # Row layout: "auto" | "canonical" | "sharegpt" | "agentflan" | "custom" (see field_map).
    format: str = "auto"
    # Overrides for custom layouts, e.g. {"turns": "conversations", "role": "from", ...}.
    field_map: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: str = "llama3"
    template: str = "llama3"
    # Which assistant-turn categories carry loss (paper Eq. 1: correct + refinement).
    loss_on: tuple[str, ...] = ("correct", "refinement")
    drop_refinement_data: bool = False
    max_length: int = 8192
    # What to do with over-length trajectories: "truncate" (at a turn boundary) or "drop".
    overlength: str = "truncate"
    pack: bool = True
    shuffle: bool = True
    seed: int = 0
    num_workers: int = 0
    prefetch: int = 2
    # Fail (instead of training on what is left) when more than this fraction of the records
    # is skipped: usually a wrong format / field_map. The data CLI uses the same default.
    max_skip_fraction: float = 0.5
    # Train on exactly this many examples: the first N valid ones of a permutation seeded by
    # `seed` (nested: the first 8k of a 16k run are the 8k run's). None = all.
    train_size: int | None = None
    # General chat data (e.g. ShareGPT) mixed into the training split: `general_ratio` general
    # examples per agent example, the first ones of a seeded permutation of `general_files`.
    general_files: tuple[str, ...] = ()
    general_format: str = "auto"
    general_ratio: float = 0.0


@dataclasses.dataclass
class OptimConfig:
    learning_rate: float = 5e-6
    schedule: str = "cosine"  # "cosine" | "constant"
    warmup_steps: int = 0
    # Cosine decays to learning_rate * final_lr_fraction.
    final_lr_fraction: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0


@dataclasses.dataclass
class MeshConfig:
    # Sizes of the named mesh axes; -1 on one axis means "all remaining devices".
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # Logical axis name -> mesh axis (or tuple of mesh axes, or None for replicated).
    rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES


@dataclasses.dataclass
class LoraConfig:
    """LoRA refinement tuning (docs/lora.md): train low-rank adapters on a frozen base."""

    rank: int = 0  # 0: LoRA off, every weight is trained
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, training only
    # Projections that get adapters: any of q, k, v, o, gate, up, down.
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    # Storage dtype of the frozen base: auto (the model's param_dtype: a float32 model keeps its
    # base exact) | bfloat16 | float32 | int8 (QLoRA-style, via qwix: models/quant.py). A base
    # rounded or quantised below its stored precision is recorded in the checkpoint (docs/lora.md).
    base_dtype: str = "auto"


@dataclasses.dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    global_batch_size: int = 64
    micro_batch_size: int | None = None  # None: no gradient accumulation
    num_epochs: int = 10
    max_steps: int | None = None
    log_every: int = 1
    eval_every: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    # Also save (and never delete) the checkpoint that closes each epoch; its meta's `epoch` names it.
    keep_epoch_checkpoints: bool = False
    # zstd on the checkpoint's array chunks: "auto" = none on a CPU backend (there the save's CPU
    # is the step's: zstd took ~3x the write's CPU for ~0.7x the bytes), zstd on accelerators.
    checkpoint_compression: typing.Literal["auto", "zstd", "none"] = "auto"
    # Resuming under a different LR-schedule horizon (max_steps / num_epochs) is refused unless set.
    allow_schedule_change: bool = False
    # Loss is computed over the vocabulary in sequence chunks of this many tokens.
    loss_chunk_size: int = 1024
    # Loss gradient: "fused" (custom VJP, no recompute), "remat" (recompute per chunk), or "auto"
    # (per platform; see agentrefine_jax/train/loss.py). All are exact.
    loss_impl: typing.Literal["auto", "fused", "remat"] = "auto"
    # MoE models (SFT): add model.router_aux_loss_coef x transformers' auxiliary load-balancing
    # loss, as transformers does with output_router_logits=true (off there by default, as here).
    router_aux_loss: bool = False
    seed: int = 0
    init_from_hf: str | None = None
    # Where the model (architecture, special tokens, context length) comes from: "config" = the
    # config's `model`, which init_from_hf must then match field for field; "init_from_hf" =
    # init_from_hf's config.json through the family table (`--set model.*` must agree with it;
    # the directory's tokenizer and chat template become data.tokenizer/template unless set);
    # "auto" = init_from_hf when it is set, else the config. See docs/export.md.
    model_source: typing.Literal["auto", "config", "init_from_hf"] = "config"
    # A llama.cpp GGUF file: converted once into the GGUF cache (hf/gguf_cache.py), then used as
    # `init_from_hf=<that directory>` (the trainer resolves it; set one of the two).
    init_from_gguf: str | None = None
    # Export a Hugging Face directory when training ends (a relative path is inside run_dir).
    export_hf_at_end: str | None = None
    # "auto": the dtype init_from_hf weights came in, else model.param_dtype; or float32/bfloat16/float16.
    export_dtype: str = "auto"
    # Peak FLOP/s per device used for MFU; 0 = look it up from the device kind (a CPU: measured, cpu_peak.py).
    peak_flops_per_device: float = 0.0
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # A name in the objective table (objective_table.py; docs/preference.md): the refinement loss
    # (the default), or DPO / ORPO on preference pairs (from the trajectories' refinements, or plain
    # preference rows), or the refinement loss (x sft_weight) with DPO on the same trajectories'
    # pairs (x dpo_weight). beta: DPO's beta, ORPO's lambda.
    objective: typing.Literal[objective_table.NAMES] = objective_table.DEFAULT
    beta: float = 0.1
    sft_weight: float = 1.0
    dpo_weight: float = 1.0


@dataclasses.dataclass
class RLConfig:
    """Reinforcement learning on the one episode engine (train.objective=grpo; docs/rl.md): each
    phase plays `worlds_per_phase` training-seed worlds of `task`, `group_size` sampled episodes per
    world (the same seed), in the trainer's own process with its current parameters; rewards are
    normalised within each world's group (GRPO) and `updates_per_phase` optimizer steps follow, each
    on an equal share of the phase's episodes. The loss is PPO's clipped ratio with separate low and
    high clips (DAPO's clip-higher) and an optional KL term to the reference policy, aggregated over
    the trainable (sampled) tokens of the optimizer step's episodes (token-level mean)."""

    task: str = "demo_world"  # a built-in task with training seeds (eval registry)
    worlds_per_phase: int = 4
    group_size: int = 4  # G: sampled episodes per world
    max_turns: int = 8  # an episode's actions; the task's own limit when lower
    max_new_tokens: int = 96  # per model turn
    temperature: float = 1.0  # sampling; log-probabilities are recorded at temperature 1
    top_p: float = 1.0
    reward: typing.Literal["success", "progress"] = "success"  # progress: success + shaping by progress
    progress_weight: float = 0.5  # reward = success + progress_weight * progress, when reward=progress
    advantage_norm: typing.Literal["std", "none"] = "std"  # "none": Dr. GRPO (mean-centred only)
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    kl_coef: float = 0.0  # > 0: k3 KL to the reference (LoRA adapters off, or a frozen copy)
    updates_per_phase: int = 2  # optimizer steps per rollout phase
    seed: int = 0  # worlds and sampling; a phase's worlds come from (seed, phase)


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    # The `--set key=value` items this config was loaded with (a record; not itself settable).
    overrides: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- loading


def resolve_config_path(name_or_path: str) -> pathlib.Path:
    """`--config`'s rule, the same for every tool:

    * `demo` and `demo.py` (no `/`) name the shipped `configs/demo.py` from any directory; a file
      called `demo` in the working directory never shadows it;
    * a path (`./my.py`, `dir/my.py`, `/abs/my.py`) names that file, which must exist and end in .py;
    * a bare `my.py` that is not shipped names `./my.py`; one that is shipped *and* exists in the
      working directory is refused as ambiguous (say `./my.py` or `my`): a file in the working
      directory never silently replaces a shipped config, nor the other way round.

    A config file is Python that runs with your privileges: run only files you trust, and change a
    shared config with `--set key=value` (data, parsed and validated) instead of a copy with edits.
    """
    available = sorted(q.stem for q in CONFIGS_DIR.glob("*.py") if not q.stem.startswith("_"))
    if "/" in name_or_path or os.sep in name_or_path:
        return _config_file(pathlib.Path(name_or_path), name_or_path)
    stem = name_or_path.removesuffix(".py")
    shipped = CONFIGS_DIR / f"{stem}.py" if stem in available else None
    if name_or_path.endswith(".py"):
        local = pathlib.Path(name_or_path)
        if shipped is None:
            return _config_file(local, name_or_path)
        if local.exists() and not _same_file(local, shipped):
            raise ConfigNotFoundError(
                f"--config {name_or_path} is ambiguous: the shipped {shipped} and {local.resolve()} in the "
                f"working directory; say --config {stem} for the shipped one or --config ./{name_or_path} "
                "for yours"
            )
        return shipped
    if shipped is not None:
        return shipped
    raise ConfigNotFoundError(
        f"no config {name_or_path!r} in configs/ (one of {available}); a config file of your own is "
        "given as a path (with a / or ending in .py)"
    )


def _config_file(p: pathlib.Path, given: str) -> pathlib.Path:
    if p.is_file() and p.suffix == ".py":
        return p
    if p.is_file():
        raise ConfigNotFoundError(f"config file {given!r} must be a Python file ending in .py")
    shipped = (CONFIGS_DIR / p.name).is_file() and p.suffix == ".py"
    hint = f"; the shipped config is --config {p.stem}" if shipped else ""
    raise ConfigNotFoundError(f"no config file {given!r} (a path to a .py file must exist){hint}")


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    """`cd configs && --config demo.py`: the shipped file itself, not a second one."""
    try:
        return a.samefile(b)
    except OSError:
        return False


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Load, override and validate: every user error is a one-line ConfigError (see config_checks)."""
    path = resolve_config_path(name_or_path)
    spec = importlib.util.spec_from_file_location(f"agentrefine_config_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "config"):
            raise ConfigError(f"{path} must define `def config() -> Config`")
        cfg = module.config()
    except ConfigError:
        raise
    except Exception as e:  # the user's config file: report it in one line, not a traceback
        raise ConfigError(f"config file {path} failed: {type(e).__name__}: {e}") from e
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: config() returned {type(cfg).__name__}, expected Config")
    cfg = absolute_paths(validate(apply_overrides(cfg, overrides)))
    # Recorded: train.model_source (hf/model_source.py) holds these keys against the HF directory.
    return dataclasses.replace(cfg, overrides=tuple(overrides))


# Names `data.tokenizer` resolves without a directory (data/tokenizers.py).
VENDOR_TOKENIZERS = ("llama3", "mistral")


def _absolute(p: str) -> str:
    """A local path that exists, made absolute (a run then loads from any working directory);
    URLs, `datasets` names and vendor names are kept as they are."""
    if not p or "://" in p or not pathlib.Path(p).expanduser().exists():
        return p
    return str(pathlib.Path(p).expanduser().resolve())


def _absolute_all(files: Any) -> Any:
    """A list of paths, or one name given where a list belongs (accepted as such by the loader)."""
    return _absolute(files) if isinstance(files, str) else tuple(map(_absolute, files))


def absolute_paths(cfg: Config) -> Config:
    """The paths a run records (training files, tokenizer, init_from_hf) as absolute paths."""
    d, t = cfg.data, cfg.train
    tokenizer = d.tokenizer if d.tokenizer in VENDOR_TOKENIZERS else _absolute(d.tokenizer)
    data = dataclasses.replace(
        d,
        train_files=_absolute_all(d.train_files),
        eval_files=_absolute_all(d.eval_files),
        general_files=_absolute_all(d.general_files),
        tokenizer=tokenizer,
    )
    train = dataclasses.replace(t, init_from_hf=t.init_from_hf and _absolute(t.init_from_hf))
    return dataclasses.replace(cfg, data=data, train=train)


def apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """Every `--set` parsed first, then each dataclass rebuilt once with all of its changes, so
    fields checked together (heads 4->9 with kv-heads 2->3) can change together in any order. An
    error names the key(s) it is about."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        _plant(cfg, tree, key.strip().split("."), raw, key.strip())
    return _rebuild(cfg, tree)


@dataclasses.dataclass
class _Leaf:
    value: Any
    key: str
    raw: str


def _plant(obj: Any, tree: dict[str, Any], parts: list[str], raw: str, full_key: str) -> None:
    """Parse one override into `tree` (field name -> _Leaf or sub-tree) against `obj`'s types."""
    if not dataclasses.is_dataclass(obj):
        raise ConfigKeyError(f"--set {full_key}: {type(obj).__name__} has no sub-fields")
    fields = {f.name for f in dataclasses.fields(obj)} - ({"overrides"} if isinstance(obj, Config) else set())
    name = parts[0]
    if name not in fields:
        raise ConfigKeyError(f"--set {full_key}: unknown key {name!r}; choose from {sorted(fields)}")
    if len(parts) == 1:
        hints = typing.get_type_hints(type(obj))
        tree[name] = _Leaf(parse_value(raw, hints[name], full_key), full_key, raw)
        return
    sub = tree.get(name)
    if isinstance(sub, _Leaf):  # a whole value set earlier, then one of its fields: edit that value
        base = sub.value
        tree[name] = sub = {"": base}
    elif sub is None:
        tree[name] = sub = {}
    _plant(sub.get("", getattr(obj, name)), sub, parts[1:], raw, full_key)


def _leaves(tree: dict[str, Any]) -> list[_Leaf]:
    out: list[_Leaf] = []
    for name, v in tree.items():
        if name:
            out.extend([v] if isinstance(v, _Leaf) else _leaves(v))
    return out


def _rebuild(obj: Any, tree: dict[str, Any]) -> Any:
    obj = tree.get("", obj)
    changes = {
        name: v.value if isinstance(v, _Leaf) else _rebuild(getattr(obj, name), v)
        for name, v in tree.items()
        if name
    }
    try:
        return dataclasses.replace(obj, **changes)
    except (ValueError, TypeError) as e:  # a dataclass's own __post_init__ check (ModelConfig)
        leaves = _leaves(tree)
        named = [x for x in leaves if x.key.rsplit(".", 1)[-1] in str(e)] or leaves
        raise ConfigError(f"--set {' '.join(f'{x.key}={x.raw}' for x in named)}: {e}") from None


def parse_value(raw: str, tp: Any, key: str = "") -> Any:
    """Parse a CLI string into `tp` (bool/int/float/str/tuple/dict/Optional/dataclass).

    Raises ConfigError naming `key`, the raw value and what was expected.
    """
    try:
        return _parse(raw, tp, key)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # bad JSON, a RopeScaling field typo, ...
        raise ConfigError(f"--set {key}={raw}: {e}") from None


def _parse(raw: str, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # Optional[X]: X's own error says more
            return _parse(raw, inner[0], key)
        for arg in inner:
            try:
                return _parse(raw, arg, key)
            except (ValueError, TypeError):
                pass
        names = [getattr(a, "__name__", str(a)) for a in inner]
        raise ConfigError(f"--set {key}={raw}: expected {' or '.join(names)}")
    if origin is typing.Literal:
        if raw not in args:
            raise ConfigError(f"--set {key}={raw}: must be one of {', '.join(map(str, args))}")
        return raw
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--set {key}={raw}: expected true or false")
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"--set {key}={raw}: expected an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"--set {key}={raw}: expected a number") from None
    if tp is str:
        return raw
    if origin is tuple:
        if raw.startswith("["):
            items = json.loads(raw)
        else:
            items = [s for s in raw.split(",") if s.strip()] if raw else []
        if len(args) == 2 and args[1] is Ellipsis:
            # JSON items that are already values (lists for nested tuples, numbers) are kept as such.
            return tuple(_parse(i.strip(), args[0], key) if isinstance(i, str) else _tuples(i) for i in items)
        return tuple(items)
    if origin is dict or tp is dict:
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ConfigError(f"--set {key}={raw}: expected a JSON object")
        return value
    if tp is RopeScaling:
        return RopeScaling(**json.loads(raw))
    if tp is Any:
        return json.loads(raw) if raw[:1] in '[{"' or raw in ("null", "true", "false") else raw
    raise ConfigError(f"--set {key}: unsupported field type {tp}")


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def to_dict(cfg: Any) -> Any:
    """JSON-ready view of a (nested) config, for run directories and logs."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def from_dict(d: dict[str, Any]) -> Config:
    """Inverse of `to_dict` (used to rebuild the resolved config saved in a run)."""
    return _build(Config, d)


def _build(cls: Any, d: Any) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        kwargs[f.name] = _coerce(d[f.name], hints[f.name])
    return cls(**kwargs)


def _coerce(v: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if v is None:
        return None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None):
                continue
            if dataclasses.is_dataclass(arg) and isinstance(v, dict):
                return _build(arg, v)
        return _coerce(v, next(a for a in args if a is not type(None)))
    if dataclasses.is_dataclass(tp) and isinstance(v, dict):
        return _build(tp, v)
    if origin is tuple and isinstance(v, list):
        inner = args[0] if args and len(args) == 2 and args[1] is Ellipsis else Any
        return tuple(_coerce(x, inner) if not isinstance(x, list) else tuple(x) for x in v)
    return v


# ---------------------------------------------------------------------------- paper settings


def paper_setting(
    model: ModelConfig, *, tokenizer: str, max_length: int, run_dir: str, tensor: int = 1
) -> Config:
    """AgentRefine §4.1: lr 5e-6, cosine, no warm-up, global batch 64, 10 epochs.

    The training file is a placeholder for the user's data (`--set data.train_files=...`).
    """
    return Config(
        model=model,
        data=DataConfig(
            train_files=("data/agentrefine/train.jsonl",),
            tokenizer=tokenizer,
            template=tokenizer,
            loss_on=("correct", "refinement"),
            max_length=max_length,
        ),
        optim=OptimConfig(learning_rate=5e-6, schedule="cosine", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=tensor),
        train=TrainConfig(run_dir=run_dir, global_batch_size=64, num_epochs=10, checkpoint_every=200),
    )


def ablation(base: str, name: str, **data_changes: Any) -> Config:
    """A paper Table 2 ablation: the `base` config with data settings changed and its own run_dir."""
    cfg = load_config(base)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, **data_changes),
        train=dataclasses.replace(cfg.train, run_dir=f"{cfg.train.run_dir}_ablation_{name}"),
    )
