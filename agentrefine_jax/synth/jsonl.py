"""Crash-safe JSON/JSONL file primitives.

Results are appended one line per `os.write` on an O_APPEND descriptor and fsynced, so a kill
leaves either the whole line or (at worst) a torn tail without a newline, which
`read_records` repairs.  Whole files are replaced atomically via a temp file + os.replace.
"""

from __future__ import annotations

import contextlib
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
        size = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:  # a regular-file write is whole in practice; loop for the pathological case
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        except OSError:
            # A full disk can take part of the line: cut it off so the file stays whole rows.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def write_atomic(path: str | pathlib.Path, rows: Iterable[Any]) -> None:
    """Write JSONL rows to `path` atomically (agentrefine_jax.outputs owns how)."""
    outputs.write_text(path, "".join(dumps(r) + "\n" for r in rows))


def write_json_atomic(path: str | pathlib.Path, obj: Any) -> None:
    outputs.write_json(path, obj)


def read_records(path: str | pathlib.Path, *, complete: bool = False) -> Any:
    """Records of an append-only JSONL file, repairing a torn tail left by a kill.

    Returns (records, torn, corrupt): `torn` is 1 if an unterminated last line that is not valid
    JSON was cut off (the file is truncated back to its last newline so later appends stay
    line-aligned); an unterminated last line that *is* valid JSON is a whole row and is kept,
    its newline added. `corrupt` counts complete lines that are not JSON objects (kept in the
    file, reported). With `complete=True` a fourth item says whether a newline was added.
    Only a file this project appended to may be passed (synth's own output directory).
    """
    p = pathlib.Path(path)
    if not p.exists():
        return ([], 0, 0, 0) if complete else ([], 0, 0)
    data = p.read_bytes()
    torn = completed = 0
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:].decode("utf-8"))
            whole = True
        except (UnicodeDecodeError, json.JSONDecodeError):
            whole = False
        with open(p, "r+b") as f:
            if whole:  # a complete row whose newline is missing: keep it, add the newline
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
                data += b"\n"
                completed = 1
            else:
                f.truncate(cut)
                data = data[:cut]
                torn = 1
            f.flush()
            os.fsync(f.fileno())
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
    return (records, torn, corrupt, completed) if complete else (records, torn, corrupt)
