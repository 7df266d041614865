"""The project checkpoint format, shared by `export` and the trainer.

A checkpoint *root* is an `orbax.checkpoint.CheckpointManager` directory; every numeric
subdirectory is one step, holding at least two items:

  params  StandardSave of the parameter tree as a plain nested dict
          (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`), arrays in their param dtype;
  meta    JsonSave of {"model": ModelConfig dict, "tokenizer": str|None,
          "template": str|None, "config": full Config dict|None, "step": int}.

A LoRA run's steps (meta["lora"] set: rank, alpha, targets, base dtype and `base`, the
reference to the frozen base: {"init_from_hf": dir} or {"seed": n}) hold only the adapters
in `params`; `load_model` rebuilds the base from the reference and merges them.

The trainer adds `opt_state` (its optimizer state) to the same steps, through the same
manager (`manager`, `TrainCheckpoints`); loaders read only `params` and `meta` and ignore
everything else (older runs also hold a `data_iter` item, no longer needed: the data
position is the global step).

Integrity: once Orbax has committed a step, `write_manifest` records the size and sha256 of
every file in it (`MANIFEST`, written last; the trainer hashes on a background worker, off the
training step). `verify_step` re-hashes them; a step whose files differ is corrupt. A step with
no manifest is one whose process was killed between Orbax's commit and the manifest: if Orbax's
own commit record is complete (`orbax_commit_problem`: the step's `commit_success.txt`, a commit
timestamp in `_CHECKPOINT_METADATA`, every item committed) the trainer re-hashes it, writes the
manifest and resumes from it (`verify_step(..., repair=True)`); otherwise it is an interrupted
save. Why this rule and not "manifest before Orbax may delete older steps": it also covers the
very first checkpoint (nothing older to fall back to), leaves Orbax's keep policy as it is, and
lets hashing run off the step; Orbax's commit is atomic (a rename, or a commit file on object
stores), so a committed step is complete. The trainer resumes from the newest intact step
(`newest_intact_step`) and says which ones it skipped or repaired.

Paths may be URLs (gs://..., anything etils.epath handles); `file://` URLs are local paths.

Loading never zero-fills: the stored tree is checked against the model the config
describes, and any missing, extra or mis-shaped leaf is an error that names the leaf.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from agentrefine_jax import object_store
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import ModelConfig, RopeScaling

ITEM_PARAMS = "params"
ITEM_META = "meta"
ITEM_OPT_STATE = "opt_state"
RUN_CHECKPOINTS_SUBDIR = "checkpoints"  # a training run dir's checkpoint root
MANIFEST = "agentrefine_manifest.json"

log = logging.getLogger(__name__)


class CheckpointIntegrityError(ValueError):
    """A checkpoint step whose files do not match its manifest (or that has none)."""


class CheckpointSaveError(RuntimeError):
    """An (asynchronous) checkpoint save failed: disk full, no permission, bucket gone..."""


def handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Handlers for every item a step may hold: `params`, `meta` and the trainer's `opt_state`."""
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, args in {
        ITEM_PARAMS: (ocp.args.StandardSave, ocp.args.StandardRestore),
        ITEM_META: (ocp.args.JsonSave, ocp.args.JsonRestore),
        ITEM_OPT_STATE: (ocp.args.StandardSave, ocp.args.StandardRestore),
    }.items():
        for a in args:
            reg.add(item, a)
    return reg


def manager(
    root: str | os.PathLike[str],
    *,
    keep: int | None = None,
    keep_every: int = 0,
    async_save: bool = False,
    cleanup_tmp: bool = False,
) -> ocp.CheckpointManager:
    """The one Orbax manager for a checkpoint root: keep the newest `keep` steps (all when None)
    plus every `keep_every`-th step (e.g. each epoch's last), saving in the background if asked.
    `cleanup_tmp` removes uncommitted step directories of earlier (killed) saves: only for a
    root this process owns (the trainer's, under its run lock)."""
    from orbax.checkpoint import checkpoint_managers as policies

    options: dict[str, Any] = {
        "enable_async_checkpointing": async_save,
        "create": True,
        "cleanup_tmp_directories": cleanup_tmp,
    }
    if (faulty := _fault_temporary_path_class(as_path(root))) is not None:
        options["temporary_path_class"] = faulty
    if keep is not None:
        policy: Any = policies.LatestN(n=keep)
        if keep_every > 0:
            policy = policies.AnyPreservationPolicy([policy, policies.EveryNSteps(interval_steps=keep_every)])
        options["preservation_policy"] = policy
    return ocp.CheckpointManager(
        as_path(root), handler_registry=handler_registry(), options=ocp.CheckpointManagerOptions(**options)
    )


