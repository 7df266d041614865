"""Entry point: `python -m agentrefine_jax.export {from-hf,to-hf,verify} ...`."""

import sys

from agentrefine_jax.cli_errors import run_main


def entry() -> None:
    """`python -m agentrefine_jax.export` and the `agentrefine-export` console script."""
    sys.exit(run_main("export", "agentrefine_jax.export.cli"))


if __name__ == "__main__":
    entry()
