import sys

from agentrefine_jax.eval.cli import main

sys.exit(main())
