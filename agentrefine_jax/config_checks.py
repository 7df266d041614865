"""Load-time validation of a run `Config`: types, ranges and closed value sets, from one table.

`validate(cfg)` runs when a config is loaded (before any data is read or a device is touched) and
raises one `ConfigError` whose one-line message names every bad key, its value and what is allowed,
e.g. `optim.learning_rate=-1.0: must be > 0`.

Adding a field: a scalar or `Literal[...]` annotation is checked from the annotation alone; a range
or a closed set of strings is one row in `RULES`; a constraint between fields is one function in
`CROSS_CHECKS`. This module imports nothing heavy (no jax, no transformers) so a bad value fails in
well under a second after start-up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import types
import typing
from collections.abc import Callable
from typing import Any

from agentrefine_jax import objective_table


class ConfigError(ValueError):
    """A config that cannot be used: bad value, unknown key, unreadable config file."""


class ConfigKeyError(ConfigError, KeyError):
    """An unknown key in `--set` (a KeyError too, for callers that catch lookups)."""

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigNotFoundError(ConfigError, FileNotFoundError):
    """Neither a config file nor a name inside configs/."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class Check:
    ok: Callable[[Any], bool]
    expect: str  # what is allowed, as the error message states it


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def greater_than(lo: float) -> Check:
    return Check(lambda v: _number(v) and v > lo, f"must be > {lo}")


def at_least(lo: float) -> Check:
    return Check(lambda v: _number(v) and v >= lo, f"must be >= {lo}")


def fraction(*, upper_open: bool = False) -> Check:
    if upper_open:
        return Check(lambda v: _number(v) and 0 <= v < 1, "must be in [0, 1)")
    return Check(lambda v: _number(v) and 0 <= v <= 1, "must be in [0, 1]")


def one_of(*choices: str) -> Check:
    return Check(lambda v: v in choices, f"must be one of {', '.join(choices)}")


def _names(v: Any) -> Any:
    """A list of names given as a list or as one comma-separated string."""
    return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


def subset_of(*choices: str) -> Check:
    def ok(v: Any) -> bool:
        items = _names(v)
        listed = isinstance(items, (tuple, list)) and bool(items) and all(x in choices for x in items)
        return listed and len(set(items)) == len(items)  # q,q,v: a duplicate is a mistake, not a set

    return Check(ok, f"must be a non-empty subset of {', '.join(choices)}, each named once")


def optional(check: Check) -> Check:
    return Check(lambda v: v is None or check.ok(v), f"{check.expect}, or None")


MESH_SIZE = Check(lambda v: v == -1 or (_number(v) and v >= 1), "must be -1 (all remaining devices) or >= 1")
# Closed sets owned by modules too heavy to import here (transformers); tests/test_config.py
# asserts they equal the owners' constants so the two cannot drift apart.
TEMPLATES = ("llama3", "mistral", "hf")
# data/schema.py's FORMATS ("auto", "custom" and its presets); config is imported by data, not the reverse.
DATA_FORMATS = ("auto", "custom", "canonical", "sharegpt", "agentflan", "agentinstruct", "agenttraj")
# What `data.loss_on` may name; data/schema.py takes it from here.
CATEGORIES = ("correct", "refinement", "erroneous")
OVERLENGTH_MODES = ("truncate", "drop")
SCHEDULES = ("cosine", "constant")


