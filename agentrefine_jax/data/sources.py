"""Record sources: JSONL, JSON, parquet files, directories of them, or `datasets` datasets.

All inputs are concatenated into one indexable record space so that processes can shard by
record (record i belongs to process i % process_count), which works with any number of
files. JSONL files are indexed by line offsets and only the requested lines are parsed, so a
process decodes only its own shard. Every record carries a location ("file:line") for error
reports.
"""

from __future__ import annotations

import bisect
import glob
import json
import mmap
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from agentrefine_jax.data.schema import TOO_DEEP, RowError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class _Source:
    label: str

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, local: Sequence[int]) -> list[tuple[str, Any]]:
        """(location, raw row or RowError) for each local index."""
        raise NotImplementedError


class _JsonlSource(_Source):
    def __init__(self, path: pathlib.Path):
        self.label = str(path)
        self.path = path
        data = path.read_bytes()
        # Start offset and 1-based line number of every non-blank line (blank lines hold no row).
        starts, lines = [], []
        pos = 0
        lineno = 0
        n = len(data)
        while pos < n:
            lineno += 1
            end = data.find(b"\n", pos)
            end = n if end < 0 else end
            if data[pos:end].strip():
                starts.append(pos)
                lines.append(lineno)
            pos = end + 1
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lines = np.asarray(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def read(self, local: Sequence[int]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if not len(local):
            return out
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for i in local:
                start = int(self.starts[i])
                end = mm.find(b"\n", start)
                raw = mm[start : (len(mm) if end < 0 else end)]
                where = f"{self.label}:{int(self.lines[i])}"
                try:
                    out.append((where, json.loads(raw)))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    out.append((where, RowError("invalid json", str(e))))
                except RecursionError:  # e.g. 100k nested brackets: a bad row, not a crash
                    out.append((where, RowError(TOO_DEEP, "JSON nested deeper than the parser allows")))
        return out


class _ListSource(_Source):
    """A JSON file holding a list of rows (or {"data": [...]}); locations are list indices."""

    def __init__(self, path: pathlib.Path):
        self.label = str(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e}); use .jsonl for one row per line") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON nested deeper than the parser allows") from None
        if isinstance(obj, dict) and isinstance(obj.get("data"), list):
            obj = obj["data"]
        if not isinstance(obj, list):
            raise ValueError(f"{path}: a .json input must hold a list of rows (or {{'data': [...]}})")
        self.rows = obj

    def __len__(self) -> int:
        return len(self.rows)

    def read(self, local: Sequence[int]) -> list[tuple[str, Any]]:
        return [(f"{self.label}:[{i}]", self.rows[i]) for i in local]


class _TableSource(_Source):
    """Parquet files (pyarrow) or `datasets.Dataset` objects; locations are row indices."""

    def __init__(self, label: str, table: Any):
        self.label = label
        self.table = table

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def read(self, local: Sequence[int]) -> list[tuple[str, Any]]:
        if not len(local):
            return []
        idx = [int(i) for i in local]
        import pyarrow as pa

        if isinstance(self.table, pa.Table):
            rows = self.table.take(idx).to_pylist()
        else:  # datasets.Dataset
            rows = list(self.table.select(idx))
        return [(f"{self.label}:row {i}", r) for i, r in zip(idx, rows, strict=True)]


def _expand(spec: str) -> list[pathlib.Path] | None:
    """Files named by a path, a glob, or a directory of data files; None if nothing local matched."""
    if any(ch in spec for ch in "*?["):
        paths = sorted(pathlib.Path(p) for p in glob.glob(spec, recursive=True))
        return [p for p in paths if p.suffix in DATA_SUFFIXES and p.is_file()] or None
    p = pathlib.Path(spec).expanduser()
    if p.is_file():
        return [p]
    if p.exists() and not p.is_dir():  # a FIFO, device or socket: never a Hub dataset name
        raise ValueError(
            f"{p} is not a regular file or directory (a FIFO, device or socket); name a data file"
        )
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
            return None  # a `datasets.save_to_disk` directory, loaded below
        files = sorted(q for q in p.rglob("*") if q.suffix in DATA_SUFFIXES and q.is_file())
        if not files:
            raise FileNotFoundError(f"{p}: directory has no {DATA_SUFFIXES} files")
        return files
    return None


def _file_source(path: pathlib.Path) -> _Source:
    if path.suffix == ".jsonl":
        return _JsonlSource(path)
    if path.suffix == ".json":
        # Many tools write JSON Lines with a .json suffix: try a list first, then lines.
        text_head = path.open("rb").read(1)
        return (
            _ListSource(path) if text_head in (b"[", b"{") and _is_single_json(path) else _JsonlSource(path)
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return _TableSource(str(path), pq.read_table(path))
    raise ValueError(f"{path}: unsupported file type (use {DATA_SUFFIXES})")


def _is_single_json(path: pathlib.Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return True
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    except RecursionError:  # one too-deep value: read it as JSON Lines, where it is a counted skip
        return False


def _datasets_source(spec: str) -> _Source:
    """A `datasets.save_to_disk` directory, or `NAME[:SPLIT]` through `datasets.load_dataset`."""
    import datasets

    p = pathlib.Path(spec).expanduser()
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{p}: DatasetDict without a 'train' split (has {list(ds)})")
            ds = ds["train"]
        return _TableSource(str(p), ds)
    name, _, split = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # offline / unknown name: say what was tried and how to fix it
        raise FileNotFoundError(
            f"{spec!r} is not a local file or directory, and `datasets.load_dataset({name!r}, "
            f"split={split or 'train'!r})` failed ({type(e).__name__}: {e}). Without hub access, download "
            "the parquet files elsewhere and pass their path."
        ) from None
    return _TableSource(spec, ds)


class RecordSet:
    """Concatenation of sources with global record indices."""

    def __init__(self, specs: Sequence[str]):
        if isinstance(specs, str):
            specs = [specs]
        if not specs:
            raise ValueError("no input files given")
        self.sources: list[_Source] = []
        for spec in specs:
            paths = _expand(str(spec))
            if paths is None:
                self.sources.append(_datasets_source(str(spec)))
            else:
                self.sources.extend(_file_source(p) for p in paths)
        self.bounds = np.cumsum([0] + [len(s) for s in self.sources]).tolist()

    def __len__(self) -> int:
        return self.bounds[-1]

    def read(self, indices: Sequence[int]) -> list[tuple[str, Any]]:
        """Rows for global `indices`, in the given order."""
        by_source: dict[int, list[tuple[int, int]]] = {}
        for pos, g in enumerate(indices):
            s = bisect.bisect_right(self.bounds, int(g)) - 1
            if not 0 <= g < len(self):
                raise IndexError(f"record {g} out of range (0..{len(self) - 1})")
            by_source.setdefault(s, []).append((pos, int(g) - self.bounds[s]))
        out: list[tuple[str, Any]] = [("", None)] * len(indices)
        for s, items in by_source.items():
            rows = self.sources[s].read([loc for _, loc in items])
            for (pos, _), row in zip(items, rows, strict=True):
                out[pos] = row
        return out

    def describe(self) -> str:
        return ", ".join(f"{s.label} ({len(s)} rows)" for s in self.sources)
