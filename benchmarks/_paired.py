"""Alternating-rounds measurement: contenders run A B A B … in one run, never one after the other.

On a shared machine the load changes over seconds, so one run of A followed by one run of
B measures the neighbours as much as the code. Here every contender is warmed up first
(compilation, allocator, thread pools: excluded), then each round runs every contender
once, back to back, and yields one ratio per contender against the baseline *of that
round*. The reported figure is the median of those per-round ratios with its min and max,
beside the machine load (os.getloadavg) seen before every round.

Contenders are plain callables returning a throughput (higher is better). `Worker` runs a
contender in its own process (so its peak memory is its own) behind the same interface:
the child calls `serve(setup)` and answers one JSON line per round.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from agentrefine_jax import startup

# A benchmark prints its figures, not libtpu's start-up lines on a host without TPU chips (the CLIs'
# own set-up; only fills unset environment variables, before any benchmark creates a JAX backend).
startup.quiet_start()

Round = Callable[[], float]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def load_now() -> float:
    return os.getloadavg()[0]


def measure(
    contenders: Mapping[str, Round],
    baseline: str,
    *,
    rounds: int = 5,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Alternate `contenders` over `rounds` rounds; ratios are against `baseline`, round by round."""
    if baseline not in contenders:
        raise ValueError(f"baseline {baseline!r} is not a contender")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    loads: list[float] = []
    values: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        loads.append(load_now())
        for name, fn in contenders.items():
            values[name].append(float(fn()))
        if log:
            shown = ", ".join(f"{n} {v[-1]:,.1f}" for n, v in values.items())
            log(f"round {r + 1}/{rounds} (load {loads[-1]:.2f}): {shown}")
    loads.append(load_now())
    base = values[baseline]
    return {
        "rounds": rounds,
        "load": {"min": min(loads), "max": max(loads), "per_round": loads},
        "throughput": {name: spread(v) for name, v in values.items()},
        "ratio": {
            name: spread([x / b for x, b in zip(v, base, strict=True)])
            for name, v in values.items()
            if name != baseline
        },
    }


# ----------------------------------------------------------------------- subprocess contenders


class Worker:
    """A contender in a child process: `setup` info on start, one JSON reply per round."""

    def __init__(self, cmd: list[str], env: Mapping[str, str] | None = None):
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(env or os.environ)
        )
        self.info = self._read()
        self.last: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"benchmark worker {self.proc.args!r} exited with {code}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def round(self) -> float:
        self.last = self.ask("round")
        return float(self.last["value"])

    def close(self) -> dict[str, Any]:
        """Ends the child; returns its final report (peak memory)."""
        if self.proc.poll() is not None:
            return {}
        final = self.ask("quit")
        self.proc.wait(timeout=60)
        return final

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def serve(setup: Callable[[], Callable[[], dict[str, Any]]], imports_rss_mb: float | None = None) -> None:
    """Child side of `Worker`: protocol lines on the real stdout, everything else to stderr."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library chatter (even from C) must not corrupt the protocol
    sys.stdout = sys.stderr
    base = rss_mb() if imports_rss_mb is None else imports_rss_mb

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    one_round = setup()
    send({"ready": True})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "round":
            send(one_round())
        elif cmd == "quit":
            peak = rss_mb()
            send({"peak_rss_mb": peak, "train_mem_mb": peak - base})
            return
        else:
            send({"error": f"unknown command {cmd!r}"})
