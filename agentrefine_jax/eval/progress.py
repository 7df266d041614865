"""Eval's heartbeat: a progress line at a fixed interval while episodes run, even when none ends.

On a CPU a single batched model call (8 episodes x a 256-token reply) can take minutes, so the
per-episode lines alone leave long silences; a background thread prints, every `interval`
seconds, what the loop has done so far:

    progress: 3/16 episodes done, 5 in flight, 41 steps (0.31/s), waiting 45s on the policy,
    memory 4.2 GB (peak 5.1), host 17.9 of 23.4 GB free, elapsed 2m12s

The memory figures (this process's resident set and peak, the host's available memory; Linux) are
there because an evaluation's KV cache grows with its episodes' histories: a run killed by the kernel
for memory leaves no line of its own, so the last heartbeats say what happened, and while the host's
available memory is under LOW_MEMORY of its total a warning line says so, once per such spell.

One `Progress` covers a whole `eval` run (every task and phase); the episode loop
(`core.run_loop`) reports into the active one through four calls — `add_jobs(n)` when it gets its
jobs, `round_started(n_active)` / `round_ended()` around each batched policy call (each active
episode takes one step per round), `episode_done()` as each one ends — and does nothing when no
`Progress` is active (library use, tests of the loop). The CLI activates one with
`with Progress(interval, log): ...`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from agentrefine_jax import host_memory

# Seconds between heartbeat lines (`eval --progress-every`).
DEFAULT_INTERVAL = 30.0
# The host's available memory, as a share of its total, under which a heartbeat warns (and, once it is
# back above twice this, warns again at the next dip).
LOW_MEMORY = 0.10
GB = 1e9

_active: Progress | None = None


def active() -> Progress | None:
    """The run's Progress, or None outside a `with Progress(...)` block."""
    return _active


def _duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Counters the episode loop updates, and the thread that prints them every `interval` s."""

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        log: Callable[[str], None] = print,
        memory: Callable[[], host_memory.MemoryNow | None] = host_memory.memory_now,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the progress interval must be > 0 seconds, got {interval}")
        self.interval, self.log, self.memory = interval, log, memory
        self._warned = False  # a low-memory warning was given and memory has not recovered since
        self.total = self.done = self.in_flight = self.steps = 0
        self.round_t0: float | None = None  # when the policy call now under way began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = time.monotonic()

    # ------------------------------------------------------------------ the loop's hook calls
    def add_jobs(self, n: int) -> None:
        with self._lock:
            self.total += n

    def round_started(self, n_active: int) -> None:
        with self._lock:
            self.in_flight = n_active
            self.round_t0 = time.monotonic()

    def round_ended(self) -> None:
        with self._lock:
            self.steps += self.in_flight  # every active episode got one reply (one step)
            self.round_t0 = None

    def episode_done(self, was_running: bool = True) -> None:
        """An episode ended (`was_running=False`: read back from the journal of an interrupted run)."""
        with self._lock:
            self.done += 1
            if was_running:
                self.in_flight = max(0, self.in_flight - 1)

    # ------------------------------------------------------------------ the heartbeat
    def line(self) -> str:
        with self._lock:
            now = time.monotonic()
            elapsed = now - self.t0
            parts = [
                f"{self.done}/{self.total} episodes done",
                f"{self.in_flight} in flight",
                f"{self.steps} steps ({self.steps / max(elapsed, 1e-9):.2f}/s)",
            ]
            if self.round_t0 is not None:
                parts.append(f"waiting {_duration(now - self.round_t0)} on the policy")
        mem = self.memory()
        if mem is not None:
            parts.append(f"memory {mem.rss / GB:.1f} GB (peak {mem.peak / GB:.1f})")
            parts.append(f"host {mem.available / GB:.1f} of {mem.total / GB:.1f} GB free")
        return "progress: " + ", ".join(parts) + f", elapsed {_duration(elapsed)}"

    def memory_warning(self) -> str | None:
        """A warning line when the host's available memory has just fallen under LOW_MEMORY of its total
        (None otherwise, and again once it is back above twice that)."""
        mem = self.memory()
        if mem is None or mem.total <= 0:
            return None
        share = mem.available / mem.total
        if share >= 2 * LOW_MEMORY:
            self._warned = False
        if share >= LOW_MEMORY or self._warned:
            return None
        self._warned = True
        return (
            f"warning: memory low: {mem.available / GB:.1f} of {mem.total / GB:.1f} GB free on this host, "
            f"this process {mem.rss / GB:.1f} GB; if the kernel kills it, the journal keeps the finished "
            "episodes (the same command resumes) but those in flight are lost; fewer episodes in flight "
            "(--batch-size) need less"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.log(self.line())
            warning = self.memory_warning()
            if warning is not None:
                self.log(warning)

    def __enter__(self) -> Progress:
        global _active
        self.t0 = time.monotonic()
        _active = self
        self._thread = threading.Thread(target=self._beat, name="eval-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _active
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if _active is self:
            _active = None
