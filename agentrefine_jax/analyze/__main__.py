"""`python -m agentrefine_jax.analyze ...` (see agentrefine_jax/analyze/cli.py)."""

from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.analyze` and the `agentrefine-analyze` console script."""
    leave(run_main("analyze", "agentrefine_jax.analyze.cli"))


if __name__ == "__main__":
    entry()
