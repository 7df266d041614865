"""The project checkpoint format, shared by `export` and the trainer.

A checkpoint *root* is an `orbax.checkpoint.CheckpointManager` directory; every numeric
subdirectory is one step, holding at least two items:

  params  StandardSave of the parameter tree as a plain nested dict
          (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`), arrays in their param dtype;
  meta    JsonSave of {"model": ModelConfig dict, "tokenizer": str|None,
          "template": str|None, "config": full Config dict|None, "step": int}.

The trainer adds `opt_state` and `data_iter` to the same steps; loaders here read only
`params` and `meta` and ignore everything else.

Loading never zero-fills: the stored tree is checked against the model the config
describes, and any missing, extra or mis-shaped leaf is an error that names the leaf.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from agentrefine_jax.models import llama
from agentrefine_jax.models.config import ModelConfig, RopeScaling

ITEM_PARAMS = "params"
ITEM_META = "meta"
RUN_CHECKPOINTS_SUBDIR = "checkpoints"
META_KEYS = ("model", "tokenizer", "template", "config", "step")


def handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Handlers for `params` and `meta`; the trainer adds its own items to the returned registry.

    Example (trainer):
        reg = handler_registry()
        reg.add("opt_state", ocp.args.StandardSave); reg.add("opt_state", ocp.args.StandardRestore)
        mngr = ocp.CheckpointManager(root, handler_registry=reg, options=...)
    """
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, args in item_handler_args().items():
        for a in args:
            reg.add(item, a)
    return reg


def item_handler_args() -> dict[str, tuple[type, ...]]:
    """The (save, restore) `CheckpointArgs` types of each item we own."""
    return {
        ITEM_PARAMS: (ocp.args.StandardSave, ocp.args.StandardRestore),
        ITEM_META: (ocp.args.JsonSave, ocp.args.JsonRestore),
    }


def make_meta(
    model_cfg: ModelConfig,
    *,
    step: int,
    tokenizer: str | None = None,
    template: str | None = None,
    config: Any = None,
) -> dict[str, Any]:
    """The `meta` item; `config` may be a `Config` dataclass or its dict."""
    from agentrefine_jax.config import to_dict

    if config is not None and dataclasses.is_dataclass(config):
        config = to_dict(config)
    return {
        "model": to_dict(model_cfg),
        "tokenizer": tokenizer,
        "template": template,
        "config": config,
        "step": int(step),
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


def as_path(path: str | os.PathLike[str]) -> epath.Path:
    """An absolute epath (Orbax refuses relative paths); URLs such as gs://... pass through."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


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
) -> epath.Path:
    """Write `params` + `meta` as step `step` of the checkpoint root `directory`; returns the step dir."""
    root = as_path(directory)
    params = params_pure_dict(model_or_params_state)
    check_params(params, model_cfg, what=f"parameters being saved to {root}")
    meta = make_meta(model_cfg, step=step, tokenizer=tokenizer, template=template, config=config)
    with ocp.CheckpointManager(root, handler_registry=handler_registry()) as mngr:
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
    return root / str(step)


# ------------------------------------------------------------------------------ loading


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def compare_trees(expected: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    """Human-readable differences (missing / extra / shape) between two trees of shaped leaves."""
    exp, got = _flatten(expected), _flatten(found)
    problems = [f"missing parameter {k} (expected shape {tuple(exp[k].shape)})" for k in exp if k not in got]
    problems += [f"unexpected parameter {k} (shape {tuple(got[k].shape)})" for k in got if k not in exp]
    problems += [
        f"parameter {k} has shape {tuple(got[k].shape)}, expected {tuple(exp[k].shape)}"
        for k in exp
        if k in got and tuple(got[k].shape) != tuple(exp[k].shape)
    ]
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
    root, step = resolve_checkpoint(path)
    meta = read_meta(root, step)
    model_cfg = model_config_from_meta(meta)
    changes = dict(overrides)
    if param_dtype is not None:
        changes["param_dtype"] = param_dtype
    if changes:
        model_cfg = dataclasses.replace(model_cfg, **changes)

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
