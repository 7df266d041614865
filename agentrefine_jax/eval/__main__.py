"""`python -m agentrefine_jax.eval ...` (see agentrefine_jax/eval/cli.py)."""

from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.eval` and the `agentrefine-eval` console script."""
    leave(run_main("eval", "agentrefine_jax.eval.cli"))


if __name__ == "__main__":
    entry()
