"""Writing the analysis files: each is written to a temporary sibling and renamed into place, so
a stopped run never leaves a half-written CSV or PNG under the name of a finished one (the rules
and the mechanism are agentrefine_jax.outputs'; this module adds the formats analyze writes)."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

from agentrefine_jax.outputs import atomic_path as atomic
from agentrefine_jax.outputs import json_dumps, open_atomic, write_text

__all__ = ["atomic", "write_csv", "write_json", "write_text"]


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json_dumps(obj, ensure_ascii=False, indent=1) + "\n")


def write_csv(path: str | os.PathLike[str], header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open_atomic(path, newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