def _fault_temporary_path_class(root: epath.Path) -> Any:
    """Tests only (agentrefine_jax.faults, `before_commit`): Orbax's own temporary-path class for
    `root`, with the kill point between "every item written" and "step committed"."""
    from agentrefine_jax import faults

    s = faults.spec()
    if s is None or s[0] != "before_commit":
        return None
    from orbax.checkpoint._src.path import atomicity_defaults

    base: Any = atomicity_defaults.get_default_temporary_path_class(root)

    class KillBeforeCommit(base):  # type: ignore[misc, valid-type]
        async def finalize(self, *args: Any, **kwargs: Any) -> Any:
            name = self.get_final().name
            if name.isdigit():  # the step directory, not one of its items
                faults.point("before_commit", int(name))
            return await super().finalize(*args, **kwargs)

    return KillBeforeCommit


def make_meta(
    model_cfg: ModelConfig,
    *,
    step: int,
    tokenizer: str | None = None,
    template: str | None = None,
    config: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The `meta` item; `config` may be a `Config` dataclass or its dict.

    `extra` adds run facts readers may use: `source_dtype` (dtype of the HF weights it was
    imported from; export's `auto`), `schedule_steps` (the LR schedule's horizon),
    `steps_per_epoch` and `epoch` (set on a step that closes an epoch).
    """
    from agentrefine_jax.config import to_dict

    if config is not None and dataclasses.is_dataclass(config):
        config = to_dict(config)
    return {
        "model": to_dict(model_cfg),
        "tokenizer": tokenizer,
        "template": template,
        "config": config,
        "step": int(step),
        **(extra or {}),
    }


def model_config_from_meta(meta: Mapping[str, Any]) -> ModelConfig:
    """Rebuild the ModelConfig stored in `meta["model"]` (also accepts that dict itself).

    Unknown keys are an error: a field this version does not know may change the architecture.
    """
    d = dict(meta["model"] if "model" in meta and isinstance(meta["model"], Mapping) else meta)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"checkpoint model config has fields this version does not know: {unknown}")
    if isinstance(d.get("rope_scaling"), Mapping):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("eos_token_ids") is not None:
        d["eos_token_ids"] = tuple(int(x) for x in d["eos_token_ids"])
    return ModelConfig(**d)


# ----------------------------------------------------------------------------- locating


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for remote URLs (gs://, s3://, ...); `file://` and plain paths are local."""
    text = os.fspath(path) if not isinstance(path, epath.Path) else str(path)
    return "://" in text and not text.startswith("file://")


def as_path(path: str | os.PathLike[str]) -> epath.Path:
    """An absolute epath (Orbax refuses relative paths); URLs such as gs://... pass through untouched.

    `file:///x` is the local path `/x` (etils has no file:// backend).
    """
    text = os.fspath(path) if not isinstance(path, epath.Path) else str(path)
    if text.startswith("gs://"):
        object_store.configure()  # before gcsfs or TensorStore first touch a bucket
    if isinstance(path, epath.Path) and is_url(path):
        return path
    if text.startswith("file://"):
        text = text[len("file://") :]
        if not text.startswith("/"):
            raise ValueError(f"file:// URLs must be absolute (file:///path), got {os.fspath(path)!r}")
    return epath.Path(text if "://" in text else os.path.abspath(text))


def join(base: str | os.PathLike[str], relative: str) -> epath.Path:
    """`relative` inside `base` unless it is absolute or a URL itself."""
    if "://" in relative or os.path.isabs(relative):
        return as_path(relative)
    return as_path(base) / relative


def checkpoint_steps(root: str | os.PathLike[str]) -> list[int]:
    """Finalized steps under a checkpoint root, ascending ([] when there is none)."""
    root = as_path(root)
    return sorted(ocp.path.step.checkpoint_steps(root)) if root.is_dir() else []


def resolve_checkpoint(path: str | pathlib.Path | epath.Path) -> tuple[epath.Path, int]:
    """(manager root, step) for a run directory, a manager root (latest step) or a step directory."""
    p = as_path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {p} does not exist")
    if (p / RUN_CHECKPOINTS_SUBDIR).is_dir():
        root = p / RUN_CHECKPOINTS_SUBDIR
        steps = checkpoint_steps(root)
        if not steps:
            raise FileNotFoundError(f"training run {p} has no finished checkpoint in {root}")
        return root, steps[-1]
    steps = checkpoint_steps(p)
    if steps:
        return p, steps[-1]
    if p.name.isdigit() and ((p / ITEM_PARAMS).exists() or (p / ITEM_META).exists()):
        if int(p.name) not in checkpoint_steps(p.parent):
            raise FileNotFoundError(f"checkpoint step {p} is not finalized (interrupted save?)")
        return p.parent, int(p.name)
    raise FileNotFoundError(
        f"no checkpoint at {p}: expected a training run dir (with {RUN_CHECKPOINTS_SUBDIR}/), "
        f"a checkpoint root with numeric step dirs, or a step dir containing '{ITEM_PARAMS}'"
    )


# ------------------------------------------------------------------------------- saving


def params_pure_dict(model_or_state: Any) -> dict[str, Any]:
    """A plain nested dict of parameter arrays from a Transformer, an nnx.State or such a dict."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.to_pure_dict(nnx.state(model_or_state, nnx.Param))
    if isinstance(model_or_state, nnx.State):
        return nnx.to_pure_dict(model_or_state)
    if isinstance(model_or_state, Mapping):
        return dict(model_or_state)
    raise TypeError(f"expected a Transformer, nnx.State or dict, got {type(model_or_state).__name__}")


def save_model(
    directory: str | pathlib.Path | epath.Path,
    model_or_params_state: Any,
    model_cfg: ModelConfig,
    *,
    step: int = 0,
    tokenizer: str | None = None,
    template: str | None = None,
    config: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> epath.Path:
    """Write `params` + `meta` as step `step` of the checkpoint root `directory`; returns the step dir."""
    root = as_path(directory)
    params = params_pure_dict(model_or_params_state)
    check_params(params, model_cfg, what=f"parameters being saved to {root}")
    meta = make_meta(model_cfg, step=step, tokenizer=tokenizer, template=template, config=config, extra=extra)
    with manager(root) as mngr:
        if step in mngr.all_steps():
            raise FileExistsError(f"{root} already has a checkpoint for step {step}; choose a new directory")
        mngr.save(
            step,
            args=ocp.args.Composite(
                **{ITEM_PARAMS: ocp.args.StandardSave(params), ITEM_META: ocp.args.JsonSave(meta)}
            ),
            force=True,
        )
        mngr.wait_until_finished()
    write_manifest(root / str(step))
    return root / str(step)


# ------------------------------------------------------------------------------ integrity


def _file_digest(path: epath.Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _digests(step_dir: epath.Path, names: list[str]) -> list[tuple[int, str]]:
    """(size, sha256) per file, several files at once (hashlib releases the GIL on big reads)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda rel: _file_digest(step_dir / rel), names))


