"""Entry point: `python -m agentrefine_jax.export {from-hf,to-hf,verify} ...`."""

from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.export` and the `agentrefine-export` console script."""
    leave(run_main("export", "agentrefine_jax.export.cli"))


if __name__ == "__main__":
    entry()
