"""LLaMA-3 / Mistral models: `ModelConfig`, presets and the NNX `Transformer`."""

from agentrefine_jax.models.config import PRESETS, ModelConfig, RopeScaling, preset
from agentrefine_jax.models.llama import (
    Transformer,
    abstract,
    abstract_params,
    create,
    init_cache,
    param_count,
)

__all__ = [
    "PRESETS",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "abstract",
    "abstract_params",
    "create",
    "init_cache",
    "param_count",
    "preset",
]
