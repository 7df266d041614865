"""A model in and out of the checkpoint format: `save_model` (params + meta as one step, with its
manifest) and `load_model` (straight into sharded device arrays; a LoRA run's adapters merged
into its rebuilt base). Loading never zero-fills: the stored tree is checked against the model
the config describes, and any missing, extra or mis-shaped leaf is an error that names the leaf.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from agentrefine_jax.checkpoint.format import ITEM_META, ITEM_PARAMS, compare_trees, manager
from agentrefine_jax.checkpoint.integrity import open_step, write_manifest
from agentrefine_jax.checkpoint.lora_base import load_handoff, load_merged
from agentrefine_jax.checkpoint.meta import CheckpointMeta, make_meta
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.paths import as_path
from agentrefine_jax.sharding import param_shardings


def params_pure_dict(model_or_state: Any) -> dict[str, Any]:
    """A plain nested dict of parameter arrays from a Transformer, an nnx.State or such a dict."""
    if isinstance(model_or_state, nnx.Module):
        return nnx.to_pure_dict(nnx.state(model_or_state, nnx.Param))
    if isinstance(model_or_state, nnx.State):
        return nnx.to_pure_dict(model_or_state)
    if isinstance(model_or_state, Mapping):
        return dict(model_or_state)
    raise TypeError(f"expected a Transformer, nnx.State or dict, got {type(model_or_state).__name__}")


def check_params(params: Mapping[str, Any], model_cfg: ModelConfig, *, what: str) -> None:
    _, expected = llama.abstract_params(model_cfg)
    problems = compare_trees(nnx.to_pure_dict(expected), params)
    if problems:
        raise ValueError(f"{what} do not match the model config:\n  " + "\n  ".join(problems))


def save_model(
    directory: str | pathlib.Path | epath.Path,
    model_or_params_state: Any,
    model_cfg: ModelConfig,
    *,
    step: int = 0,
    config: Any = None,
    **fields: Any,
) -> epath.Path:
    """Write `params` + `meta` as step `step` of the checkpoint root `directory`; returns the step dir.
    `fields`: CheckpointMeta's other fields (tokenizer, template, source_dtype, ...)."""
    root = as_path(directory)
    params = params_pure_dict(model_or_params_state)
    check_params(params, model_cfg, what=f"parameters being saved to {root}")
    meta = make_meta(model_cfg, step=step, config=config, **fields)
    with manager(root) as mngr:
        if step in mngr.all_steps():
            raise FileExistsError(f"{root} already has a checkpoint for step {step}; choose a new directory")
        mngr.save(
            step,
            args=ocp.args.Composite(
                **{ITEM_PARAMS: ocp.args.StandardSave(params), ITEM_META: ocp.args.JsonSave(meta.to_json())}
            ),
            force=True,
        )
        mngr.wait_until_finished()
    write_manifest(root / str(step))
    return root / str(step)


def load_model(
    path: str | pathlib.Path | epath.Path,
    *,
    mesh: Mesh | None = None,
    rules: Any = None,
    param_dtype: str | None = None,
    handoff: bool = False,
    **overrides: Any,
) -> tuple[ModelConfig, llama.Transformer, CheckpointMeta]:
    """Restore a checkpoint's parameters straight into (sharded, with `mesh`) device arrays.

    `param_dtype` casts on restore; `overrides` replace non-shape ModelConfig fields (e.g.
    dtype="float32", scan_layers=False, remat_policy="full"). Returns (config, model, meta).
    A LoRA run loads as the model it trained (its base as held + adapters); with `handoff`, as
    the model its exports hand off (the adapters merged into the base as the user has it, in
    float32 unless `param_dtype` says otherwise; lora_base.load_handoff). Other runs: the same.
    """
    root, step, meta = open_step(path)
    model_cfg = meta.model
    changes = dict(overrides)
    if param_dtype is not None:
        changes["param_dtype"] = param_dtype
    if changes:
        model_cfg = dataclasses.replace(model_cfg, **changes)
    if meta.lora is not None and handoff:  # the adapters on the user's base, all float32
        model_cfg = dataclasses.replace(model_cfg, param_dtype=param_dtype or "float32")
        return (
            model_cfg,
            load_handoff(root / str(step), meta, model_cfg, mesh=mesh, rules=rules, **changes),
            meta,
        )
    if meta.lora is not None:  # the stored form of a LoRA run: adapters + the base's reference
        return (
            model_cfg,
            load_merged(root / str(step), meta, model_cfg, mesh=mesh, rules=rules, **changes),
            meta,
        )

    graphdef, abs_params = llama.abstract_params(model_cfg)
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
    return model_cfg, nnx.merge(graphdef, abs_params), meta
