"""Writing the analysis files: each is written to a temporary sibling and renamed into place, so
a stopped run never leaves a half-written CSV or PNG under the name of a finished one."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pathlib
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def atomic(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yields a temporary path beside `path`; renamed onto `path` when the block finishes."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for the temporary name only
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json.dumps(obj, ensure_ascii=False, indent=1) + "\n")


def write_csv(path: str | os.PathLike[str], header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with atomic(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
