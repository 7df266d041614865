"""The on-disk layout of a checkpoint: a root is an Orbax `CheckpointManager` directory whose
numeric subdirectories are steps, each holding named items (`params`, `meta`, the trainer's
`opt_state`); the one manager every writer uses; finding a step from whatever path a user gives;
and the one tree check every restore runs (`compare_trees`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from agentrefine_jax.paths import as_path

ITEM_PARAMS = "params"
ITEM_META = "meta"
ITEM_OPT_STATE = "opt_state"
RUN_CHECKPOINTS_SUBDIR = "checkpoints"  # a training run dir's checkpoint root


class _ArrayTreeHandler(ocp.StandardCheckpointHandler):
    """Orbax's StandardCheckpointHandler, with its zstd compression of array chunks made a choice
    (Orbax always compresses). Only writing differs: a reader takes the codec from the stored
    array metadata, so compressed and uncompressed steps restore alike."""

    def __init__(self, *, compress: bool) -> None:
        super().__init__()
        if not compress:
            impl = getattr(self, "_impl", None)
            if not isinstance(impl, ocp.PyTreeCheckpointHandler):  # an Orbax that moved it: say so
                raise RuntimeError("this orbax-checkpoint version cannot save without compression")
            self._impl = ocp.PyTreeCheckpointHandler(
                save_concurrent_gb=96, restore_concurrent_gb=96, use_compression=False
            )

    @classmethod
    def typestr(cls) -> str:
        # What a step's _CHECKPOINT_METADATA names as the item's handler: Orbax's own, as before,
        # so plain Orbax (without our registry) still opens every step.
        return ocp.StandardCheckpointHandler.typestr()


def handler_registry(*, compress: bool = True) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """Handlers for every item a step may hold: `params`, `meta` and the trainer's `opt_state`.
    `compress`: zstd on the array chunks written (reading handles either)."""
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in (ITEM_PARAMS, ITEM_OPT_STATE):
        handler = _ArrayTreeHandler(compress=compress)
        reg.add(item, ocp.args.StandardSave, handler)
        reg.add(item, ocp.args.StandardRestore, handler)
    reg.add(ITEM_META, ocp.args.JsonSave)
    reg.add(ITEM_META, ocp.args.JsonRestore)
    return reg


def manager(
    root: str | os.PathLike[str],
    *,
    keep: int | None = None,
    keep_every: int = 0,
    async_save: bool = False,
    compress: bool = True,
) -> ocp.CheckpointManager:
    """The one Orbax manager for a checkpoint root: keep the newest `keep` steps (all when None)
    plus every `keep_every`-th step (e.g. each epoch's last), saving in the background if asked.
    Uncommitted steps of earlier (killed) saves are the trainer's to remove, before this
    (`remove_uncommitted_steps`). `compress`: zstd on the array
    chunks it writes (see `handler_registry`)."""
    from orbax.checkpoint import checkpoint_managers as policies

    options: dict[str, Any] = {"enable_async_checkpointing": async_save, "create": True}
    if (faulty := _fault_temporary_path_class(as_path(root))) is not None:
        options["temporary_path_class"] = faulty
    if keep is not None:
        policy: Any = policies.LatestN(n=keep)
        if keep_every > 0:
            policy = policies.AnyPreservationPolicy([policy, policies.EveryNSteps(interval_steps=keep_every)])
        options["preservation_policy"] = policy
    return ocp.CheckpointManager(
        as_path(root),
        handler_registry=handler_registry(compress=compress),
        options=ocp.CheckpointManagerOptions(**options),
    )


def remove_uncommitted_steps(root: epath.Path) -> list[str]:
    """Delete the step directories under `root` that Orbax never committed (a save killed or cut
    off mid-write) and return their names; process 0 deletes, every process waits for it.
    Only for a root this run owns (the trainer's, under its run lock): these are its own
    unfinished writes.

    Not Orbax's `cleanup_tmp_directories`: that deletes in a background thread *while* the
    manager's constructor lists the root, and on an object store, where a "directory" is only its
    objects' common prefix, the listing raises FileNotFoundError when the thread has just removed
    the root's last object (a run whose only step was uncommitted). This finishes first."""
    removed: list[str] = []
    if jax.process_index() == 0 and root.exists():
        for tmp in ocp.path.step.all_temporary_paths(root):
            path = tmp.get()
            path.rmtree()
            removed.append(path.name)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"uncommitted steps removed under {root}")
    return removed


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


def leaves(tree: Any) -> dict[str, Any]:
    """Leaves by slash-joined path ("layers/wq", "0/mu/embed"): works for dicts and optax states."""
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def compare_trees(expected: Any, found: Any, *, what: str = "parameter", dtypes: bool = False) -> list[str]:
    """Human-readable differences (missing / extra / shape, and dtype if asked) between two trees of
    shaped leaves. The one check every restore runs: nothing is ever zero-filled or reshaped."""
    exp, got = leaves(expected), leaves(found)
    problems = [f"missing {what} {k} (expected shape {tuple(exp[k].shape)})" for k in exp if k not in got]
    problems += [f"unexpected {what} {k} (shape {tuple(got[k].shape)})" for k in got if k not in exp]
    for k in exp.keys() & got.keys():
        e, g = exp[k], got[k]
        if tuple(g.shape) != tuple(e.shape):
            problems.append(f"{what} {k} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        elif dtypes and jnp.dtype(g.dtype) != jnp.dtype(e.dtype):
            problems.append(f"{what} {k} has dtype {jnp.dtype(g.dtype)}, expected {jnp.dtype(e.dtype)}")
    return problems