# Dotted key -> check. Keys absent from the config (a field renamed or not yet merged) fail the
# test that walks this table, never silently at run time.
RULES: dict[str, Check | Callable[[], Check]] = {
    # model (dtype and remat names are also enforced by ModelConfig itself)
    "model.vocab_size": at_least(1),
    "model.hidden_size": at_least(1),
    "model.intermediate_size": at_least(1),
    "model.num_layers": at_least(1),
    "model.num_heads": at_least(1),
    "model.num_kv_heads": at_least(1),
    "model.head_dim": at_least(1),
    "model.rope_theta": greater_than(0),
    "model.rms_norm_eps": greater_than(0),
    "model.max_position_embeddings": at_least(1),
    "model.sliding_window": optional(at_least(1)),
    "model.initializer_range": greater_than(0),
    "model.param_dtype": lambda: one_of(*_dtypes()),
    "model.dtype": lambda: one_of(*_dtypes()),
    "model.attention_block_size": at_least(0),
    "model.mlp_chunk_size": at_least(0),
    # data
    "data.eval_fraction": fraction(upper_open=True),
    "data.format": one_of(*DATA_FORMATS),
    "data.template": one_of(*TEMPLATES),
    "data.loss_on": subset_of(*CATEGORIES),
    "data.max_length": at_least(2),
    "data.overlength": one_of(*OVERLENGTH_MODES),
    "data.num_workers": at_least(0),
    "data.prefetch": at_least(0),
    "data.max_skip_fraction": fraction(),
    "data.train_size": optional(at_least(1)),
    "data.general_ratio": at_least(0),
    # optim
    "optim.learning_rate": greater_than(0),
    "optim.schedule": one_of(*SCHEDULES),
    "optim.warmup_steps": at_least(0),
    "optim.final_lr_fraction": fraction(),
    "optim.b1": fraction(upper_open=True),
    "optim.b2": fraction(upper_open=True),
    "optim.eps": greater_than(0),
    "optim.weight_decay": at_least(0),
    "optim.grad_clip_norm": Check(lambda v: _number(v) and v >= 0, "must be > 0, or 0 for no clipping"),
    # mesh
    "mesh.data": MESH_SIZE,
    "mesh.fsdp": MESH_SIZE,
    "mesh.tensor": MESH_SIZE,
    # train
    "train.run_dir": Check(lambda v: isinstance(v, str) and bool(v.strip()), "must be a non-empty path"),
    "train.global_batch_size": at_least(1),
    "train.micro_batch_size": optional(at_least(1)),
    "train.num_epochs": at_least(1),
    "train.max_steps": optional(at_least(1)),
    "train.log_every": at_least(1),
    "train.eval_every": Check(lambda v: _number(v) and v >= 0, "must be >= 1, or 0 for no eval"),
    "train.checkpoint_every": Check(
        lambda v: _number(v) and v >= 0, "must be >= 1, or 0 for a checkpoint only at the end"
    ),
    "train.keep_checkpoints": at_least(1),
    "train.loss_chunk_size": at_least(1),
    # "auto": the dtype the checkpoint was imported from, else the parameter dtype.
    "train.export_dtype": lambda: one_of("auto", *_dtypes()),
    "train.peak_flops_per_device": at_least(0),
    "train.objective": one_of(*objective_table.NAMES),
    "train.beta": greater_than(0),
    "train.sft_weight": at_least(0),
    "train.dpo_weight": at_least(0),
    "train.lora.rank": at_least(0),
    "train.lora.alpha": greater_than(0),
    "train.lora.dropout": fraction(upper_open=True),
    "train.lora.targets": lambda: subset_of(*_lora_targets()),
    "train.lora.base_dtype": lambda: one_of(*_lora_base_dtypes()),
    # rl (train.objective=grpo; docs/rl.md)
    "rl.task": Check(lambda v: isinstance(v, str) and bool(v.strip()), "must name a built-in task"),
    "rl.worlds_per_phase": at_least(1),
    "rl.group_size": at_least(2),
    "rl.max_turns": at_least(1),
    "rl.max_new_tokens": at_least(1),
    "rl.temperature": greater_than(0),
    "rl.top_p": Check(lambda v: _number(v) and 0 < v <= 1, "must be in (0, 1]"),
    "rl.reward": one_of("success", "progress"),
    "rl.progress_weight": at_least(0),
    "rl.advantage_norm": one_of("std", "none"),
    "rl.clip_low": fraction(upper_open=True),
    "rl.clip_high": at_least(0),
    "rl.kl_coef": at_least(0),
    "rl.updates_per_phase": at_least(1),
}


def _dtypes() -> tuple[str, ...]:
    from agentrefine_jax.models.config import DTYPES  # the one list; importing models loads jax

    return DTYPES


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # config_checks.DTYPES, read from its owner on first use
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lora_targets() -> tuple[str, ...]:
    from agentrefine_jax.models.lora import TARGETS

    return tuple(TARGETS)


def _lora_base_dtypes() -> tuple[str, ...]:
    from agentrefine_jax.models.lora import BASE_DTYPES

    return BASE_DTYPES


def _mesh_one_fill(cfg: Any) -> str | None:
    sizes = {a: getattr(cfg.mesh, a) for a in ("data", "fsdp", "tensor")}
    fill = [a for a, n in sizes.items() if n == -1]
    if len(fill) > 1:
        shown = ", ".join(f"mesh.{a}=-1" for a in fill)
        return f"{shown}: at most one mesh axis may be -1 (all remaining devices)"
    return None


def _mesh_rules(cfg: Any) -> str | None:
    axes = {f.name for f in dataclasses.fields(cfg.mesh) if f.name != "rules"}
    for item in cfg.mesh.rules:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            return f"mesh.rules: entry {item!r} is not a (logical axis, mesh axes) pair"
        target = item[1]
        names = target if isinstance(target, (tuple, list)) else [target]
        if any(n is not None and n not in axes for n in names):
            return f"mesh.rules: {item[0]!r} -> {target!r}: mesh axes must be None or among {sorted(axes)}"
    return None


