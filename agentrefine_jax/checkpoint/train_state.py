"""The trainer's checkpoints: `params` (a LoRA run: the adapters), `opt_state` and `meta` of a
step saved and restored through the one manager, saves in the background with failures surfaced
at a step boundary (`TrainCheckpoints`), and the choice of the step a run resumes from.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from agentrefine_jax.checkpoint.format import ITEM_META, ITEM_OPT_STATE, ITEM_PARAMS, compare_trees, manager
from agentrefine_jax.checkpoint.integrity import CheckpointIntegrityError, newest_intact_step, write_manifest
from agentrefine_jax.checkpoint.meta import CheckpointMeta

log = logging.getLogger("agentrefine_jax.checkpoint")


class CheckpointSaveError(RuntimeError):
    """An (asynchronous) checkpoint save failed: disk full, no permission, bucket gone..."""


def save_train_state(
    mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any, meta: CheckpointMeta
) -> None:
    """One training step's checkpoint: params and meta as `save_model` writes them, plus opt_state."""
    mngr.save(
        step,
        args=ocp.args.Composite(
            **{
                ITEM_PARAMS: ocp.args.StandardSave(params),
                ITEM_OPT_STATE: ocp.args.StandardSave(opt_state),
                ITEM_META: ocp.args.JsonSave(meta.to_json()),
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

    def save(self, step: int, params: Any, opt_state: Any, meta: CheckpointMeta) -> None:
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
