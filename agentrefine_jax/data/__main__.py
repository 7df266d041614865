"""`python -m agentrefine_jax.data {dump,stats,show}` (see agentrefine_jax/data/cli.py)."""

import sys

from agentrefine_jax.cli_errors import run_main


def entry() -> None:
    """`python -m agentrefine_jax.data` and the `agentrefine-data` console script."""
    sys.exit(run_main("data", "agentrefine_jax.data.cli"))


if __name__ == "__main__":
    entry()
