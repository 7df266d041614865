"""Rotary position embeddings in the Hugging Face "rotate half" layout.

HF Llama/Mistral checkpoints store q/k projections permuted for this layout, so using
it here lets weights move between the two stacks untouched (no RoPE permutation to get
wrong on export).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from agentrefine_jax.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> jax.Array:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r}")
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def sin_cos(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, S] integer positions -> (sin, cos), each [B, S, head_dim] in float32."""
    freqs = positions.astype(jnp.float32)[..., None] * inverse_frequencies(cfg)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.sin(emb), jnp.cos(emb)


def apply(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """x: [B, S, H, D]; sin/cos: [B, S, D]. Computed in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