def _step_files(step_dir: epath.Path) -> list[str]:
    """Relative names of every file in a step directory except the manifest."""
    # fsspec-backed walks (gs://) yield "bucket/dir" without the scheme: compare scheme-less.
    base = str(step_dir).split("://", 1)[-1].rstrip("/")
    out = []
    for dirpath, _, filenames in step_dir.walk():
        where = str(dirpath).split("://", 1)[-1].rstrip("/")
        if where != base and not where.startswith(base + "/"):
            raise CheckpointIntegrityError(f"listing {step_dir} returned {dirpath}, outside it")
        for name in filenames:
            rel = f"{where[len(base) + 1 :]}/{name}" if where != base else name
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


def weights_digest(hf_dir: str | os.PathLike[str]) -> str:
    """sha256 over the (name, size, sha256) of every *.safetensors file of an HF directory: the
    identity of a LoRA run's frozen base (other weights of the same shapes give another digest)."""
    d = as_path(hf_dir)
    names = sorted(p.name for p in d.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"{d} holds no *.safetensors weights")
    h = hashlib.sha256()
    for name, (size, digest) in zip(names, _digests(d, names), strict=True):
        h.update(f"{name}\0{size}\0{digest}\n".encode())
    return h.hexdigest()


def shapes_digest(model_cfg: ModelConfig) -> str:
    """sha256 of a model's parameter paths and shapes (a random LoRA base: with its seed, its identity)."""
    _, params = abstract_params(model_cfg)
    rows = sorted(f"{k}:{tuple(v.shape)}" for k, v in _leaves(nnx.to_pure_dict(params)).items())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def lora_base_identity(base_ref: Mapping[str, Any], model_cfg: ModelConfig) -> dict[str, str]:
    """What identifies a LoRA base now: {"sha256": weights_digest} of its HF directory, or
    {"shapes": shapes_digest} for a random base (whose `seed` the reference holds)."""
    if "init_from_hf" in base_ref:
        return {"sha256": weights_digest(base_ref["init_from_hf"])}
    return {"shapes": shapes_digest(model_cfg)}


