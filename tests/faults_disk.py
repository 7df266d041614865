"""Shared material for the fault tests of issue 32 (no tests here): a real small filesystem that
fills up (tmpfs, needs root: skipped with the reason otherwise), the one-line assertion, and a
byte snapshot of a tree (nothing of the user's may change)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

NOISE = ("Traceback", "Exception in thread", "terminate called")


@contextlib.contextmanager
def small_disk(size: str = "64k") -> Iterator[pathlib.Path]:
    """A tmpfs of `size` mounted on a fresh directory: writes past it fail with a real ENOSPC."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="agentrefine-fulldisk-"))
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if res.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root): {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def env(**extra: str) -> dict[str, str]:
    """The test's environment for a child CLI: offline, unbuffered, our tree first (inherited)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "XLA_FLAGS"))}
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    e.update(extra)
    return e


def run(tool: str, *args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"agentrefine_jax.{tool}", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", env()), **kw
    )


def one_line(res: subprocess.CompletedProcess, tool: str, code: int, *needles: str) -> str:
    """The run ended with exit `code` and exactly one `[tool] error:` line holding `needles`, no traceback."""
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert not any(n in res.stderr for n in NOISE), res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"[{tool}] error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(root: pathlib.Path) -> dict[str, str]:
    """Every entry under `root` (not following links): a file's sha256, a link's target, 'dir'."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
