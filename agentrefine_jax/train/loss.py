"""Refinement-tuning loss: masked next-token cross-entropy, computed in sequence chunks.

The mask already encodes AgentRefine's choice (erroneous assistant turns carry no loss;
see `agentrefine_jax.data`). Here we only make it exact and cheap:
- `loss_mask[i] == 1` means token i is a training *target*, so position i-1 predicts it;
- a target is never the first token of a packed document or a padding token;
- the vocabulary projection runs chunk by chunk under `jax.checkpoint`, so the full
  [batch, seq, vocab] float32 logits never exist, forward or backward;
- the function returns a token *sum* and a token *count*; callers divide once over the
  whole global batch (gradient accumulation sums tokens, never averages means).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_weights(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(targets, weights), each [B, S-1]: what position t predicts and whether it counts."""
    ids, mask, seg = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
    targets = ids[:, 1:]
    same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    weights = (mask[:, 1:] > 0) & same_doc
    return targets, weights.astype(jnp.float32)


def chunked_cross_entropy(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, weights: jax.Array, chunk_size: int
) -> tuple[jax.Array, jax.Array]:
    """Sum of weighted token losses and sum of weights.

    hidden: [B, T, D] states at the predicting positions; lm_head: [D, V];
    targets/weights: [B, T]. T is padded up to a multiple of `chunk_size`.
    """
    b, t, d = hidden.shape
    chunk = max(1, min(chunk_size, t))
    pad = (-t) % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))
    n = (t + pad) // chunk
    hs = jnp.moveaxis(hidden.reshape(b, n, chunk, d), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, n, chunk), 1, 0)
    ws = jnp.moveaxis(weights.reshape(b, n, chunk), 1, 0)
    w = lm_head.astype(hidden.dtype)

    @jax.checkpoint
    def one(carry: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        h, tgt, wt = xs
        logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt_logit = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        return carry + jnp.sum((lse - tgt_logit) * wt), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (hs, ts, ws))
    return total, jnp.sum(weights)
