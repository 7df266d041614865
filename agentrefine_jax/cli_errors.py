"""The house convention for command-line errors: one line on stderr, `[tool] error: ...`, exit 2.

`OneLineParser` makes argparse's own usage errors (unknown flag, bad choice, missing argument)
follow it too: argparse prints the usage block and the message on separate lines by default.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

USAGE_ERROR = 2


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
