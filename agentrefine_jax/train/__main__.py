"""`python -m agentrefine_jax.train --config NAME_OR_PATH [--set key=value ...]`."""

from __future__ import annotations

import sys

from agentrefine_jax import host_memory
from agentrefine_jax.cli_errors import exit_with, fail, run_main


def entry() -> None:
    """`python -m agentrefine_jax.train` and the `agentrefine-train` console script."""
    try:
        host_memory.relaunch_with_huge_pages()  # AGENTREFINE_HUGE_PAGES=1 on a CPU host: once, first
    except ValueError as e:
        sys.exit(fail("train", e))
    exit_with(run_main("train", "agentrefine_jax.train.cli"))


if __name__ == "__main__":
    entry()
