"""A long benchmark's record: the small files of its `--out` that let another machine go on with it.

A run of hours may outlive the machine it started on (a lent machine, a session whose disk is not
kept). Its `--out` holds checkpoints of hundreds of MB, but what the finished stages *produced* is
small: evaluation results, training records and logs, collected data. `save` copies those files into a
record directory (one that can be committed or copied off the machine) after each stage; `restore`
copies them into a new `--out` on the next machine, where the benchmark then skips the stages they
stand for. The record holds its own copy of the benchmark's manifest, so a record is only ever
continued by a run with the same settings, and nothing is written into a directory of someone else's.
"""

from __future__ import annotations

import pathlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from _outdir import OutDirError, prepare_out

from agentrefine_jax.outputs import write_text


def prepare(record: pathlib.Path, manifest: dict[str, Any], *, tool: str, what: str) -> None:
    """New or empty: start it; the same tool's record with the same settings: go on; else OutDirError."""
    try:
        prepare_out(record, manifest, tool=tool, what=f"{what} record")
    except OutDirError as e:
        raise OutDirError(str(e).replace("--out", "--record", 1)) from None


def _files(root: pathlib.Path, patterns: Sequence[str]) -> list[pathlib.Path]:
    """The files under `root` matching `patterns` (relative globs), as paths relative to `root`."""
    found = {p.relative_to(root) for pat in patterns for p in root.glob(pat) if p.is_file()}
    return sorted(found)


def _same(a: pathlib.Path, b: pathlib.Path) -> bool:
    return b.exists() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def save(
    out: pathlib.Path, record: pathlib.Path, patterns: Sequence[str], transient: Sequence[str] = ()
) -> int:
    """Copy `out`'s files matching `patterns` into `record` where new or changed (each written to a
    temporary sibling and renamed into place); how many were copied. `transient` patterns (among
    `patterns`: e.g. an unfinished evaluation's journal, which the evaluation removes when it finishes)
    are kept in the record only while `out` has them: the record's copy, written here, is then removed."""
    for rel in _files(record, transient):
        if not (out / rel).exists():
            (record / rel).unlink()
    copied = 0
    for rel in _files(out, patterns):
        src, dst = out / rel, record / rel
        if _same(src, dst):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_text(dst, src.read_text(encoding="utf-8", errors="replace"))
        copied += 1
    return copied


def restore(
    record: pathlib.Path, out: pathlib.Path, patterns: Sequence[str], log: Callable[[str], None]
) -> int:
    """Copy the record's files matching `patterns` into `out` where `out` lacks them (a file `out`
    already has is its own, newer work, and is kept); how many were copied."""
    copied = 0
    for rel in _files(record, patterns):
        dst = out / rel
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_text(dst, (record / rel).read_text(encoding="utf-8", errors="replace"))
        copied += 1
    if copied:
        log(f"restored {copied} file(s) from the record {record}")
    return copied


class Refresher:
    """While entered, call `save` every `every_s` seconds from a background thread, and serialise it
    with the caller's own calls (`__call__`). Why: `save` after each stage keeps what finished stages
    made, but a stage can run for hours (one task's evaluation: ~2 h for 128 demo worlds on 2 cores),
    and a machine taken away without a signal (a session's end) would lose all of its journal; with
    this it loses at most `every_s` of it. An evaluation's journal may be copied mid-append: its reader
    drops a last line cut short (eval/journal.py)."""

    def __init__(self, save: Callable[[], object], every_s: float) -> None:
        self._save, self.every_s = save, every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # the first error of a background save, reported once

    def __call__(self) -> None:
        with self._lock:
            self._save()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self()
            except OSError as e:  # a full disk: the stage goes on; the next save after it retries
                if self.failed is None:
                    self.failed = str(e)
                    print(f"[record] warning: a periodic save failed ({e}); retrying", file=sys.stderr)

    def __enter__(self) -> Refresher:
        self._thread = threading.Thread(target=self._loop, name="record-refresher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
