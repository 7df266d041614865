"""XLA's persistent compilation cache for every tool: a program compiled once is read back next time.

Why. An evaluation compiles one decode program per batch size and cache length it reaches and one
prefill per block width (inference/sessions.py): 96 programs and 38 s of XLA compile for 8 BabyAI
episodes of 8 turns with SmolLM2 on a 2-core CPU, most under a second, the largest seconds to minutes
(the layers are unrolled there: one of the miniature's decode programs took 2 min 24 s).
jax keeps them for the life of the process only, so every run, a resumed one included, compiled them
all again; the programs depend on the model's shapes, not its weights, so the next checkpoint's
evaluation is the same programs. MaxText turns jax's cache on by default for the same reason.

Where. `$XDG_CACHE_HOME/agentrefine_jax/xla/<host>/` (default `~/.cache/...`), `<host>` a hash of the
CPU's model name and feature flags: XLA:CPU compiles for the features of the CPU it runs on and jax's
own cache key does not name them, so a home directory shared by an Intel and an AMD machine (NFS) must
not hand one the other's programs. jax's key covers the rest (its version, the program, the XLA flags,
the compile options, the backend's platform version).

Settings. `AGENTREFINE_COMPILE_CACHE=off` (or `0`, `false`, `no`) turns it off; any other value is the
directory to use. A `JAX_COMPILATION_CACHE_DIR` already set is left alone (the user's, or the test
suite's). jax's own rules otherwise apply: only programs that took >= 1 s to compile are written
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`), and the cache is capped at MAX_BYTES, least recently
used entries evicted first (`JAX_COMPILATION_CACHE_MAX_SIZE` overrides it). Runs before the first
compile (`startup.quiet_start` calls `enable`, before a tool imports jax).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

from agentrefine_jax import host_cpu

ENV = "AGENTREFINE_COMPILE_CACHE"
OFF = frozenset({"off", "0", "false", "no"})
# Entries are compressed executables: SmolLM2's evaluation wrote 18 in 3.7 MB. 4 GiB holds the programs
# of many models, shapes and task mixes; jax evicts the least recently used beyond it.
MAX_BYTES = 4 << 30


def host_key(cpuinfo: str | None = None) -> str:
    """A short hash of the CPU's model name and feature flags (`cpuinfo`: that file's text; None: this
    host's): what XLA:CPU compiles for."""
    info = host_cpu.read() if cpuinfo is None else host_cpu.parse(cpuinfo)
    flags = " ".join(sorted(info.flags)) if info is not None else ""
    return hashlib.sha256(f"{host_cpu.model_name(info)}\n{flags}".encode()).hexdigest()[:16]


def default_dir(cpuinfo: str | None = None) -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "agentrefine_jax" / "xla" / host_key(cpuinfo)


def enable() -> str | None:
    """Point jax's persistent compilation cache at this host's directory unless told otherwise;
    returns the directory in effect (None: off). Only fills environment variables that are unset."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    path = os.path.abspath(os.path.expanduser(chosen)) if chosen else str(default_dir())
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: compile as before rather than fail the run
        return None
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(MAX_BYTES))
    if "jax" in sys.modules:  # imported already (a tool's main called from Python): jax read its
        import jax  # variables then; the cache itself starts at the first compile, so this still holds

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
    return path
