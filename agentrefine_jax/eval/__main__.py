"""`python -m agentrefine_jax.eval ...` (see agentrefine_jax/eval/cli.py)."""

import sys

from agentrefine_jax.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