def check_lora_base(stored: Mapping[str, Any], now: Mapping[str, Any], *, what: str) -> None:
    """Refuse a LoRA base (identity `now`) that is not the one the adapters were trained on
    (`stored`, the checkpoint's reference); runs from before identities were recorded pass."""
    for key in ("sha256", "shapes"):
        if stored.get(key) and now.get(key) and stored[key] != now[key]:
            if key == "sha256":
                raise ValueError(
                    f"{what}: the LoRA base {stored.get('init_from_hf')} (train.init_from_hf) holds other "
                    f"weights than the adapters were trained on (the sha256 of its safetensors files "
                    f"differs); refusing to apply them to another base. Restore the original weights."
                )
            raise ValueError(
                f"{what}: the LoRA run's random base (seed {stored.get('seed')}) has other parameter "
                f"shapes than the adapters were trained on; refusing to apply them"
            )


ORBAX_COMMIT_FILE = "commit_success.txt"  # orbax.checkpoint's atomicity COMMIT_SUCCESS_FILE
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"


def write_manifest(step_dir: str | os.PathLike[str]) -> epath.Path:
    """Record size + sha256 of every file of a committed step; written last, so it marks completion."""
    from agentrefine_jax import faults

    step_dir = as_path(step_dir)
    names = _step_files(step_dir)
    files = {
        rel: {"size": size, "sha256": digest}
        for rel, (size, digest) in zip(names, _digests(step_dir, names), strict=True)
    }
    if not files:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} holds no files")
    target = step_dir / MANIFEST
    body = json.dumps({"version": 1, "files": files}, indent=1, sort_keys=True)
    if is_url(step_dir):
        target.write_text(body)  # object stores publish an object whole
    else:
        tmp = step_dir / (MANIFEST + ".tmp")
        tmp.write_text(body)
        if step_dir.name.isdigit():
            faults.point("during_manifest", int(step_dir.name))
        tmp.rename(target)
    return target


def orbax_commit_problem(step_dir: str | os.PathLike[str]) -> str | None:
    """None when Orbax's own record says the step was committed whole, else what is missing:
    the step's commit marker, its commit timestamp, and a commit marker in every item it lists
    (Orbax writes each of these only after every byte of the step is written)."""
    step_dir = as_path(step_dir)
    if not (step_dir / ORBAX_COMMIT_FILE).exists():
        return f"it has no Orbax commit marker ({ORBAX_COMMIT_FILE})"
    try:
        meta = json.loads((step_dir / ORBAX_STEP_METADATA).read_text())
        items = dict(meta["item_handlers"])
        committed_at = meta["commit_timestamp_nsecs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its Orbax {ORBAX_STEP_METADATA} is unreadable ({type(e).__name__}: {e})"
    if not committed_at:
        return f"its Orbax {ORBAX_STEP_METADATA} has no commit timestamp"
    for item in sorted({ITEM_PARAMS, ITEM_META} | set(items)):
        if item not in items or not (step_dir / item / ORBAX_COMMIT_FILE).exists():
            return f"its item '{item}' was not committed"
    return None


def verify_step(step_dir: str | os.PathLike[str], *, repair: bool = False) -> bool:
    """Raise CheckpointIntegrityError naming the first problem found in a step directory.

    A step without a manifest is an interrupted save, unless `repair` and Orbax's commit record
    is complete (killed between the commit and the manifest): then its files are hashed and its
    manifest written now. Returns True when it did that.
    """
    step_dir = as_path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        problem = orbax_commit_problem(step_dir) if repair else None
        if repair and problem is None:
            write_manifest(step_dir)
            return True
        why = f" and {problem}" if problem else ""
        raise CheckpointIntegrityError(f"checkpoint {step_dir} is incomplete: it has no {MANIFEST}{why}")
    try:
        want = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointIntegrityError(f"checkpoint {step_dir}: unreadable {MANIFEST} ({e})") from None
    have = set(_step_files(step_dir))
    missing = sorted(set(want) - have)
    if missing:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} is incomplete: {missing[0]} is missing")
    extra = sorted(have - set(want))
    if extra:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} has a file its manifest lacks: {extra[0]}")
    for (rel, rec), (size, digest) in zip(want.items(), _digests(step_dir, list(want)), strict=True):
        if size != rec["size"]:
            raise CheckpointIntegrityError(
                f"checkpoint {step_dir} is truncated: {rel} has {size} bytes, {rec['size']} were written"
            )
        if digest != rec["sha256"]:
            raise CheckpointIntegrityError(f"checkpoint {step_dir} is corrupt: {rel} fails its sha256 check")
    return False


