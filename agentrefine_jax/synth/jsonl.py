"""Crash-safe JSON/JSONL file primitives.

Results are appended one line per `os.write` on an O_APPEND descriptor and fsynced, so a kill
leaves either the whole line or (at worst) a torn tail without a newline, which
`read_records` repairs.  Whole files are replaced atomically via a temp file + os.replace.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any

from agentrefine_jax import outputs
from agentrefine_jax.outputs import json_dumps


def dumps(obj: Any) -> str:
    return json_dumps(obj, ensure_ascii=False, separators=(",", ":"))


def iter_lines(path: str | pathlib.Path) -> Iterator[str]:
    """Every line of a text file without its newline (a final newline adds no empty line)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line[:-1] if line.endswith("\n") else line


def append_record(path: str | pathlib.Path, obj: Any) -> None:
    """Append one JSON line with a single write, then fsync (callers serialize threads)."""
    data = (dumps(obj) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular-file write is whole in practice; loop for the pathological case
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | pathlib.Path, rows: Iterable[Any]) -> None:
    """Write JSONL rows to `path` atomically (agentrefine_jax.outputs owns how)."""
    outputs.write_text(path, "".join(dumps(r) + "\n" for r in rows))


def write_json_atomic(path: str | pathlib.Path, obj: Any) -> None:
    outputs.write_json(path, obj)


def read_records(path: str | pathlib.Path) -> tuple[list[dict[str, Any]], int, int]:
    """Records of an append-only JSONL file, repairing a torn tail left by a kill.

    Returns (records, torn, corrupt): `torn` is 1 if an unterminated last line was cut off
    (the file is truncated back to its last newline so later appends stay line-aligned);
    `corrupt` counts complete lines that are not JSON objects (kept in the file, reported).
    """
    p = pathlib.Path(path)
    if not p.exists():
        return [], 0, 0
    data = p.read_bytes()
    torn = 0
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(p, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        data = data[:cut]
        torn = 1
    records, corrupt = [], 0
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            corrupt += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            corrupt += 1
    return records, torn, corrupt
