"""`python -m agentrefine_jax.data {dump,stats,show}` (see agentrefine_jax/data/cli.py)."""

from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.data` and the `agentrefine-data` console script."""
    leave(run_main("data", "agentrefine_jax.data.cli"))


if __name__ == "__main__":
    entry()
