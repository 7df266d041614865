"""A thread-safe progress line for `generate`: done / failed / retrying / tokens spent.

On a terminal it redraws one status line in place (log messages are printed above it); when
stderr is a file or pipe it prints a status line at most every `interval` seconds and on
every finished persona, so logs stay readable.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(
        self, total: int, *, already_done: int = 0, stream: TextIO | None = None, interval: float = 5.0
    ):
        self.total = total
        self.done = already_done
        self.failed = 0
        self.unfinished = 0
        self.tokens = 0
        self.retrying: set[str] = set()
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._interval = 0.2 if self._tty else interval
        self._last = 0.0
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def status(self) -> str:
        elapsed = time.monotonic() - self._start
        finished = self.done + self.failed
        width = 24
        filled = int(width * finished / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        return (
            f"[{bar}] {finished}/{self.total} done={self.done} failed={self.failed} "
            f"retrying={len(self.retrying)} tokens={self.tokens:,} {elapsed:.0f}s"
        )

    def _render(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        if self._tty:
            self._stream.write("\r\033[K" + self.status())
        else:
            self._stream.write("[synth] " + self.status() + "\n")
        self._stream.flush()

    def log(self, msg: str) -> None:
        with self._lock:
            if self._tty:
                self._stream.write("\r\033[K")
            self._stream.write(msg + "\n")
            if self._tty:
                self._stream.write(self.status())
            self._stream.flush()

    def update(
        self,
        *,
        done: int = 0,
        failed: int = 0,
        tokens: int = 0,
        unfinished: int = 0,
        retrying: str | None = None,
        settled: str | None = None,
    ) -> None:
        with self._lock:
            self.done += done
            self.failed += failed
            self.unfinished += unfinished
            self.tokens += tokens
            if retrying is not None:
                self.retrying.add(retrying)
            if settled is not None:
                self.retrying.discard(settled)
            self._render(force=bool(done or failed))

    def tick(self) -> None:
        with self._lock:
            self._render()

    def close(self) -> None:
        with self._lock:
            self._render(force=True)
            if self._tty:
                self._stream.write("\n")
            self._stream.flush()
