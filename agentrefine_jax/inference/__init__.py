"""KV-cache generation (engine), chat-level generation (chat) and model loading for inference."""

from agentrefine_jax.inference.chat import ChatGenerator, Completion, ContextOverflowError
from agentrefine_jax.inference.engine import Generation, generate, generate_ids

__all__ = ["ChatGenerator", "Completion", "ContextOverflowError", "Generation", "generate", "generate_ids"]