def _micro_batch(cfg: Any) -> str | None:
    g, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if isinstance(g, int) and isinstance(m, int) and m >= 1 and g % m:
        return f"train.micro_batch_size={m}: must divide train.global_batch_size={g}"
    return None


def _warmup(cfg: Any) -> str | None:
    w, n = cfg.optim.warmup_steps, cfg.train.max_steps
    if isinstance(w, int) and isinstance(n, int) and cfg.optim.schedule == "cosine" and w >= n >= 1:
        return f"optim.warmup_steps={w}: must be < train.max_steps={n} for the cosine schedule"
    return None


def _router_aux_loss(cfg: Any) -> str | None:
    if not cfg.train.router_aux_loss:
        return None
    if not cfg.model.num_experts:
        return f"train.router_aux_loss=true: a {cfg.model.family} model routes no experts"
    spec = objective_table.get(cfg.train.objective)
    if spec.pairs or not spec.examples:  # the aux term joins the SFT token loss only
        return (
            f"train.router_aux_loss=true: only with {objective_table.DEFAULT} (the token loss alone), "
            f"not train.objective={cfg.train.objective}"
        )
    if not cfg.model.router_aux_loss_coef > 0:
        return "train.router_aux_loss=true: needs model.router_aux_loss_coef > 0"
    return None


def _lora_int8(cfg: Any) -> str | None:
    if not cfg.train.lora.rank and cfg.train.lora.base_dtype == "int8":
        return "train.lora.base_dtype=int8: needs train.lora.rank >= 1 (only a LoRA run has a frozen base)"
    if cfg.train.lora.rank and cfg.train.lora.base_dtype == "int8":
        try:
            import qwix  # noqa: F401  (the int8 base's quantiser, models/quant.py)
        except ImportError:
            return "train.lora.base_dtype=int8: needs the qwix package (pip install qwix)"
    return None


def _lora_rank(cfg: Any) -> str | None:
    lc = cfg.train.lora
    if not lc.rank:
        return None
    from agentrefine_jax.models.lora import max_rank, missing_targets  # models/params.py's shapes

    targets = _names(lc.targets)
    missing = missing_targets(targets, cfg.model)
    if missing:
        model = f"a {cfg.model.family} model"
        return f"train.lora.targets={','.join(targets)}: {model} has no {', '.join(missing)} projections"
    cap = max_rank(targets, cfg.model)
    if lc.rank > cap:
        return (
            f"train.lora.rank={lc.rank}: must be <= {cap}, the smallest fan-in/fan-out of the adapted "
            f"projections ({', '.join(targets)}) of this model"
        )
    return None


def _context(cfg: Any) -> str | None:
    n, ctx = cfg.data.max_length, cfg.model.max_position_embeddings
    if n > ctx:
        return f"data.max_length={n}: must be <= model.max_position_embeddings={ctx}, the model's context"
    return None


def export_path(cfg: Any) -> str:
    """Where `train.export_hf_at_end` writes: relative values are inside the run dir (as
    checkpoint.join resolves them), normalised so that `.` and `x/..` name the run dir itself."""
    out, run = _local(cfg.train.export_hf_at_end), _local(cfg.train.run_dir)
    if "://" in out or "://" in run:
        return posixpath.normpath(out if "://" in out or out.startswith("/") else posixpath.join(run, out))
    return os.path.realpath(os.path.join(run, out))


def _local(path: str) -> str:
    """`file:///x` is the local path `/x` (as checkpoint.as_path reads it); other URLs stay."""
    return path[len("file://") :] if path.startswith("file://") else path


def _export_target(cfg: Any) -> str | None:
    """The end-of-run export replaces its directory: never the run dir, an ancestor of it, or a
    part of the run (checkpoints, metrics, ...)."""
    from agentrefine_jax.outputs import RUN_DIR_ENTRIES

    out, run = cfg.train.export_hf_at_end, cfg.train.run_dir
    if not (isinstance(out, str) and out.strip() and isinstance(run, str) and run.strip()):
        return None
    target = export_path(cfg)
    remote = "://" in target
    root = posixpath.normpath(_local(run)) if remote else os.path.realpath(_local(run))
    sep = "/" if remote else os.sep
    key = f"train.export_hf_at_end={out!r}"
    if target == root or root.startswith(target.rstrip(sep) + sep):
        what = "is the run directory" if target == root else "contains the run directory"
        return f"{key}: {what} {run}; the export replaces its directory, which would delete the run"
    if target.startswith(root.rstrip(sep) + sep):
        first = target[len(root.rstrip(sep)) + 1 :].split(sep)[0]
        if first in (*RUN_DIR_ENTRIES, "config.json"):
            return f"{key}: is the run's own {first}; choose another name (e.g. hf)"
    return None