def newest_intact_step(
    root: str | os.PathLike[str], *, repair: bool = False
) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest step whose files match its manifest, [(step, problem)] of the newer steps skipped).

    `repair`: a committed step missing only its manifest gets one (see `verify_step`), with a
    notice in the log. (None, []) when there is no step at all; raises CheckpointIntegrityError
    when steps exist but none is intact, naming them.
    """
    root = as_path(root)
    steps = checkpoint_steps(root)
    skipped: list[tuple[int, str]] = []
    for step in reversed(steps):
        try:
            if verify_step(root / str(step), repair=repair):
                log.warning(
                    f"NOTE: checkpoint {root / str(step)} had no {MANIFEST} (the run stopped before it was "
                    f"written); Orbax's commit record is complete, so it was hashed now and is used"
                )
        except CheckpointIntegrityError as e:
            skipped.append((step, str(e)))
            continue
        return step, skipped
    if steps:
        raise CheckpointIntegrityError(
            f"no intact checkpoint in {root}: steps {steps} all fail verification "
            f"({'; '.join(p for _, p in skipped)}); start a new train.run_dir or restore the checkpoints"
        )
    return None, skipped


# ------------------------------------------------------------------------------ loading


def _leaves(tree: Any) -> dict[str, Any]:
    """Leaves by slash-joined path ("layers/wq", "0/mu/embed"): works for dicts and optax states."""
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def compare_trees(expected: Any, found: Any, *, what: str = "parameter", dtypes: bool = False) -> list[str]:
    """Human-readable differences (missing / extra / shape, and dtype if asked) between two trees of
    shaped leaves. The one check every restore runs: nothing is ever zero-filled or reshaped."""
    exp, got = _leaves(expected), _leaves(found)
    problems = [f"missing {what} {k} (expected shape {tuple(exp[k].shape)})" for k in exp if k not in got]
    problems += [f"unexpected {what} {k} (shape {tuple(got[k].shape)})" for k in got if k not in exp]
    for k in exp.keys() & got.keys():
        e, g = exp[k], got[k]
        if tuple(g.shape) != tuple(e.shape):
            problems.append(f"{what} {k} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        elif dtypes and jnp.dtype(g.dtype) != jnp.dtype(e.dtype):
            problems.append(f"{what} {k} has dtype {jnp.dtype(g.dtype)}, expected {jnp.dtype(e.dtype)}")
    return problems


def abstract_params(model_cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """GraphDef and ShapeDtypeStruct parameter state of the model `model_cfg` describes (no memory)."""
    graphdef, params, rest = nnx.split(llama.abstract(model_cfg), nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise RuntimeError("Transformer holds non-parameter state; the checkpoint format must be extended")
    return graphdef, params


def check_params(params: Mapping[str, Any], model_cfg: ModelConfig, *, what: str) -> None:
    _, expected = abstract_params(model_cfg)
    problems = compare_trees(nnx.to_pure_dict(expected), params)
    if problems:
        raise ValueError(f"{what} do not match the model config:\n  " + "\n  ".join(problems))


def param_shardings(params: nnx.State, mesh: Mesh | None, rules: Any = None) -> Any:
    """Per-leaf shardings: from the logical axes on `mesh`, or the first device when `mesh` is None."""
    if mesh is None:
        single = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: single, nnx.to_pure_dict(params))
    from agentrefine_jax.config import MeshConfig
    from agentrefine_jax.sharding import state_shardings

    shardings = state_shardings(params, mesh, MeshConfig().rules if rules is None else rules)
    return nnx.to_pure_dict(shardings)


def read_meta(root: epath.Path, step: int) -> dict[str, Any]:
    path = root / str(step) / ITEM_META
    if not path.exists():
        raise FileNotFoundError(f"checkpoint step {root / str(step)} has no '{ITEM_META}' item")
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path, args=ocp.args.JsonRestore())
    missing = [k for k in ("model",) if k not in meta]
    if missing:
        raise ValueError(f"checkpoint meta at {path} lacks {missing}")
    return dict(meta)


def load_model(
    path: str | pathlib.Path | epath.Path,
    *,
    mesh: Mesh | None = None,
    rules: Any = None,
    param_dtype: str | None = None,
    **overrides: Any,
) -> tuple[ModelConfig, llama.Transformer, dict[str, Any]]:
    """Restore a checkpoint's parameters straight into (sharded, with `mesh`) device arrays.

    `param_dtype` casts on restore; `overrides` replace non-shape ModelConfig fields (e.g.
    dtype="float32", scan_layers=False, remat_policy="full"). Returns (config, model, meta).
    """
    root, step, meta = _open_step(path)
    model_cfg = model_config_from_meta(meta)
    changes = dict(overrides)
    if param_dtype is not None:
        changes["param_dtype"] = param_dtype
    if changes:
        model_cfg = dataclasses.replace(model_cfg, **changes)
    if meta.get("lora"):  # adapters only: rebuild the base, merge in float32, cast to param_dtype
        from agentrefine_jax.models import lora

        base_cfg, base, spec, adapters = load_lora(root / str(step), meta, mesh=mesh, rules=rules, **changes)
        merged = lora.merge(base, adapters, spec, dtype=model_cfg.param_dtype)
        graphdef, abs_params = abstract_params(model_cfg)
        nnx.replace_by_pure_dict(abs_params, merged)
        return model_cfg, nnx.merge(graphdef, abs_params), meta

    graphdef, abs_params = abstract_params(model_cfg)
    expected = nnx.to_pure_dict(abs_params)
    params_dir = root / str(step) / ITEM_PARAMS
    if not params_dir.exists():
        raise FileNotFoundError(f"checkpoint step {root / str(step)} has no '{ITEM_PARAMS}' item")
    stored = ocp.StandardCheckpointHandler().metadata(params_dir).tree
    problems = compare_trees(expected, stored)
    if problems:
        raise ValueError(
            f"checkpoint {params_dir} does not match its model config "
            f"({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}); refusing to load:\n  "
            + "\n  ".join(problems)
        )

    shardings = param_shardings(abs_params, mesh, rules)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.dtype(model_cfg.param_dtype), sharding=s),
        expected,
        shardings,
    )
    restored = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        params_dir, args=ocp.args.StandardRestore(target)
    )
    nnx.replace_by_pure_dict(abs_params, restored)
    model = nnx.merge(graphdef, abs_params)
    return model_cfg, model, meta


def _open_step(path: str | pathlib.Path | epath.Path) -> tuple[epath.Path, int, dict[str, Any]]:
    root, step = resolve_checkpoint(path)
    if (root / str(step) / MANIFEST).exists():
        verify_step(root / str(step))
    else:  # written by another tool or an older version: usable, but say it is unverified
        warnings.warn(f"checkpoint {root / str(step)} has no {MANIFEST}; loading it unverified", stacklevel=2)
    return root, step, read_meta(root, step)


def load_lora(
    path: str | pathlib.Path | epath.Path,
    meta: Mapping[str, Any] | None = None,
    *,
    mesh: Mesh | None = None,
    rules: Any = None,
    **overrides: Any,
) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """A LoRA run's (base config, frozen base params, LoraSpec, adapters), the base rebuilt
    bit for bit from the checkpoint's reference (the HF dir it started from, or its seed)."""
    from agentrefine_jax.models import lora

    if meta is None:
        root, step, meta = _open_step(path)
        path = root / str(step)
    ref = meta.get("lora")
    if not ref:
        raise ValueError(f"checkpoint {path} is not a LoRA run (its meta has no 'lora' entry)")
    spec = lora.LoraSpec(tuple(ref["targets"]), int(ref["rank"]), float(ref["alpha"]), float(ref["dropout"]))
    from agentrefine_jax.models import quant

    overrides.pop("param_dtype", None)
    stored = quant.storage_dtype(ref["base_dtype"])  # int8: built in bfloat16, quantised below
    trained_cfg = model_config_from_meta(meta)  # the layout the run used (overrides may change it)
    base_cfg = dataclasses.replace(trained_cfg, param_dtype=stored, **overrides)
    graphdef, abs_base = abstract_params(base_cfg)
    base_ref = ref["base"]
    if "init_from_hf" in base_ref:
        from agentrefine_jax.hf.io import load_hf_model  # the base's own format

        hf_dir = base_ref["init_from_hf"]
        if not pathlib.Path(hf_dir).is_dir() and not is_url(hf_dir):
            raise FileNotFoundError(f"the LoRA run's base {hf_dir} (train.init_from_hf) is missing")
        check_lora_base(base_ref, lora_base_identity(base_ref, trained_cfg), what=f"LoRA checkpoint {path}")
        _, model = load_hf_model(hf_dir, mesh=mesh, rules=rules, param_dtype=stored)
        base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    else:
        check_lora_base(base_ref, lora_base_identity(base_ref, trained_cfg), what=f"LoRA checkpoint {path}")
        shardings = param_shardings(abs_base, mesh, rules)
        base = jax.jit(
            lambda: nnx.to_pure_dict(nnx.state(llama.create(base_cfg, int(base_ref["seed"])), nnx.Param)),
            out_shardings=shardings,
        )()
    if ref["base_dtype"] == "int8":  # re-quantised as the run did; handed out dequantised, float32
        base = jax.jit(lambda b: quant.dequantize_base(quant.quantize_base(b)))(base)
        base_cfg = dataclasses.replace(base_cfg, param_dtype="float32")
    shapes = lora.shapes(spec, base_cfg)
    single = None if mesh is not None else SingleDeviceSharding(jax.devices()[0])
    target = {
        n: {
            f: jax.ShapeDtypeStruct(shapes[n][f], jnp.dtype(lora.ADAPTER_DTYPE), sharding=single)
            for f in "ab"
        }
        for n in shapes
    }
    if mesh is not None:
        from agentrefine_jax.sharding import logical_to_spec

        axes = lora.logical_axes(spec)
        target = {
            n: {
                f: jax.ShapeDtypeStruct(
                    t.shape,
                    t.dtype,
                    sharding=jax.sharding.NamedSharding(
                        mesh, logical_to_spec(axes[n][f], rules or (), t.shape, mesh)
                    ),
                )
                for f, t in d.items()
            }
            for n, d in target.items()
        }
    params_dir = epath.Path(path) / ITEM_PARAMS
    problems = compare_trees(
        target, ocp.StandardCheckpointHandler().metadata(params_dir).tree, what="adapter"
    )
    if problems:
        raise ValueError(
            f"LoRA checkpoint {params_dir} does not match its lora settings: " + "; ".join(problems)
        )
    adapters = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        params_dir, args=ocp.args.StandardRestore(target)
    )
    return base_cfg, base, spec, adapters


