"""`python -m agentrefine_jax.plan ...`; see agentrefine_jax/plan/cli.py."""

from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.plan` and the `agentrefine-plan` console script."""
    leave(run_main("plan", "agentrefine_jax.plan.cli"))


if __name__ == "__main__":
    entry()
