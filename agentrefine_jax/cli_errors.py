"""The house convention for command-line errors: one line on stderr, `[tool] error: ...`, exit 2.

`OneLineParser` makes argparse's own usage errors (unknown flag, bad choice, missing argument)
follow it too: argparse prints the usage block and the message on separate lines by default.
`run_main` is what every `python -m agentrefine_jax.<tool>` runs: a quiet start-up
(agentrefine_jax.startup) and Ctrl-C as one line with exit 130.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import signal
import sys
from typing import NoReturn

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def run_main(tool: str, module: str) -> int:
    """Import `module` and run its `main()`; returns its exit code.

    Importing inside the guard means a Ctrl-C during the (seconds-long) imports of jax and
    transformers is handled too. On Ctrl-C: one line, worker processes stopped, exit 130 at once
    (an interrupted Orbax save leaves non-daemon threads that would otherwise hold the exit).
    """
    from agentrefine_jax import startup

    try:
        startup.quiet_start()
        return int(importlib.import_module(module).main() or 0)
    except KeyboardInterrupt:
        interrupted(tool)


def interrupted(tool: str) -> NoReturn:
    """Ctrl-C: `[tool] interrupted` on stderr and exit 130, with no traceback from anything."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
    print(f"[{tool}] interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():  # data loader workers, not left orphaned
        child.terminate()
    sys.stdout.flush()
    os._exit(INTERRUPTED)


def tool_name(prog: str) -> str:
    """`python -m agentrefine_jax.data stats` -> `data`; anything else is returned as is."""
    for word in prog.split():
        if word.startswith("agentrefine_jax."):
            return word.split(".")[-1]
    return prog


def fail(tool: str, message: object) -> int:
    """Print the one-line error and return the exit code (for `return fail(...)` in a main)."""
    text = " ".join(str(message).split())  # one line, whatever the exception text held
    print(f"[{tool}] error: {text}", file=sys.stderr, flush=True)
    return USAGE_ERROR


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one stderr line and exit 2 (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        fail(tool_name(self.prog), f"{message} (see {self.prog} --help)")
        raise SystemExit(USAGE_ERROR)


def int_in(lo: int, hi: int | None = None):
    """argparse `type=` for an integer flag with a range, checked before any work starts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"must be {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}"
            )
        return value

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False):
    """argparse `type=` for a float flag in [lo, hi] (or (lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < value <= hi if lo_open else lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}]")
        return value

    return parse