# ------------------------------------------------------------------------ training state


def save_train_state(
    mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any, meta: Mapping[str, Any]
) -> None:
    """One training step's checkpoint: params and meta as `save_model` writes them, plus opt_state."""
    mngr.save(
        step,
        args=ocp.args.Composite(
            **{
                ITEM_PARAMS: ocp.args.StandardSave(params),
                ITEM_OPT_STATE: ocp.args.StandardSave(opt_state),
                ITEM_META: ocp.args.JsonSave(dict(meta)),
            }
        ),
        force=True,
    )


def restore_train_state(
    mngr: ocp.CheckpointManager, step: int, abstract: Mapping[str, Any], shardings: Mapping[str, Any]
) -> dict[str, Any]:
    """Restore `params` and `opt_state` of `step` onto `shardings`, checked leaf by leaf (shape
    and dtype) against `abstract` ({"params": ..., "opt_state": ...} of ShapeDtypeStructs)."""
    target = {
        item: jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract[item], shardings[item]
        )
        for item in (ITEM_PARAMS, ITEM_OPT_STATE)
    }
    restored = mngr.restore(
        step, args=ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in target.items()})
    )
    for item in (ITEM_PARAMS, ITEM_OPT_STATE):
        if jax.tree.structure(restored[item]) != jax.tree.structure(abstract[item]):
            raise ValueError(f"checkpoint step {step}: the stored {item} tree does not match the model's")
        problems = compare_trees(abstract[item], restored[item], what=item, dtypes=True)
        if problems:
            raise ValueError(f"checkpoint step {step} does not match the model: " + "; ".join(problems))
    return {item: restored[item] for item in (ITEM_PARAMS, ITEM_OPT_STATE)}


