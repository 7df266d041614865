"""Record sources: JSONL, JSON, parquet files, directories of them, or `datasets` datasets.

All inputs are concatenated into one indexable record space so that processes can shard by
record (record i belongs to process i % process_count), which works with any number of
files. JSONL files are indexed by one streaming pass (byte range and line number of every
non-blank line) and only the requested lines are read (pread) and parsed, so memory does not
grow with the file. JSON / JSONL text is UTF-8 (BOM optional) or UTF-16/32 with a BOM; without
a BOM, UTF-16/32 is refused (`detect_encoding`). Every record carries a location ("file:line")
for error reports.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
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


# Byte-order marks, longest first (UTF-32-LE's starts with UTF-16-LE's).
_BOMS = (
    (b"\x00\x00\xfe\xff", "utf-32-be", 4),
    (b"\xff\xfe\x00\x00", "utf-32-le", 4),
    (b"\xef\xbb\xbf", "utf-8", 1),
    (b"\xfe\xff", "utf-16-be", 2),
    (b"\xff\xfe", "utf-16-le", 2),
)
_UNIT_DTYPES = {"utf-8": "u1", "utf-16-le": "<u2", "utf-16-be": ">u2", "utf-32-le": "<u4", "utf-32-be": ">u4"}
# What bytes.strip() strips: a line holding only these is blank (no row).
_BLANK = np.array([0x20, 0x09, 0x0A, 0x0D, 0x0B, 0x0C])
_SCAN_BLOCK = 8 << 20  # bytes per read while indexing: the index costs this much memory, not the file


def detect_encoding(path: pathlib.Path) -> tuple[str, int]:
    """(codec, BOM length in bytes) of a JSON / JSONL file: UTF-8 (BOM optional), UTF-16/32 with a BOM.

    JSON text starts with an ASCII character, so UTF-16/32 without a BOM shows as NUL bytes
    around the first one (RFC 4627's rule): refused, since the byte order would be a guess.
    """
    with open(path, "rb") as f:
        head = f.read(4)
    for bom, codec, _unit in _BOMS:
        if head.startswith(bom):
            return codec, len(bom)
    guess = None
    if len(head) >= 4 and head[:3] == b"\0\0\0" and head[3]:
        guess = "UTF-32-BE"
    elif len(head) >= 4 and head[0] and head[1:4] == b"\0\0\0":
        guess = "UTF-32-LE"
    elif len(head) >= 2 and not head[0] and head[1]:
        guess = "UTF-16-BE"
    elif len(head) >= 2 and head[0] and not head[1]:
        guess = "UTF-16-LE"
    if guess:
        raise ValueError(
            f"{path}: looks like {guess} text without a byte-order mark; save it as UTF-8 "
            "(or as UTF-16/UTF-32 with a BOM)"
        )
    return "utf-8", 0


def _has_content(units: np.ndarray) -> bool:
    return bool(len(units)) and not np.isin(units, _BLANK).all()


def _index_lines(path: pathlib.Path, codec: str, bom: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte start, byte end (newline excluded) and 1-based line number of every non-blank line.

    Streams the file in blocks of code units (so UTF-16/32 newlines are found as whole code
    units, never inside another character): memory is the block plus 24 bytes per row.
    """
    dtype = np.dtype(_UNIT_DTYPES[codec])
    unit = dtype.itemsize
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    lines: list[np.ndarray] = []
    line_start = bom  # byte offset where the current (unfinished) line starts
    line_content = False  # whether it holds a non-blank code unit so far
    lineno = 0  # newlines seen
    pos = bom
    block_size = max(unit, _SCAN_BLOCK - _SCAN_BLOCK % unit)
    with open(path, "rb") as f:
        f.seek(bom)
        while True:
            block = f.read(block_size)
            usable = len(block) - len(block) % unit  # a torn last code unit: not a newline
            if not usable:
                break
            units = np.frombuffer(block, dtype=dtype, count=usable // unit)
            nl = np.flatnonzero(units == 0x0A)
            if len(nl):
                # line k of this block spans units [begin_k, nl_k); the first began before the block
                begin = np.concatenate(([0], nl[:-1] + 1))
                # Almost every row starts with "{": only lines starting with a blank are scanned.
                has = (nl > begin) & ~np.isin(units[np.minimum(begin, nl)], _BLANK)
                for k in np.flatnonzero((nl > begin) & ~has):
                    has[k] = _has_content(units[begin[k] : nl[k]])
                has[0] |= line_content
                line_starts = pos + begin * unit
                line_starts[0] = line_start
                keep = np.flatnonzero(has)
                starts.append(line_starts[keep])
                ends.append(pos + nl[keep] * unit)
                lines.append(lineno + 1 + keep)
                lineno += len(nl)
                line_start = pos + (int(nl[-1]) + 1) * unit
                line_content = _has_content(units[int(nl[-1]) + 1 :])
            else:
                line_content = line_content or _has_content(units)
            pos += usable
            if len(block) < block_size:
                break
    if line_content:  # a last line without a newline
        starts.append(np.asarray([line_start]))
        ends.append(np.asarray([path.stat().st_size]))
        lines.append(np.asarray([lineno + 1]))

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    return cat(starts), cat(ends), cat(lines)


class _JsonlSource(_Source):
    """One row per line. Only a line index is held (24 bytes a row); rows are read with pread on
    demand, so a file of any size costs memory in proportion to the rows asked for at once."""

    def __init__(self, path: pathlib.Path, encoding: tuple[str, int] | None = None):
        self.label = str(path)
        self.path = path
        self.codec, bom = encoding or detect_encoding(path)
        self.starts, self.ends, self.lines = _index_lines(path, self.codec, bom)

    def __len__(self) -> int:
        return len(self.starts)

    def read(self, local: Sequence[int]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if not len(local):
            return out
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i in local:
                start, end = int(self.starts[i]), int(self.ends[i])
                raw = os.pread(fd, end - start, start)
                where = f"{self.label}:{int(self.lines[i])}"
                try:
                    # UTF-8 bytes go straight to the parser (it validates them); others decode first.
                    out.append((where, json.loads(raw if self.codec == "utf-8" else raw.decode(self.codec))))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    out.append((where, RowError("invalid json", str(e))))
                except RecursionError:  # e.g. 100k nested brackets: a bad row, not a crash
                    out.append((where, RowError(TOO_DEEP, "JSON nested deeper than the parser allows")))
        finally:
            os.close(fd)
        return out


def _read_text(path: pathlib.Path, encoding: tuple[str, int]) -> str:
    codec, bom = encoding
    return path.read_bytes()[bom:].decode(codec)


class _ListSource(_Source):
    """A JSON file holding a list of rows (or {"data": [...]}); locations are list indices.

    Parsed whole (a JSON document has no row boundaries to index): large data belongs in JSONL.
    """

    def __init__(self, path: pathlib.Path, encoding: tuple[str, int] | None = None):
        self.label = str(path)
        try:
            obj = json.loads(_read_text(path, encoding or detect_encoding(path)))
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
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return _TableSource(str(path), pq.read_table(path))
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported file type (use {DATA_SUFFIXES})")
    encoding = detect_encoding(path)  # refuses UTF-16/32 without a BOM before anything is read
    if path.suffix == ".json" and _is_single_json(path, encoding):
        return _ListSource(path, encoding)
    # Many tools write JSON Lines with a .json suffix: those are read as lines.
    return _JsonlSource(path, encoding)


def _is_single_json(path: pathlib.Path, encoding: tuple[str, int]) -> bool:
    """Whether a .json file is one JSON document (a list) rather than JSON Lines.

    Decided from the first line when it can be: a complete value followed by more text is JSON
    Lines (no need to read a large file whole to find that out).
    """
    codec, bom = encoding
    unit = np.dtype(_UNIT_DTYPES[codec]).itemsize
    with open(path, "rb") as f:
        f.seek(bom)
        head = f.read(1 << 20)
    head = head[: len(head) - len(head) % unit].decode(codec, errors="replace")
    first = head.lstrip()[:1]
    if first not in ("[", "{"):
        return False
    line, newline, rest = head.lstrip().partition("\n")
    if newline and rest.strip():
        try:
            json.loads(line)
            return False  # a whole value on the first line and more after it: JSON Lines
        except (json.JSONDecodeError, RecursionError):
            pass  # a document spread over lines (or a bad first row): parse it whole below
    try:
        json.loads(_read_text(path, encoding))
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
