"""`python -m agentrefine_jax.train --config NAME_OR_PATH [--set key=value ...]`."""

from __future__ import annotations

import sys

from agentrefine_jax.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
