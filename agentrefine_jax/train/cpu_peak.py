"""This host's float32 matmul peak, measured: the denominator of MFU on a CPU backend.

A CPU has no datasheet entry in `topology.py` (its FLOP/s depend on the model, its vector units, the
cores this process may use and the clock), so we measure what matters to a training step: the best
rate XLA's own float32 matmul reaches here. `measure()` times a jitted `N x N @ N x N` float32 matmul
(N = 1024, 2.1 GFLOP per call) on device 0 after one compile/warm-up call, `REPEATS` times, and keeps the
fastest call: the peak the step's matmuls could reach, not an average under whatever load the machine
has. It takes well under 2 s.

The best figure measured so far is kept per machine and software (`peak()`): a JSON file under
`$XDG_CACHE_HOME/agentrefine_jax/cpu_peak/<key>.json` (default `~/.cache/...`), keyed by a hash of the
CPU model, the cores this process may use, jax/jaxlib versions, XLA_FLAGS and `MEASURE_VERSION`, so a
new machine, core mask, JAX or measurement starts a new entry rather than reuse a stale figure. Every
run measures again and raises the entry when it beats it: a figure measured on a busy machine is low
(MFU would read high), and the first quiet run corrects it; training steps that run faster than
the kept figure, on average over several of them, raise it to their rate (`raise_to`, called by
`hooks.MetricsLog`, which says why one step's rate is not evidence enough).
The file is written to a temporary sibling and renamed (a concurrent measurer's rename simply wins).

The peak is the *host's*: with several forced host devices (`--xla_force_host_platform_device_count`)
they share the cores, so `flops.device_peak_flops` divides it among them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time

from agentrefine_jax import host_cpu, outputs

# Bump when the measurement changes: old cache entries are then not reused. 2: entries of version 1
# could hold one step's rate, which a late read made up to 260x the host's real peak (CI, stop 57).
MEASURE_VERSION = 2
SIZE = 1024
REPEATS = 8


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "agentrefine_jax" / "cpu_peak"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_key() -> str:
    """What the measured figure depends on, hashed: CPU, usable cores, JAX, XLA flags, the method."""
    import jax
    import jaxlib

    facts = {
        "v": MEASURE_VERSION,
        "cpu": host_cpu.model_name(host_cpu.read()),
        "cores": _cores(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    return hashlib.sha256(outputs.json_dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def measure(size: int = SIZE, repeats: int = REPEATS) -> float:
    """FLOP/s of the fastest of `repeats` jitted float32 `size`^3 matmuls on device 0 (after a warm-up)."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(k1, (size, size), jnp.float32), device)
    b = jax.device_put(jax.random.normal(k2, (size, size), jnp.float32), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile + first touch, not timed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def peak() -> tuple[float, pathlib.Path, bool]:
    """(this host's float32 matmul FLOP/s, its cache file, whether the figure is an earlier run's).

    Every call measures again (well under a second) and the cache keeps the best figure ever measured
    under its key: a measurement taken while the machine was busy is low and would flatter MFU for
    good if it were simply reused, so a later, quieter measurement replaces it."""
    path = _entry()
    best = _kept(path)
    flops = measure()
    if flops <= best:
        return best, path, True
    method = f"best of {REPEATS} jitted float32 {SIZE}x{SIZE} @ {SIZE}x{SIZE} matmuls on device 0"
    _record(path, flops, method + ", the highest such measurement kept")
    return flops, path, False


def raise_to(achieved: float) -> bool:
    """Keep `achieved` (FLOP/s this host's training steps sustained, the mean over several) as the
    host's peak when it beats the kept best; whether it did.

    Why: a matmul measured while other processes held the cores is low, and later, quieter training
    steps then ran *faster* than the "peak" (MFU read 117% on the 2-core AMD EPYC after a measurement at
    load 3.9). What steps sustained is a lower bound on the peak, so it replaces the figure."""
    path = _entry()
    if achieved <= _kept(path):
        return False
    _record(path, achieved, "training steps' mean model FLOP/s, above every matmul measurement so far")
    return True


def _entry() -> pathlib.Path:
    return cache_root() / f"{machine_key()}.json"


def _kept(path: pathlib.Path) -> float:
    """The best figure kept in `path`; 0.0 where there is none (absent, unreadable, another method's)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") == MEASURE_VERSION and float(doc["flops"]) > 0:
            return float(doc["flops"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent or unreadable: the next figure starts the entry
    return 0.0


def _record(path: pathlib.Path, flops: float, method: str) -> None:
    doc = {
        "version": MEASURE_VERSION,
        "flops": flops,
        "method": method,
        "cpu": host_cpu.model_name(host_cpu.read()),
        "cores": _cores(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_1m": os.getloadavg()[0],
    }
    try:  # a cache we cannot write only loses the best figure so far
        path.parent.mkdir(parents=True, exist_ok=True)
        outputs.write_json(path, doc)
    except (OSError, outputs.OutputWriteError):
        pass