class _OrbaxErrorsReportedByUs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _one_line_orbax_errors() -> None:
    """A failed background save is reported by the run itself, in one line (CheckpointSaveError).
    Orbax logs the same failure once per thread, with tracebacks, and TensorStore's remaining
    write callbacks then land on Orbax's closed event loop ("Event loop is closed", one traceback
    each, through sys.unraisablehook): neither adds anything, so both are kept out."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrorsReportedByUs) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxErrorsReportedByUs())
    if getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        return
    previous = sys.unraisablehook

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, RuntimeError) and str(args.exc_value) == "Event loop is closed":
            return
        previous(args)

    hook.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class TrainCheckpoints:
    """A run's checkpoints: the Orbax manager plus what Orbax does not do — a checksum manifest
    per step, and save failures surfaced at a step boundary, not at the end.

    Nothing here waits on the training step's path: Orbax writes in the background, the loop
    `poll`s between steps, and once Orbax has committed a step its manifest is hashed on a
    background worker (process 0). Waits happen only where correctness needs them: before the
    next save (its commit lets Orbax's keep policy delete older steps, possibly the one still
    being hashed) and at exit (`finish`). A kill while hashing leaves a committed step without a
    manifest, which resuming re-hashes (`verify_step(repair=True)`).
    """

    def __init__(self, root: epath.Path, *, keep: int, keep_every: int = 0) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        _one_line_orbax_errors()
        self.root = root
        self.mngr = manager(root, keep=keep, keep_every=keep_every, async_save=True, cleanup_tmp=True)
        self.pending: list[int] = []  # handed to Orbax, commit not yet seen
        self.hashing: dict[int, Future[Any]] = {}  # committed, manifest being written
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest")
        self.failed = False

    def save(self, step: int, params: Any, opt_state: Any, meta: Mapping[str, Any]) -> None:
        from agentrefine_jax import faults

        # Orbax would wait for its previous save here anyway (and warn); the manifests too, as this
        # save's commit may garbage-collect a step still being hashed.
        self.poll(wait=True)
        faults.point("before_save", step)
        try:
            save_train_state(self.mngr, step, params, opt_state, meta)
        except Exception as e:  # noqa: BLE001 - any storage error ends the run with one line
            self._fail(step, e)
        self.pending.append(step)

    def poll(self, wait: bool = False) -> None:
        """Raise CheckpointSaveError if a save failed; start the manifests of committed saves.
        `wait`: until every save is committed and every manifest written."""
        from agentrefine_jax import faults

        if self.failed:
            return
        if self.pending and (wait or not self.mngr.is_saving_in_progress()):
            try:
                self.mngr.wait_until_finished()  # returns at once unless `wait`; re-raises a failed save
            except Exception as e:  # noqa: BLE001
                self._fail(self.pending[-1], e)
            committed, self.pending = self.pending, []
            for step in committed:
                faults.point("after_commit", step)
                if jax.process_index() == 0:
                    self.hashing[step] = self._hasher.submit(self._write_manifest, step)
        if wait:
            self._wait_manifests()
        else:
            for step, fut in list(self.hashing.items()):
                if fut.done():
                    self._manifest_result(step, fut)

    def _write_manifest(self, step: int) -> None:
        step_dir = self.root / str(step)
        if step_dir.exists():  # the keep policy may have removed it (keep_checkpoints=0 aside)
            write_manifest(step_dir)

    def _manifest_result(self, step: int, fut: Any) -> None:
        del self.hashing[step]
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001
            self._fail(step, e)

    def _wait_manifests(self) -> None:
        for step, fut in list(self.hashing.items()):
            self._manifest_result(step, fut)

    def _fail(self, step: int, e: BaseException) -> None:
        self.failed = True
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointSaveError(
            f"saving checkpoint step {step} to {self.root} failed "
            f"({type(e).__name__}: {first}); the run stopped. {self.last_good_note()}"
        ) from None

    def last_good_note(self) -> str:
        """Names the newest checkpoint that really exists and is complete (committed by Orbax)."""
        if not self.failed:
            self.poll(wait=True)
        done = [s for s in self.mngr.all_steps() if s not in self.pending]
        if not done:
            return "No checkpoint has been written yet."
        return f"Last good checkpoint: step {max(done)} in {self.root}."

    def finish(self) -> None:
        self.poll(wait=True)


def choose_resume_step(root: epath.Path, rejected: epath.Path) -> int | None:
    """The newest intact step under `root` (None: nothing to resume). Newer broken steps are
    reported by name and moved to `rejected` so the run continues from the intact one and can
    save those steps again. Process 0 decides; every process gets the same answer."""
    code, error = -1, ""
    if jax.process_index() == 0:
        try:
            step, skipped = newest_intact_step(root, repair=True)
            for bad, problem in skipped:
                dest = rejected / f"{bad}-{time.strftime('%Y%m%d-%H%M%S')}"
                rejected.mkdir(parents=True, exist_ok=True)
                (root / str(bad)).rename(dest)
                log.warning(f"WARNING: {problem}; moved it to {dest}, falling back to an earlier checkpoint")
            code = -1 if step is None else step
        except CheckpointIntegrityError as e:
            code, error = -2, str(e)
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if code == -2:
        raise CheckpointIntegrityError(error or f"no intact checkpoint in {root} (see process 0's log)")
    return None if code < 0 else code
