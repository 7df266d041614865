"""`python -m agentrefine_jax.rl --config NAME_OR_PATH [--set key=value ...]`."""

from __future__ import annotations

from agentrefine_jax.cli_errors import exit_with, run_main


def entry() -> None:
    """`python -m agentrefine_jax.rl` and the `agentrefine-rl` console script."""
    exit_with(run_main("rl", "agentrefine_jax.rl.cli"))


if __name__ == "__main__":
    entry()
