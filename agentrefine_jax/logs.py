"""One logging setup for every CLI: progress on stderr as `[tool] message`, results on stdout.

Library modules log through `logging.getLogger(__name__)` and never configure anything; a CLI
calls `setup(tool, args)` once, after parsing `--quiet` / `--verbose` (see `add_flags`).
"""

from __future__ import annotations

import argparse
import logging
import sys

ROOT = "agentrefine_jax"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (pytest's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - logging's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001 - StreamHandler.__init__ assigns it
        pass


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="progress off: warnings and errors only")
    group.add_argument("-v", "--verbose", action="store_true", help="more detail (debug messages)")


def setup(tool: str, args: argparse.Namespace | None = None) -> logging.Logger:
    """Route the package's log records to stderr as `[tool] message`; returns the tool's logger."""
    quiet = bool(getattr(args, "quiet", False))
    verbose = bool(getattr(args, "verbose", False))
    root = logging.getLogger(ROOT)
    root.handlers.clear()
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter(f"[{tool}] %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    root.propagate = False  # a host application's root handlers must not print our lines twice
    return logging.getLogger(f"{ROOT}.{tool}")
