"""`python -m agentrefine_jax.eval ...` (see agentrefine_jax/eval/cli.py)."""

from agentrefine_jax import host_memory
from agentrefine_jax.cli_errors import leave, run_main


def entry() -> None:
    """`python -m agentrefine_jax.eval` and the `agentrefine-eval` console script."""
    # Before any thread: an evaluation's KV cache is replaced by one of another length every few turns,
    # and with glibc's defaults the freed arrays stayed in the heap (SmolLM2, 4 conversations growing to
    # 3.5k tokens: peak RSS 3.9 GB for a 0.75 GB cache, 2.7 GB bounded -- docs/inference.md).
    host_memory.bound_heap()
    leave(run_main("eval", "agentrefine_jax.eval.cli"))


if __name__ == "__main__":
    entry()
