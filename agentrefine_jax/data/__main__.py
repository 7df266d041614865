"""`python -m agentrefine_jax.data {dump,stats,show}` (see agentrefine_jax/data/cli.py)."""

import sys

from agentrefine_jax.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
