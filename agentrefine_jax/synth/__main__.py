"""`python -m agentrefine_jax.synth ...` (see agentrefine_jax/synth/cli.py)."""

from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.synth` and the `agentrefine-synth` console script."""
    leave(run_main("synth", "agentrefine_jax.synth.cli"))


if __name__ == "__main__":
    entry()
