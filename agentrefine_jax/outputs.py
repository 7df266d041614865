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
import errno
import hashlib
import io
import json
import os
import pathlib
import shutil
import tempfile
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

MARKER = ".agentrefine_output.json"
# What a training run directory holds (agentrefine_jax.train.run_dir): never an output to replace.
RUN_DIR_ENTRIES = ("checkpoints", "checkpoints_rejected", "metrics.jsonl", "tensorboard")

PathLike = str | os.PathLike[str]
# A full disk (or quota, or file-size limit): the errors a finished output is rescued from.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class OutputError(ValueError):
    """An output path that cannot be used as asked (refused before anything is written)."""


class OutputWriteError(Exception):
    """Writing an output failed after the work was done (disk full, file too large, I/O error).

    Its text is the one line a CLI prints (exit 1): the file, the reason, and where the finished
    content was kept instead (`rescued`, under $TMPDIR) when that succeeded."""

    def __init__(
        self, path: PathLike, error: OSError, rescued: pathlib.Path | None = None, *, tried: bool = True
    ) -> None:
        self.path, self.error, self.rescued = path, error, rescued
        reason = error.strerror or str(error)
        if rescued is not None:
            kept = f"; the finished results are kept in {rescued}"
        else:
            kept = f"; they could not be kept in {tempfile.gettempdir()} either" if tried else ""
        super().__init__(f"could not write {path}: {reason}{kept}")


# Temporary siblings are named from at most this much of the target's name (a 255-byte file
# name is legal; its sibling with a prefix and random suffix would not be).
_NAME_KEPT = 24
_SUFFIX_KEPT = 16


def _tmp_prefix(name: str) -> str:
    return f".{name[:_NAME_KEPT]}."


def _tmp_suffix(p: pathlib.Path) -> str:
    """`.tmp` plus the target's extension when short (a figure library picks its format by it)."""
    return ".tmp" + (p.suffix if len(p.suffix) <= _SUFFIX_KEPT else "")


def rescue_location() -> pathlib.Path:
    """A new directory under $TMPDIR for finished work its output could not take (OSError if not)."""
    return pathlib.Path(tempfile.mkdtemp(prefix="agentrefine-rescued-"))


def rescue(name: str, data: bytes) -> pathlib.Path | None:
    """Keep `data` in a new directory under $TMPDIR (`agentrefine-rescued-*/<name>`); None if
    that fails too. For finished results whose output could not be written."""
    try:
        where = rescue_location()
        kept = where / (name[:200] or "output")
        with open(kept, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return kept
    except OSError:
        return None


def rescue_dir(name: str, write: Callable[[pathlib.Path], None], *, tool: str) -> pathlib.Path | None:
    """Write a directory output again with `write(dir)`, into a new directory under $TMPDIR
    (`agentrefine-rescued-*/<name>`, marked as `publish_dir` marks); None, with nothing left
    behind, if that fails too. For a directory whose own disk filled up after the work (an
    export: the parameters are still in memory; what reached the full disk was partial)."""
    where = None
    try:
        where = rescue_location()
        kept = where / (name[:200] or "output")
        kept.mkdir()
        write(kept)
        follow_umask(kept)
        mark(kept, tool)
        return kept
    except Exception:  # whatever stopped the rescue (a full $TMPDIR too): the original error is told
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)
        return None


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
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=_tmp_prefix(p.name), suffix=_tmp_suffix(p))
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


class _RescuingWriter(io.TextIOBase):
    """A text stream into the temporary sibling that, when a write fails (disk full, file too
    large), moves what was written so far and everything after it into a rescue file under
    $TMPDIR, so a long computation's output is never lost to a failed write."""

    _CHUNK = 1 << 20

    def __init__(self, tmp: str, name: str, newline: str | None) -> None:
        self._fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
        self._tmp, self._name = tmp, name
        self._newline = os.linesep if newline is None else newline
        self._pending: list[bytes] = []
        self._size = 0
        self._written = 0  # bytes of the sibling confirmed written (a failed write may leave a part)
        self.error: OSError | None = None
        self.rescued: pathlib.Path | None = None
        self._rescue_fd: int | None = None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        text = s.replace("\n", self._newline) if self._newline != "\n" and self._newline else s
        data = text.encode("utf-8")
        self._pending.append(data)
        self._size += len(data)
        if self._size >= self._CHUNK:
            self.flush()
        return len(s)

    def flush(self) -> None:
        data, self._pending, self._size = b"".join(self._pending), [], 0
        if not data:
            return
        if self.error is None:
            try:
                _write_all(self._fd, data)
                self._written += len(data)
                return
            except OSError as e:
                self._switch(e)
        if self._rescue_fd is not None:
            try:
                _write_all(self._rescue_fd, data)
            except OSError:
                os.close(self._rescue_fd)
                self._rescue_fd, self.rescued = None, None

    def _switch(self, error: OSError) -> None:
        """The first failed write: copy the sibling's bytes to a rescue file, carry on there."""
        self.error = error
        with open(self._tmp, "rb") as f:
            done = f.read(self._written)
        os.close(self._fd)
        self._fd = -1
        os.truncate(self._tmp, 0)  # give the space back: the sibling is abandoned
        self.rescued = rescue(self._name, done)
        if self.rescued is not None:
            self._rescue_fd = os.open(self.rescued, os.O_WRONLY | os.O_APPEND)

    def finish(self) -> None:
        self.flush()
        if self.error is None:
            try:
                os.fsync(self._fd)
            except OSError as e:
                self._switch(e)
        fds = [fd for fd in (self._fd, self._rescue_fd) if fd is not None and fd >= 0]
        if self._rescue_fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._rescue_fd)
        for fd in fds:
            os.close(fd)
        self._fd, self._rescue_fd = -1, None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@contextlib.contextmanager
