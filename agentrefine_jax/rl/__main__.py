"""`python -m agentrefine_jax.rl --config NAME_OR_PATH [--set key=value ...]`."""

from __future__ import annotations

import os
import sys

from agentrefine_jax.cli_errors import run_main


def entry() -> None:
    """`python -m agentrefine_jax.rl` and the `agentrefine-rl` console script."""
    code = run_main("rl", "agentrefine_jax.rl.cli")
    if code:
        # As the trainer: after a failed asynchronous checkpoint save Orbax leaves non-daemon threads
        # waiting out their timeout; the error is already reported, so do not wait for them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
