"""One trainer per run directory: `<run_dir>/trainer.lock`, the shared lock of
agentrefine_jax/dir_lock.py (atomic create-if-absent, local or gs://; stale when its host's
process is gone; only process 0 of a multi-host run takes it)."""

from __future__ import annotations

import logging
import os

from agentrefine_jax.checkpoint import CheckpointSaveError
from agentrefine_jax.dir_lock import DirInUse, DirLock, _pid_start  # noqa: F401 (tests read _pid_start)
from agentrefine_jax.paths import is_url
from agentrefine_jax.train.run_dir import TrainingInputError

LOCK_NAME = "trainer.lock"


class RunDirInUse(TrainingInputError, DirInUse):
    """Another live trainer holds the run directory (exit 2, naming it)."""


class RunLock(DirLock):
    """`with RunLock(run_dir):` — held for the block; raises RunDirInUse naming the holder."""

    in_use = RunDirInUse
    holder_name = "trainer"
    advice = "one trainer per train.run_dir: wait for it, stop it, or use another run_dir"
    logger = "agentrefine_jax.train"

    def __init__(self, run_dir: str | os.PathLike[str], *, take: bool = True) -> None:
        super().__init__(run_dir, LOCK_NAME, take=take)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, CheckpointSaveError) and is_url(self.path):
            # The run stopped because its object store failed: removing the lock would only add
            # the client's retries (gcsfs: ~30 s) to the exit. Left, it is stale (pid gone) and the
            # next run on this host takes it over with its one-line note.
            self.held = False
            logging.getLogger(self.logger).debug(
                f"run lock {self.path} left in place: its storage just failed"
            )
            return
        self.release()
