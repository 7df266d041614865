"""`synth generate --out DIR`: a directory the generator made, resumes, and holds alone.

`generate` appends to and repairs files in its output directory, so it must never do that to a
directory it did not make:

* it adopts an existing non-empty directory only if the directory carries its marker
  (`MARKER`, written when the generator creates or first adopts the directory), or — for
  directories written before the marker existed — holds nothing but the generator's own names
  with its `summary.json`; anything else (a user's `trajectories.jsonl` in a directory of their
  own, a project checkout) is refused with one line, before anything is written;
* a symlinked `--out` is refused (a resumable directory is named as itself, like `export`'s);
* one generator per directory: `LOCK` through the shared lock of agentrefine_jax/dir_lock.py
  (the trainer's mechanism): a second `generate` on the same `--out` is refused while the first
  is alive; a lock left by a killed one is taken over with a note.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import time
from collections.abc import Iterator

from agentrefine_jax import outputs
from agentrefine_jax.dir_lock import DirInUse, DirLock

MARKER = ".agentrefine_synth.json"
LOCK = "synth.lock"


class OutDirError(outputs.OutputError):
    """An --out the generator must not write into (one line, exit 2)."""


class OutDirInUse(DirInUse):
    """Another live `synth generate` holds the --out directory (one line, exit 2)."""


class GeneratorLock(DirLock):
    in_use = OutDirInUse
    holder_name = "synth generate"
    advice = "one synth generate per --out: wait for it, stop it, or use another --out"
    logger = "agentrefine_jax.synth"


def _legacy(out: pathlib.Path, own: frozenset[str]) -> bool:
    """A directory a generator wrote before the marker existed: only its names, its summary."""
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    ours = isinstance(summary, dict) and {"personas", "usage", "pid"} <= summary.keys()
    return ours and {p.name for p in out.iterdir()} <= own


def check(out: pathlib.Path, own: frozenset[str]) -> None:
    """Refuse an --out the generator must not write into (see the module docstring)."""
    if out.is_symlink():
        raise OutDirError(f"--out {out} is a symbolic link; name the directory itself")
    if os.path.lexists(out) and not out.is_dir():
        raise OutDirError(f"--out {out} exists and is not a directory")
    outputs.check_writable_dir(out)
    if not out.is_dir():
        return
    names = {p.name for p in out.iterdir()} - {LOCK}
    if names and MARKER not in names and not _legacy(out, own | {LOCK}):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise OutDirError(
            f"--out {out} is a non-empty directory that synth generate did not make ({shown}); "
            "name a new or empty directory (or one an earlier synth generate made, to resume)"
        )


@contextlib.contextmanager
def hold(out: pathlib.Path, own: frozenset[str]) -> Iterator[None]:
    """Check `out`, create it if needed, hold its lock and mark it as the generator's."""
    check(out, own)
    with GeneratorLock(out, LOCK):
        check(out, own)  # again under the lock: another process may have written meanwhile
        if not (out / MARKER).exists():
            outputs.write_json(
                out / MARKER,
                {
                    "written_by": "agentrefine_jax synth generate",
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                },
            )
        yield
