"""Eval's heartbeat: a progress line at a fixed interval while episodes run, even when none ends.

On a CPU a single batched model call (8 episodes x a 256-token reply) can take minutes, so the
per-episode lines alone leave long silences; a background thread prints, every `interval`
seconds, what the loop has done so far:

    progress: 3/16 episodes done, 5 in flight, 41 steps (0.31/s), waiting 45s on the policy, elapsed 2m12s

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

# Seconds between heartbeat lines (`eval --progress-every`).
DEFAULT_INTERVAL = 30.0

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

    def __init__(self, interval: float = DEFAULT_INTERVAL, log: Callable[[str], None] = print) -> None:
        if not interval > 0:
            raise ValueError(f"the progress interval must be > 0 seconds, got {interval}")
        self.interval, self.log = interval, log
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
        return "progress: " + ", ".join(parts) + f", elapsed {_duration(elapsed)}"

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.log(self.line())

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