def check_outputs(cfg: Any) -> None:
    """The run's local output paths, on the filesystem (the trainer calls it right after load, before
    any work): run_dir a writable directory; the export target empty or an earlier export."""
    from agentrefine_jax.outputs import OutputError, check_dir, check_writable_dir

    run = _local(cfg.train.run_dir)
    for key, url in (("train.run_dir", run), ("train.export_hf_at_end", cfg.train.export_hf_at_end)):
        if problem := _url_support(url):
            raise ConfigError(f"invalid config: {key}={url}: {problem}")
    try:
        if "://" not in run:
            check_writable_dir(run, flag="train.run_dir=")
        if cfg.train.export_hf_at_end and "://" not in (target := export_path(cfg)):
            check_dir(target, overwrite=True, protect=[run], flag="train.export_hf_at_end=")
    except OutputError as e:
        raise ConfigError(f"invalid config: {e}") from None


def _url_support(path: Any) -> str | None:
    """A gs:// path needs gcsfs (the `gcs` extra): say so at load, not at the first save."""
    if not (isinstance(path, str) and path.startswith("gs://")):
        return None
    from agentrefine_jax import object_store

    object_store.configure()  # before gcsfs is imported: it reads its settings at import
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        return 'gs:// URLs need gcsfs: pip install -e ".[gcs]"'
    return None


def _objective(cfg: Any) -> str | None:
    """What the objective's table entry asks of the other settings (objective_table.py)."""
    tc = cfg.train
    spec = objective_table.get(tc.objective)  # a valid name: cross-checks run on valid fields
    if spec.weights and all(getattr(tc, w) == 0 for w in spec.weights):
        knobs = " and ".join(f"train.{w}" for w in spec.weights)
        both = "both" if len(spec.weights) == 2 else "all"
        return f"train.objective={tc.objective}: {knobs} are {both} 0 (nothing to train)"
    if spec.pairs and cfg.data.drop_refinement_data:
        return f"train.objective={tc.objective}: data.drop_refinement_data drops the errors pairs come from"
    return None


def _general_mix(cfg: Any) -> str | None:
    if cfg.data.general_ratio > 0 and not cfg.data.general_files:
        return "data.general_ratio > 0 needs data.general_files (the general chat data to mix in)"
    return None


def _init_source(cfg: Any) -> str | None:
    if cfg.train.init_from_gguf and cfg.train.init_from_hf:
        return "train.init_from_gguf and train.init_from_hf: set one (a GGUF file is converted to an HF dir)"
    return None


CROSS_CHECKS: list[Callable[[Any], str | None]] = [
    _general_mix,
    _objective,
    _mesh_one_fill,
    _mesh_rules,
    _micro_batch,
    _warmup,
    _lora_int8,
    _router_aux_loss,
    _lora_rank,
    _context,
    _export_target,
    _init_source,
]


# ---------------------------------------------------------------------------- checking


def _type_errors(obj: Any, prefix: str) -> list[str]:
    """Scalar, Optional and Literal annotations, recursively through nested dataclasses."""
    errors = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key, value, tp = f"{prefix}{f.name}", getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            errors += _type_errors(value, f"{key}.")
            continue
        expect = _type_mismatch(value, tp)
        if expect:
            errors.append(f"{key}={value!r}: {expect}")
    return errors


def _type_mismatch(value: Any, tp: Any) -> str | None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        results = [_type_mismatch(value, a) for a in inner]
        return None if any(r is None for r in results) else results[0]
    if origin is typing.Literal:
        return None if value in args else f"must be one of {', '.join(map(str, args))}"
    if tp is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "must be a number"
    if tp is str:
        return None if isinstance(value, str) else "must be a string"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if isinstance(value, str) and args[0] is str:
            return None  # one name for a list of names: the consumers (RecordSet, loss_on) take it
        if not isinstance(value, (tuple, list)):
            return "must be a list"
        for item in value:
            bad = _type_mismatch(item, args[0])
            if bad:
                return f"item {item!r} {bad}"
    return None


def lookup(cfg: Any, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Any) -> Any:
    """Raise ConfigError naming every bad field of `cfg` (one line); return `cfg` when all is well."""
    errors = _type_errors(cfg, "")
    if not errors:  # ranges assume the types are right
        for key, check in RULES.items():
            if not isinstance(check, Check):
                check = check()
            value = lookup(cfg, key)
            if not check.ok(value):
                errors.append(f"{key}={value!r}: {check.expect}")
    if not errors:
        errors = [msg for fn in CROSS_CHECKS if (msg := fn(cfg))]
    if errors:
        raise ConfigError("invalid config: " + "; ".join(errors))
    return cfg
