"""A long benchmark's `--out` directory, which rerunning the same command resumes (mini_paper.py,
grpo_real.py): new or empty starts it, an earlier output of the same tool with the same settings resumes
it, anything else is refused with one line — nothing of someone else's is written into or over."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import Any

from agentrefine_jax.outputs import write_json


class OutDirError(ValueError):
    """`--out` cannot be used: one line for the user."""


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def prepare_out(out: pathlib.Path, manifest: dict[str, Any], *, tool: str, what: str) -> None:
    """Start (`out` new or empty: the manifest `<tool>.json` is written), resume (the same tool's manifest
    with the same settings), or raise OutDirError. `what` names the output in messages ("mini paper")."""
    if os.path.lexists(out) and not out.is_dir():
        raise OutDirError(f"--out {out} exists and is not a directory")
    path = out / f"{tool}.json"
    if out.is_dir() and any(out.iterdir()):
        try:
            old = json.loads(path.read_text())["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            raise OutDirError(
                f"--out {out} is not empty and holds no {path.name} (not a {what} output); "
                "choose a new directory"
            ) from None
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in manifest.items() if old.get(k) != v]
        if changed:
            raise OutDirError(
                f"--out {out} holds a {what} with other settings ({'; '.join(changed)}); "
                "use the same flags to resume, or a new --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, {"written_by": f"agentrefine_jax benchmarks/{tool}.py", "settings": manifest})
