"""`python -m agentrefine_jax.synth ...` (see agentrefine_jax/synth/cli.py)."""

import sys

from agentrefine_jax.synth.cli import main

if __name__ == "__main__":
    sys.exit(main())
