"""Entry point: `python -m agentrefine_jax.export {from-hf,to-hf,verify} ...`."""

import sys

from agentrefine_jax.export.cli import main

if __name__ == "__main__":
    sys.exit(main())
