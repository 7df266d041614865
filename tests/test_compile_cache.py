"""XLA's persistent compilation cache as every tool starts it (`startup.quiet_start`): a program compiled
by one process is read back by the next, under a directory named for the host's CPU, and off when
asked. Real jax in fresh processes (the suite's own processes run with the suite's cache dir)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from agentrefine_jax import compile_cache

# The start-up every CLI runs, then one jitted program; reports jax's cache events and its directory.
PROBE = """
import json, sys
if sys.argv[1] == "jax-first":  # a tool's main called from Python, jax imported before start-up
    import jax
from agentrefine_jax import startup
startup.quiet_start()
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
print(json.dumps({
    "dir": jax.config.jax_compilation_cache_dir,
    "hits": events.count("/jax/compilation_cache/cache_hits"),
    "misses": events.count("/jax/compilation_cache/cache_misses"),
}))
"""

INTEL = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f amx_tile\n"


def _probe(tmp_path: pathlib.Path, jax_first: bool = False, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "AGENTREFINE_"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **extra)
    r = subprocess.run(
        [sys.executable, "-c", PROBE, "jax-first" if jax_first else "start-up-first"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_program_compiled_by_one_run_is_read_back_by_the_next(tmp_path):
    first = _probe(tmp_path)
    where = tmp_path / "xdg" / "agentrefine_jax" / "xla" / compile_cache.host_key()
    assert first["dir"] == str(where)
    assert first["misses"] >= 1 and first["hits"] == 0
    assert any(where.iterdir()), "nothing written to the cache"
    second = _probe(tmp_path, jax_first=True)  # jax already read its environment: set in its config
    assert second["dir"] == str(where)
    assert second["hits"] >= 1 and second["misses"] == 0


def test_off_and_a_chosen_directory(tmp_path):
    off = _probe(tmp_path, AGENTREFINE_COMPILE_CACHE="off")
    assert off["dir"] is None and off["hits"] == off["misses"] == 0
    assert not (tmp_path / "xdg" / "agentrefine_jax").exists()
    chosen = _probe(tmp_path, AGENTREFINE_COMPILE_CACHE=str(tmp_path / "mine"))
    assert chosen["dir"] == str(tmp_path / "mine") and any((tmp_path / "mine").iterdir())
    # A directory jax was already given (the user's, the suite's) is kept.
    given = _probe(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "given"))
    assert given["dir"] == str(tmp_path / "given") and any((tmp_path / "given").iterdir())


def test_the_directory_names_the_cpu_model_and_its_features():
    amd = INTEL.replace("Intel(R) Xeon(R) Processor", "AMD EPYC 7B13")
    no_amx = INTEL.replace(" amx_tile", "")
    keys = {compile_cache.host_key(t) for t in (INTEL, amd, no_amx)}
    assert len(keys) == 3
    # The same CPU with its flags listed in another order, or a second processor listed: the same key.
    reordered = INTEL.replace("fpu avx2 avx512f amx_tile", "amx_tile avx512f fpu avx2")
    assert compile_cache.host_key(reordered + "\n" + amd) == compile_cache.host_key(INTEL)
