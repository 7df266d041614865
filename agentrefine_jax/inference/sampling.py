"""Next-token selection inside jit: greedy, temperature and nucleus (top-p) sampling.

Greedy decoding is a separate (static) program: it needs no softmax or RNG. For sampling,
`temperature` and `top_p` are traced scalars, so one compiled decode step serves every
sampling setting.

No vocabulary sort: XLA's CPU sort of a 128k vocabulary costs ~100 ms per row per step.
The nucleus is found instead as a probability threshold, by bisection on the float32 bit
pattern (non-negative floats order like their bits), which gives exactly the set
transformers' TopPLogitsWarper keeps: a token stays when the probability mass strictly
above it is < top_p. The token is then drawn by inverse CDF with one uniform number per
row (a Gumbel draw would need a random number per vocabulary entry). The float32 running
sum resolves probabilities down to ~1e-7 of the total mass; rarer tokens are not drawn.

Each row draws from its own key (derived from seed, row and step), so a row's samples do
not depend on what else shares the batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_BISECT_STEPS = 32  # enough to pin down any float32 in [0, 1]
_ARGMAX_BLOCK = 1024  # vocabulary entries per block of `argmax` when no size near sqrt(V) divides V


def row_keys(base_key: jax.Array, rows: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row for decode step `step`: fold_in(fold_in(base, row), step)."""
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base_key, r), step))(rows)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` for [B, V] (same index: the first maximum, the first NaN if any), int32.

    XLA:CPU reduces an argmax (a max carrying its index) element by element, ~20x slower than a
    plain max: over a 128k vocabulary that was a quarter of a small model's decode step. Here plain
    maxima pick the first block holding the maximum and the index pair-reduction runs only over
    the block count and one block.
    """
    b, v = x.shape
    size = _argmax_block(v)
    n = -(-v // size)
    if n < 2:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if n * size > v:  # padding after the real entries is never the first maximum (ties go lower)
        x = jnp.concatenate([x, jnp.full((b, n * size - v), -jnp.inf, x.dtype)], axis=-1)
    blocks = x.reshape(b, n, size)
    # argmax ranks NaN above everything; a max may skip it, so a block holding one reads NaN.
    top = jnp.where(jnp.isnan(blocks).any(axis=-1), jnp.nan, jnp.max(blocks, axis=-1))
    first = jnp.argmax(top, axis=-1)
    block = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]
    return (first * size + jnp.argmax(block, axis=-1)).astype(jnp.int32)


def _argmax_block(v: int) -> int:
    """A block size near sqrt(v) that divides v (no padding copy), else `_ARGMAX_BLOCK`."""
    root = math.isqrt(v)
    return next((d for d in range(max(root, 1), 4 * root + 1) if v % d == 0), _ARGMAX_BLOCK)


def nucleus_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per row, the smallest float t with sum(probs[probs > t]) < top_p; keep tokens with p >= t.

    That sum only falls as t grows, so the kept set {i: mass above p_i < top_p} is exactly
    {i: p_i >= t}. The top token is always kept (the mass above it is 0).
    """

    def mass_above(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(probs > t[:, None], probs, 0.0), axis=-1)

    to_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    lo = jnp.zeros(probs.shape[:1], jnp.int32)  # bits of 0.0
    hi = to_bits(jnp.max(probs, axis=-1))  # mass above the max is 0 < top_p: always a solution

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = mass_above(jax.lax.bitcast_convert_type(mid, jnp.float32)) < top_p
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def _inverse_cdf(weights: jax.Array, keys: jax.Array) -> jax.Array:
    """Draw index i with probability weights[i] / sum(weights), per row."""
    cdf = jnp.cumsum(weights, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cdf[:, -1]
    idx = jnp.sum(cdf <= u[:, None], axis=-1)  # first index whose running sum exceeds u
    # u * total can round up to total: fall back to the last token that has weight.
    last = weights.shape[-1] - 1 - argmax((weights[:, ::-1] > 0).astype(jnp.float32))
    return jnp.minimum(idx, last).astype(jnp.int32)


def sample(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, *, greedy: bool
) -> jax.Array:
    """logits [B, V] -> token ids [B] int32: argmax if `greedy`, else temperature + top-p sampling."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return argmax(logits)
    probs = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6), axis=-1)
    # top_p >= 1 keeps every token: skip the bisection.
    weights = jax.lax.cond(
        top_p >= 1.0,
        lambda: probs,
        lambda: jnp.where(probs >= nucleus_threshold(probs, top_p)[:, None], probs, 0.0),
    )
    return _inverse_cdf(weights, keys)
