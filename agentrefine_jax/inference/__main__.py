"""`python -m agentrefine_jax.inference generate|serve ...`; see inference/cli.py."""

import sys

from agentrefine_jax.inference.cli import main

if __name__ == "__main__":
    sys.exit(main())
