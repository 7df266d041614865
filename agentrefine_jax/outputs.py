"""Output paths every CLI writes: checked before any work, written so nothing is ever lost.

The rules (one owner, so every tool follows them the same way):

* A file output is written to a new temporary sibling (a unique name this run created), fsynced,
  then renamed over the final name: a crash leaves the old file or the new one, never half of one.
  It may replace a regular file (the output the user named), never a directory, a device or one
  of the run's own inputs.
* A directory output (an HF export, a checkpoint root, the demo's work dir) is written into a new
  temporary sibling directory and renamed into place. An existing non-empty directory is refused
  unless `overwrite`, and even then only when this project wrote it: it must hold the marker file
  (`MARKER`) that every directory output gets, nothing beyond what the marker lists, and must not
  be a training run directory. Nothing else is ever deleted or renamed: a user's `DIR.old/` or
  `DIR.partial/` is just another name.
* Wrong kinds (a file where a directory belongs and the reverse), parents that cannot be written
  and outputs that would contain the command's own inputs are refused up front with an
  `OutputError` (a ValueError: every CLI turns it into one `[tool] error: ...` line and exit 2).

Standard library only: config checks and light CLIs import it before jax.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

MARKER = ".agentrefine_output.json"
# What a training run directory holds (agentrefine_jax.train.run_dir): never an output to replace.
RUN_DIR_ENTRIES = ("checkpoints", "checkpoints_rejected", "metrics.jsonl", "tensorboard")

PathLike = str | os.PathLike[str]


class OutputError(ValueError):
    """An output path that cannot be used as asked (refused before anything is written)."""


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    p = path.absolute()
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _named(flag: str, p: PathLike) -> str:
    """`--out /x` or `train.export_hf_at_end=/x`: how an error names the path it refuses."""
    return f"{flag}{p}" if flag.endswith("=") else f"{flag} {p}"


def check_parent(path: PathLike, flag: str = "--out") -> pathlib.Path:
    """`path`'s parent can be created and written: its nearest existing ancestor is a writable dir."""
    p = pathlib.Path(path)
    anc = _nearest_existing(p.absolute().parent)
    if not anc.is_dir():
        raise OutputError(f"{_named(flag, p)}: {anc} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputError(f"{_named(flag, p)}: cannot write in {anc} (permission denied or read-only)")
    return p


def _same_or_inside(inner: PathLike, outer: PathLike) -> bool:
    a, b = os.path.realpath(inner), os.path.realpath(outer)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


# ------------------------------------------------------------------------------------ files


def check_file(path: PathLike, *, inputs: Iterable[PathLike] = (), flag: str = "--out") -> pathlib.Path:
    """A file output: not a directory or special file, a writable parent, not one of `inputs`."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise OutputError(f"{_named(flag, p)} is a directory; name a file")
    if os.path.lexists(p) and not (p.is_file() or p.is_symlink()):
        raise OutputError(f"{_named(flag, p)} exists and is not a regular file")
    for src in inputs:
        src_path = pathlib.Path(src)
        if not src_path.exists():
            continue  # nothing to destroy; the command reports the missing input itself
        # A file inside an input directory is an input too (the directory's files were read).
        inside = src_path.is_dir() and p.exists() and _same_or_inside(p, src_path)
        if inside or _same(p, src_path):
            raise OutputError(f"{_named(flag, p)} is also an input ({src}); writing it would destroy it")
    return check_parent(p, flag)


def _same(a: pathlib.Path, b: pathlib.Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """A temporary path beside `path` to write (e.g. a figure library's `savefig`); renamed onto
    `path` only when the block ends without an error. The temporary file never survives."""
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp" + p.suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for the temporary name only
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(p.parent)


@contextlib.contextmanager
def open_atomic(path: PathLike, *, newline: str | None = None) -> Iterator[TextIO]:
    """A text file to stream into; it replaces `path` only when the block ends without an error
    (temporary sibling, fsync, rename: see `atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline=newline) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_text(path: PathLike, text: str) -> None:
    """Write `text` to `path` atomically (see `open_atomic`)."""
    with open_atomic(path) as f:
        f.write(text)


def json_dumps(obj: object, **kwargs: Any) -> str:
    """The one JSON encoder of every file and line this project writes: strict RFC 8259, so `NaN` and
    `Infinity` raise (a writer puts `null` and the reason instead) and every JSON parser reads our files.
    Other arguments as `json.dumps`'. tests/test_strict_json.py checks no module calls `json.dump(s)`."""
    return json.dumps(obj, allow_nan=False, **kwargs)


def write_json(path: PathLike, obj: object, *, indent: int | None = 1) -> None:
    write_text(path, json_dumps(obj, ensure_ascii=False, indent=indent))


def fsync_dir(path: PathLike) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems refuse a dir fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ directories


def check_writable_dir(path: PathLike, *, flag: str = "--out") -> pathlib.Path:
    """A directory the command adds to or resumes in (no replacing): right kind, writable."""
    p = pathlib.Path(path)
    if os.path.lexists(p) and not p.is_dir():
        raise OutputError(f"{_named(flag, p)} exists and is not a directory")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise OutputError(f"{_named(flag, p)}: cannot write in it (permission denied or read-only)")
        return p
    return check_parent(p, flag)


def _listing(root: pathlib.Path) -> set[str]:
    """Every file and directory under `root`, as relative POSIX paths (the marker's record)."""
    names = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = pathlib.Path(dirpath).relative_to(root)
        for name in (*dirnames, *filenames):
            names.add((rel / name).as_posix())
    return names - {MARKER}


def _is_run_dir(p: pathlib.Path) -> bool:
    if any(os.path.lexists(p / name) for name in RUN_DIR_ENTRIES):
        return True
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "train" in config  # a run's Config, not an HF config


def project_written(path: PathLike) -> str | None:
    """None when `path` is a directory this project wrote and nothing else since; else why not."""
    p = pathlib.Path(path)
    if _is_run_dir(p):
        return "is a training run directory; it is never replaced"
    try:
        marker = json.loads((p / MARKER).read_text())
        recorded = set(marker["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"was not written by this project (no {MARKER}); it is never replaced"
    foreign = sorted(_listing(p) - recorded)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"holds files this project did not write ({shown}); it is not replaced"
    return None


def check_dir(
    path: PathLike,
    *,
    overwrite: bool = False,
    protect: Iterable[PathLike] = (),
    flag: str = "--out",
) -> pathlib.Path:
    """A directory output `publish_dir` may create (or, with `overwrite`, replace): refuse otherwise."""
    p = pathlib.Path(path)
    if p.is_symlink():
        raise OutputError(f"{_named(flag, p)} is a symbolic link; name the directory itself")
    if os.path.lexists(p) and not p.is_dir():
        raise OutputError(f"{_named(flag, p)} exists and is not a directory")
    for src in protect:
        if os.path.exists(src) and _same_or_inside(src, p):
            raise OutputError(f"{_named(flag, p)} holds the input {src}; choose another directory")
    check_parent(p, flag)
    if p.is_dir() and any(p.iterdir()):
        if not overwrite:
            raise OutputError(
                f"{_named(flag, p)} exists and is not empty; choose a new directory "
                "(--overwrite replaces only an earlier output of this project)"
            )
        why = project_written(p)
        if why:
            raise OutputError(f"{_named(flag, p)} {why}")
    return p


def mark(directory: PathLike, tool: str) -> None:
    """Record what this project wrote in `directory` (what `--overwrite` may later replace)."""
    d = pathlib.Path(directory)
    record = {"written_by": f"agentrefine_jax {tool}".strip(), "entries": sorted(_listing(d))}
    (d / MARKER).write_text(json.dumps(record, indent=1) + "\n")


@contextlib.contextmanager
def publish_dir(
    path: PathLike,
    *,
    tool: str,
    overwrite: bool = False,
    protect: Iterable[PathLike] = (),
    writer: bool = True,
    flag: str = "--out",
) -> Iterator[pathlib.Path]:
    """Yield a new empty temporary sibling of `path` to write into; on success mark it and rename it
    into place (replacing an earlier output of this project only with `overwrite`); on any error
    (or Ctrl-C) remove the temporary directory and nothing else.

    `writer=False` (the other hosts of a multi-host export, which take part in gathers but write
    nothing there) yields a private scratch directory that is discarded.
    """
    protect = list(protect)
    final = check_dir(path, overwrite=overwrite, protect=protect, flag=flag).absolute()
    if not writer:
        with tempfile.TemporaryDirectory(prefix="agentrefine-unpublished-") as scratch:
            yield pathlib.Path(scratch)
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{final.name}.partial-"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make the published dir private
        yield tmp
        mark(tmp, tool)
        check_dir(final, overwrite=overwrite, protect=protect, flag=flag)  # it may have changed meanwhile
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _swap_in(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename `tmp` to `final`; an existing `final` was checked (empty, or ours to replace)."""
    if final.is_dir() and any(final.iterdir()):
        old = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{final.name}.old-"))
        os.rename(final, old)  # onto our own empty directory: atomic
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)  # put the earlier output back
            raise
        shutil.rmtree(old)
    else:
        try:
            os.rename(tmp, final)  # replaces an empty directory; fails if one appeared that is not
        except OSError as e:
            raise OutputError(f"{final} appeared while writing and is not empty; not replaced") from e
    fsync_dir(final.parent)
