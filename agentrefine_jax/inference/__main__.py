"""`python -m agentrefine_jax.inference generate|serve ...`; see inference/cli.py."""

from agentrefine_jax import host_memory
from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.inference` and the `agentrefine-inference` console script."""
    host_memory.bound_heap()  # before any thread: a server's heap must not keep every peak
    leave(run_main("inference", "agentrefine_jax.inference.cli"))


if __name__ == "__main__":
    entry()
