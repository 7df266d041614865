"""Next-token selection inside jit: greedy, temperature and nucleus (top-p) sampling.

Greedy decoding is a separate (static) program: it needs no keys, sort or softmax, and
compiles faster. For sampling, `temperature` and `top_p` are traced scalars, so one
compiled decode step serves every sampling setting.
Each row draws from its own key (derived from seed, row and step), so a row's samples do
not depend on what else shares the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(base_key: jax.Array, rows: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row for decode step `step`: fold_in(fold_in(base, row), step)."""
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base_key, r), step))(rows)


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sort descending and mask tokens outside the nucleus.

    A token is kept when the probability mass strictly above it is < top_p (the same set as
    transformers' TopPLogitsWarper), so the most likely token is always kept and
    top_p -> 0 reduces to greedy. Returns (masked sorted logits, sorted token ids).
    """
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_above < top_p
    return jnp.where(keep, sorted_logits, -jnp.inf), order


def sample(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, *, greedy: bool
) -> jax.Array:
    """logits [B, V] -> token ids [B] int32: argmax if `greedy`, else temperature + top-p sampling."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)

    def full() -> jax.Array:
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    def nucleus() -> jax.Array:
        masked, order = top_p_filter(scaled, top_p)
        pick = jax.vmap(jax.random.categorical)(keys, masked)
        return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    # top_p = 1 keeps every token: skip the vocabulary sort.
    return jax.lax.cond(top_p >= 1.0, full, nucleus)
