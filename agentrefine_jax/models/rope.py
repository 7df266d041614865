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


@jax.custom_vjp
def apply(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """x: [B, S, H, D]; sin/cos: [B, S, D] from `sin_cos`. Computed in float32, returned in x.dtype.

    Written per half (no float32 `rotate_half` concatenate) and with its own gradient, so the
    compiler fuses each direction into one pass over the compute-dtype q/k: autodiff of the
    concatenate materialised float32 copies of q/k, their halves and their gradients (256 MiB
    each per layer at 8B / 8k tokens / 2 sequences per device), at the layer backward's peak.
    Same float32 products and sums as `x*cos + rotate_half(x)*sin`.
    """
    return _rotate(x, sin, cos)


def _rotate(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    # sin_cos repeats the frequencies: both halves of sin (and of cos) are equal.
    s, c = sin[:, :, None, :half], cos[:, :, None, :half]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out1 = x1 * c + (-x2) * s
    out2 = x2 * c + x1 * s
    return jnp.concatenate([out1.astype(x.dtype), out2.astype(x.dtype)], axis=-1)


def _apply_fwd(x: jax.Array, sin: jax.Array, cos: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _rotate(x, sin, cos), (sin, cos)


def _apply_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, None, None]:
    # The rotation is orthogonal: its transpose is the rotation by -angle, i.e. the same map with
    # -sin (dx1 = g1*c + g2*s, dx2 = g2*c - g1*s: the float32 terms autodiff forms). sin/cos come
    # from integer positions and get no gradient.
    sin, cos = res
    return _rotate(g, -sin, cos), None, None


apply.defvjp(_apply_fwd, _apply_bwd)