def open_atomic(path: PathLike, *, newline: str | None = None) -> Iterator[TextIO]:
    """A text file (UTF-8) to stream into; it replaces `path` only when the block ends without an
    error (temporary sibling, fsync, rename: see `atomic_path`). A write that fails (disk full,
    file too large) raises OutputWriteError at the end of the block, naming the file and the
    rescue file under $TMPDIR that holds the complete output instead."""
    p = pathlib.Path(path)
    in_body = False
    try:
        with atomic_path(p) as tmp:
            writer = _RescuingWriter(tmp, p.name, newline)
            try:
                in_body = True
                yield typing.cast(TextIO, writer)
                in_body = False
            finally:
                writer.finish()
            if writer.error is not None:
                raise OutputWriteError(p, writer.error, writer.rescued)
    except OSError as e:  # the temporary name, the rename (not the caller's own errors)
        if in_body:
            raise
        raise OutputWriteError(p, e, None, tried=False) from e


def write_text(path: PathLike, text: str) -> None:
    """Write `text` to `path` atomically (see `open_atomic`); when that fails, the text is kept
    under $TMPDIR and OutputWriteError names both."""
    try:
        with open_atomic(path) as f:
            f.write(text)
    except OutputWriteError as e:
        if e.rescued is None:
            raise OutputWriteError(
                path, e.error, rescue(pathlib.Path(path).name, text.encode("utf-8"))
            ) from e
        raise


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
    files = sorted(rel for rel in _listing(p) if (p / rel).is_file() or (p / rel).is_symlink())
    return changed_since_marked(p, files, marker)


def changed_since_marked(root: typing.Any, files: Iterable[str], marker: dict[str, typing.Any]) -> str | None:
    """None when every one of `files` (relative names under `root`, a local or epath/gs:// Path)
    still has the size and sha256 the marker recorded; else why the directory is not replaced.

    A marker of an earlier version (names only, no `files` record) proves nothing about contents:
    such a directory is refused too (the user removes it, or names a new directory)."""
    record = marker.get("files")
    if not isinstance(record, dict):
        return (
            f"has an older {MARKER} that lists names, not contents, so edits to its files cannot be "
            "ruled out; it is not replaced (remove it yourself, or choose a new directory)"
        )
    for rel in files:
        expected = record.get(rel)
        if not isinstance(expected, dict):
            return f"holds {rel}, which this project did not write (not in {MARKER}); it is not replaced"
        if _digest(root / rel, size=expected.get("size")) != expected:
            return f"has {rel} changed since this project wrote it; it is not replaced"
    return None


def _digest(path: typing.Any, *, size: object = None) -> dict[str, typing.Any]:
    """{"size", "sha256"} of a file (local or epath); a size that differs from `size` skips hashing."""
    h = hashlib.sha256()
    n = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            n += len(chunk)
            if isinstance(size, int) and n > size:
                return {"size": -1}  # longer than recorded: changed, no need to read on
    return {"size": n, "sha256": h.hexdigest()}


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
    """Record what this project wrote in `directory` (what `--overwrite` may later replace): every
    entry's name and every file's size and sha256, so a file edited since is never replaced."""
    d = pathlib.Path(directory)
    entries = sorted(_listing(d))
    files = {rel: _digest(d / rel) for rel in entries if (d / rel).is_file()}
    record = {"written_by": f"agentrefine_jax {tool}".strip(), "entries": entries, "files": files}
    (d / MARKER).write_text(json_dumps(record, indent=1) + "\n")


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
    tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{final.name[:_NAME_KEPT]}.partial-"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would make the published dir private
        yield tmp
        follow_umask(tmp)
        mark(tmp, tool)
        check_dir(final, overwrite=overwrite, protect=protect, flag=flag)  # it may have changed meanwhile
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_dir(
    path: PathLike,
    write: Callable[[pathlib.Path], None],
    *,
    tool: str,
    overwrite: bool = False,
    protect: Iterable[PathLike] = (),
    writer: bool = True,
    flag: str = "--out",
    note: Callable[[str], None] | None = None,
) -> None:
    """`write(dir)` into `publish_dir(path, ...)`. When the disk fills (or a quota or file-size
    limit is met) the partial directory is removed, `path` is left as it was (an earlier output
    too, under `overwrite`), the output is written again under $TMPDIR (`rescue_dir`; `note` is
    told first, so the progress lines of the second write are explained) and OutputWriteError
    names both: the finished work is never lost to a full disk."""
    try:
        with publish_dir(
            path, tool=tool, overwrite=overwrite, protect=protect, writer=writer, flag=flag
        ) as tmp:
            write(tmp)
    except OSError as e:
        if e.errno not in DISK_FULL or not writer:
            raise
        if note is not None:
            note(
                f"could not write {path} ({e.strerror or e}); writing it again under {tempfile.gettempdir()}"
            )
        raise OutputWriteError(path, e, rescue_dir(pathlib.Path(path).name, write, tool=tool)) from e


def follow_umask(root: PathLike) -> None:
    """Give every file and directory under `root` the mode a plain `open`/`mkdir` would (0666 /
    0777 less the umask): writers such as safetensors create their files 0600, which would make
    one file of an export private while its siblings are readable."""
    mask = _umask()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _swap_in(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename `tmp` to `final`; an existing `final` was checked (empty, or ours to replace)."""
    if final.is_dir() and any(final.iterdir()):
        old = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{final.name[:_NAME_KEPT]}.old-"))
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
