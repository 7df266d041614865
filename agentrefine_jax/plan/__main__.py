"""`python -m agentrefine_jax.plan ...`; see agentrefine_jax/plan/cli.py."""

import sys

from agentrefine_jax.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
