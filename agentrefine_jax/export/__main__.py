"""Entry point: `python -m agentrefine_jax.export {from-hf,to-hf,verify} ...`."""

import sys

from agentrefine_jax.export.cli import main

sys.exit(main())
