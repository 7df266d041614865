import sys

from agentrefine_jax.synth.cli import main

sys.exit(main())
