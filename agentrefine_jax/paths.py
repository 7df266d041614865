"""Local paths and URLs, one way for every stage: `as_path`, `is_url`, `join`.

Paths may be URLs (gs://..., anything etils.epath handles); `file://` URLs are local paths.
Orbax refuses relative paths, so everything is made absolute here.
"""

from __future__ import annotations

import os

from etils import epath

from agentrefine_jax import object_store


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for remote URLs (gs://, s3://, ...); `file://` and plain paths are local."""
    text = os.fspath(path) if not isinstance(path, epath.Path) else str(path)
    return "://" in text and not text.startswith("file://")


def as_path(path: str | os.PathLike[str]) -> epath.Path:
    """An absolute epath (Orbax refuses relative paths); URLs such as gs://... pass through untouched.

    `file:///x` is the local path `/x` (etils has no file:// backend).
    """
    text = os.fspath(path) if not isinstance(path, epath.Path) else str(path)
    if text.startswith("gs://"):
        object_store.configure()  # before gcsfs or TensorStore first touch a bucket
    if isinstance(path, epath.Path) and is_url(path):
        return path
    if text.startswith("file://"):
        text = text[len("file://") :]
        if not text.startswith("/"):
            raise ValueError(f"file:// URLs must be absolute (file:///path), got {os.fspath(path)!r}")
    return epath.Path(text if "://" in text else os.path.abspath(text))


def join(base: str | os.PathLike[str], relative: str) -> epath.Path:
    """`relative` inside `base` unless it is absolute or a URL itself."""
    if "://" in relative or os.path.isabs(relative):
        return as_path(relative)
    return as_path(base) / relative
