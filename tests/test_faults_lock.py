"""One trainer per run directory: a second real trainer is refused in one line naming the holder,
while the first completes; stale locks (dead pid on this host, or a reused pid) are taken over."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from test_host_memory import _wanted_here
from test_train_loop import _finish, _strict_rows, _train

from agentrefine_jax import host_memory
from agentrefine_jax.train.run_lock import LOCK_NAME, RunDirInUse, RunLock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _write_lock(run_dir: pathlib.Path, **fields: object) -> pathlib.Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    body = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None, "started": "then"}
    (run_dir / LOCK_NAME).write_text(json.dumps({**body, **fields, "token": "x"}))
    return run_dir / LOCK_NAME


def test_second_trainer_on_a_run_dir_exits_2_naming_the_holder_and_the_first_completes(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(host_memory.ENV, "1")  # the first trainer also shows the huge-page re-exec
    first = _train(run_dir, "--set", "train.export_hf_at_end=none")
    monkeypatch.delenv(host_memory.ENV)
    try:
        deadline = time.time() + 300
        while not (run_dir / LOCK_NAME).exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()[0]
            time.sleep(0.1)
        if _wanted_here():  # the trainer re-executed itself with glibc's huge-page tunable
            environ = pathlib.Path(f"/proc/{first.pid}/environ").read_bytes().split(b"\0")
            assert f"GLIBC_TUNABLES={host_memory.TUNABLE}".encode() in environ
        code, out = _finish(_train(run_dir, "--set", "train.export_hf_at_end=none"), timeout=300)
        assert code == 2, out
        lines = out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("[train] error: "), out
        assert f"in use by another trainer (pid {first.pid} on host {socket.gethostname()}" in lines[0]
    finally:
        code, out = _finish(first, timeout=600)
    assert code == 0, out
    assert [r["step"] for r in _strict_rows(run_dir) if "loss" in r] == list(range(1, 9))
    assert not (run_dir / LOCK_NAME).exists()  # released at exit


def test_stale_lock_of_a_dead_pid_is_taken_over_with_a_notice(tmp_path, caplog):
    lock = _write_lock(tmp_path / "run", pid=_dead_pid())
    with caplog.at_level("WARNING", logger="agentrefine_jax.train"), RunLock(tmp_path / "run"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    # Only the lock's own records: a full suite run may log other warnings while this runs.
    messages = [r.getMessage() for r in caplog.records if r.name == "agentrefine_jax.train"]
    notes = [m for m in messages if "lock" in m]
    assert len(notes) == 1 and "took over the stale lock" in notes[0] and "\n" not in notes[0]
    assert not lock.exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # nothing left beside it


def test_a_reused_pid_is_stale_a_live_one_or_another_hosts_is_not(tmp_path):
    # This very process, but "started" at another time: the pid was reused, the holder is gone.
    _write_lock(tmp_path / "a", pid=os.getpid(), pid_start="1")
    with RunLock(tmp_path / "a"):
        pass
    # A live holder on this host (this process, its real start time) is refused by name.
    from agentrefine_jax.train.run_lock import _pid_start

    _write_lock(tmp_path / "b", pid=os.getpid(), pid_start=_pid_start(os.getpid()))
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
        RunLock(tmp_path / "b").acquire()
    # Another host's lock is never guessed stale, even with a pid that is dead here.
    lock = _write_lock(tmp_path / "c", host="elsewhere", pid=_dead_pid())
    with pytest.raises(RunDirInUse, match="another host: if that trainer is gone, delete the lock"):
        RunLock(tmp_path / "c").acquire()
    assert json.loads(lock.read_text())["host"] == "elsewhere"  # untouched
    # Processes other than 0 take no lock at all.
    with RunLock(tmp_path / "c", take=False):
        pass
    # A run dir the lock created is not left behind empty (a run refused before writing anything).
    with RunLock(tmp_path / "d" / "run"):
        assert (tmp_path / "d" / "run" / LOCK_NAME).exists()
    assert not (tmp_path / "d" / "run").exists() and (tmp_path / "d").is_dir()
