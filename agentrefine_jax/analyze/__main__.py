"""`python -m agentrefine_jax.analyze ...` (see agentrefine_jax/analyze/cli.py)."""

import sys

from agentrefine_jax.analyze.cli import main

if __name__ == "__main__":
    sys.exit(main())
