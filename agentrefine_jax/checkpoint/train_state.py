"""The trainer's checkpoints: `params` (a LoRA run: the adapters), `opt_state` and `meta` of a
step saved and restored through the one manager, saves in the background with failures surfaced
at a step boundary (`TrainCheckpoints`), and the choice of the step a run resumes from.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from agentrefine_jax.checkpoint.format import (
    ITEM_META,
    ITEM_OPT_STATE,
    ITEM_PARAMS,
    compare_trees,
    manager,
    remove_uncommitted_steps,
)
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


def _lowest_priority(tid: int) -> None:
    """SCHED_IDLE, and nice 19 for a kernel or sandbox that refuses the policy (Linux only)."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except OSError:  # a sandbox that forbids it: run at the normal priority
        pass
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass


def _at_lowest_priority(tid: int) -> bool:
    try:
        return os.sched_getscheduler(tid) == os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, tid) == 19
    except OSError:
        return True  # the thread ended meanwhile (or cannot be inspected): nothing to do


def background_priority() -> None:
    """Run the calling thread (and the threads it starts) at the lowest CPU priority.

    For work that must not slow the training step: on a CPU backend the step's XLA threads and
    our background hashing share the same cores, and at equal priority the hashing takes its
    share of every step. Under SCHED_IDLE the kernel runs it only in the cycles the step leaves
    idle (it still finishes: an idle core, or the wait at the next save, lets it run); nice 19
    alone still takes a measurable share of a busy core (figures: docs/scale.md, "What a
    checkpoint save costs"). Linux keeps both per thread and new threads inherit them;
    elsewhere this does nothing."""
    if sys.platform.startswith("linux"):
        _lowest_priority(threading.get_native_id())


# TensorStore's shared thread pool, where Orbax's background writes run (threads it names so).
_STORAGE_THREAD_NAMES = ("ts_pool_worker",)


def lower_storage_threads() -> None:
    """`background_priority` for the threads Orbax writes on: TensorStore's pool, started by
    TensorStore (so we cannot run code in them) and named so; found by name in /proc (Linux).

    Copying a big step into the page cache costs those threads CPU-seconds of kernel time, which
    at equal priority comes out of the steps overlapping the write (docs/scale.md). Restores use
    the same pool: in a training process that is the resume, before any step runs."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in _STORAGE_THREAD_NAMES and not _at_lowest_priority(int(tid)):
            _lowest_priority(int(tid))


class TrainCheckpoints:
    """A run's checkpoints: the Orbax manager plus what Orbax does not do — a checksum manifest
    per step, and save failures surfaced at a step boundary, not at the end.

    Nothing here waits on the training step's path: Orbax writes in the background, the loop
    `poll`s between steps, and once Orbax has committed a step its manifest is hashed on a
    background worker (process 0). Waits happen only where correctness needs them: before the
    next save (its commit lets Orbax's keep policy delete older steps, possibly the one still
    being hashed) and at exit (`finish`). A kill while hashing leaves a committed step without a
    manifest, which resuming re-hashes (`verify_step(repair=True)`).

    What a save costs the step on a CPU backend, where the step and the save share the cores:
    the hashing and Orbax's writing threads run at the lowest CPU priority (`background_priority`,
    `lower_storage_threads`: the step first, the save in the cycles it leaves); and `compression`
    "auto" writes uncompressed chunks there (zstd of float32 weights and moments costs several
    times the CPU of the write itself for few bytes saved: docs/scale.md), zstd on accelerators,
    whose host cores the step does not use. "zstd" / "none" choose explicitly.

    What the step does while Orbax reads a saved state (spare buffers on a CPU backend) is the
    trainer's save strategy (train/save_strategy.py), not this class's.
    """

    def __init__(
        self, root: epath.Path, *, keep: int, keep_every: int = 0, compression: str = "auto"
    ) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        if compression not in ("auto", "zstd", "none"):
            raise ValueError(f"checkpoint compression must be auto, zstd or none, got {compression!r}")
        _one_line_orbax_errors()
        self.root = root
        on_cpu = jax.default_backend() == "cpu"
        compress = compression == "zstd" or (compression == "auto" and not on_cpu)
        for name in remove_uncommitted_steps(root):
            log.info("removed the uncommitted checkpoint %s (a save that never finished)", root / name)
        self.mngr = manager(root, keep=keep, keep_every=keep_every, async_save=True, compress=compress)
        self.pending: list[int] = []  # handed to Orbax, commit not yet seen
        self.hashing: dict[int, Future[Any]] = {}  # committed, manifest being written
        self._hasher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="manifest", initializer=background_priority
        )
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
        lower_storage_threads()  # the pool grows on demand: new writers too

    def poll(self, wait: bool = False) -> None:
        """Raise CheckpointSaveError if a save failed; start the manifests of committed saves.
        `wait`: until every save is committed and every manifest written."""
        from agentrefine_jax import faults

        if self.failed:
            return
        if self.pending:
            lower_storage_threads()
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
