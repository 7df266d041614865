"""One trainer per run directory: a lock file `<run_dir>/trainer.lock` naming its holder.

Two trainers on one run dir would move each other's fresh checkpoints aside, clean up each
other's in-flight saves and interleave metrics rows, so a second one is refused before it
touches anything. The lock is created atomically — `O_CREAT | O_EXCL` on a local (or file://)
run dir; on an object store (gs://...) a create-if-absent write (`ifGenerationMatch=0` on one
upload request: gcsfs's `pipe_file(mode="create")`) — holding {host, pid, pid_start, started,
token}. It is removed at exit (except after a failed save to an object store: see `__exit__`);
a lock left behind by a killed trainer is *stale* when its host is this host and its process is
gone (the pid no longer exists, or now belongs to a process started at another time), and is
then taken over with a one-line notice. A lock from another host is never guessed stale: the
message names it and says to remove it once that trainer is known gone. Multi-host runs: only
process 0 takes it (the others follow process 0's run).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import uuid
from typing import Any

from etils import epath

from agentrefine_jax.checkpoint import CheckpointSaveError
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path, is_url
from agentrefine_jax.train.run_dir import TrainingInputError

LOCK_NAME = "trainer.lock"
log = logging.getLogger("agentrefine_jax.train")


class RunDirInUse(TrainingInputError):
    """Another live trainer holds the run directory (exit 2, naming it)."""


def _pid_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), None where /proc has none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    now = _pid_start(pid)
    return start is None or now is None or now == start  # a reused pid started at another time


def _describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


class RunLock:
    """`with RunLock(run_dir):` — held for the block; raises RunDirInUse naming the holder."""

    def __init__(self, run_dir: str | os.PathLike[str], *, take: bool = True) -> None:
        self.root = as_path(run_dir)
        self.path: epath.Path = self.root / LOCK_NAME
        self.take = take  # False on processes other than 0
        self.body = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _pid_start(os.getpid()),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "token": uuid.uuid4().hex,
        }
        self.held = False
        self.created_root = False

    # ------------------------------------------------------------------ create-if-absent
    def _create(self) -> bool:
        data = json_dumps(self.body).encode()
        if is_url(self.path):
            import fsspec

            fs, path = fsspec.core.url_to_fs(str(self.path))
            try:
                # One multipart upload with ifGenerationMatch=0. (open(mode="xb") puts the
                # precondition on a resumable upload's start, which emulators such as
                # fake-gcs-server ignore: there the second trainer silently overwrote the lock.)
                fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as e:  # gcsfs reports a failed precondition as an HTTP 412 error
                if "412" in str(e) or "recondition" in str(e):
                    return False
                raise
            return True
        try:
            fd = os.open(str(self.path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _holder(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            return {}  # being written, or damaged: treated as held, never guessed stale

    def _remove_stale(self, holder: dict[str, Any]) -> bool:
        """Remove the stale lock `holder` if it is still the one there (another trainer may
        have taken it over meanwhile); True when the way is clear."""
        if is_url(self.path):
            if self._holder() != holder:
                return False
            self.path.unlink(missing_ok=True)
            return True
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{self.body['token']}")
        try:
            os.rename(str(self.path), str(aside))  # only one taker wins the rename
        except FileNotFoundError:
            return True
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        if moved != holder:  # not the lock we judged stale: put it back (unless taken meanwhile)
            try:
                os.link(str(aside), str(self.path))
            except FileExistsError:
                pass
            aside.unlink()
            return False
        aside.unlink()
        return True

    # ------------------------------------------------------------------------- acquire
    def acquire(self) -> None:
        if not self.take:
            return
        self.created_root = not is_url(self.root) and not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                self.held = True
                return
            holder = self._holder()
            if holder is None:
                continue  # released meanwhile
            same_host = holder.get("host") == self.body["host"]
            pid = holder.get("pid")
            if same_host and isinstance(pid, int) and not _alive(pid, holder.get("pid_start")):
                if self._remove_stale(holder):
                    log.warning(
                        f"NOTE: took over the stale lock {self.path} of a trainer that is gone "
                        f"({_describe(holder)})"
                    )
                continue
            where = "" if same_host else " (another host: if that trainer is gone, delete the lock file)"
            raise RunDirInUse(
                f"{self.root} is in use by another trainer ({_describe(holder)}){where}; "
                f"one trainer per train.run_dir: wait for it, stop it, or use another run_dir"
            )
        raise RunDirInUse(f"could not take the lock {self.path}: it keeps changing hands")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if self._holder() == self.body:  # still ours
                self.path.unlink()
            if self.created_root and not any(self.root.iterdir()):
                self.root.rmdir()  # a run that stopped before writing anything leaves no empty dir
        except OSError as e:
            log.warning(f"WARNING: could not remove the run lock {self.path} ({e})")

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, CheckpointSaveError) and is_url(self.path):
            # The run stopped because its object store failed: removing the lock would only add
            # the client's retries (gcsfs: ~30 s) to the exit. Left, it is stale (pid gone) and the
            # next run on this host takes it over with its one-line note.
            self.held = False
            log.debug(f"run lock {self.path} left in place: its storage just failed")
            return
        self.release()
