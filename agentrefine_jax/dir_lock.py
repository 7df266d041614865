"""One writer per directory: a lock file inside it naming its holder (the trainer's
`<run_dir>/trainer.lock`, `synth generate`'s `<out>/synth.lock`). Two trainers on one run dir
would move each other's fresh checkpoints aside, clean up each other's in-flight saves and
interleave metrics rows; two generators on one --out would pay twice for the same personas and
duplicate rows. So a second one is refused before it touches anything. The lock is created
atomically — `O_CREAT | O_EXCL` on a local (or file://) run dir; on an object store (gs://...) a
create-if-absent write (`ifGenerationMatch=0` on one upload request: gcsfs's
`pipe_file(mode="create")`) — holding {host, pid, pid_start, started, token}. It is removed at
exit; a lock left behind by a killed process is *stale* when its host is this host and its
process is gone (the pid no longer exists, or now belongs to a process started at another time),
and is then taken over with a one-line notice. A lock from another host is never guessed stale:
the message names it and says to remove it once that process is known gone. Multi-host runs:
only process 0 takes it (`take=False` elsewhere: the others follow process 0).

Foundation layer (standard library, etils and fsspec only): the trainer's `train/run_lock.py`
and synth's generator both use it.
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

from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path, is_url


class DirInUse(ValueError):
    """Another live process holds the directory (one line, exit 2, naming it)."""


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


class DirLock:
    """`with DirLock(directory, "x.lock", ...):` — held for the block; raises `in_use` naming the holder.

    `holder_name` ("trainer") and `advice` (what the refused user should do) word the refusal;
    `in_use` is the exception raised (a DirInUse subclass the caller's CLI maps to exit 2).
    """

    in_use: type[DirInUse] = DirInUse
    holder_name = "process"
    advice = "wait for it, stop it, or use another directory"
    logger = "agentrefine_jax"  # the tool's logger: its notes go where the tool's progress goes

    def __init__(self, root: str | os.PathLike[str], lock_name: str, *, take: bool = True) -> None:
        self.root = as_path(root)
        self.lock_name = lock_name
        self.path: epath.Path = self.root / lock_name
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
        aside = self.path.with_name(f"{self.lock_name}.stale-{self.body['token']}")
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
                    logging.getLogger(self.logger).warning(
                        f"NOTE: took over the stale lock {self.path} of a {self.holder_name} that is gone "
                        f"({_describe(holder)})"
                    )
                continue
            where = (
                ""
                if same_host
                else f" (another host: if that {self.holder_name} is gone, delete the lock file)"
            )
            raise self.in_use(
                f"{self.root} is in use by another {self.holder_name} ({_describe(holder)}){where}; "
                f"{self.advice}"
            )
        raise self.in_use(f"could not take the lock {self.path}: it keeps changing hands")

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
            logging.getLogger(self.logger).warning(f"WARNING: could not remove the lock {self.path} ({e})")

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.release()
