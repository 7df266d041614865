"""CPU-friendly shapes for the same layer math (`model.cpu_layout=True`).

XLA:CPU runs a dot with one batch dimension (or none) through its fast matmul path, and a
dot with several batch dimensions, or with 3-D/4-D operands, through slower loops plus
transposes. So on CPU the projections run as 2-D matmuls on [B*S, D] and attention as
one-batch-dimension dots over [B*KVH, G*S, D]. Same products, same float32 accumulation:
the numbers match the default layout to float32 rounding (tests/test_model_cpu_layout.py).

Off the TPU path: a TPU wants the sharded, blocked default layout (sequence sharding, blocked
attention at 8k tokens, scan over many layers); this layout ignores `attention_block_size`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def project_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, S, D] x [D, *out] -> [B, S, *out] as one [B*S, D] @ [D, prod(out)] matmul."""
    b, s, d = x.shape
    out = w.shape[1:]
    return (x.reshape(b * s, d) @ w.reshape(d, -1)).reshape(b, s, *out)


def project_out(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, S, *in] x [*in, D] -> [B, S, D] as one [B*S, prod(in)] @ [prod(in), D] matmul."""
    b, s = x.shape[:2]
    d = w.shape[-1]
    return (x.reshape(b * s, -1) @ w.reshape(-1, d)).reshape(b, s, d)


def attend_flat(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q: [B, S, KVH, G, D]; k, v: [B, T, KVH, D]; mask: [B, S, T] -> [B, S, KVH, G, D].

    The grouped queries of one KV head are stacked along the query axis, so each dot has the
    single batch dimension B*KVH.
    """
    b, s, kvh, g, d = q.shape
    t = k.shape[1]
    qf = q.transpose(0, 2, 3, 1, 4).reshape(b * kvh, g * s, d)
    kf = k.transpose(0, 2, 1, 3).reshape(b * kvh, t, d)
    vf = v.transpose(0, 2, 1, 3).reshape(b * kvh, t, d)
    scores = jnp.einsum("nqd,ntd->nqt", qf, kf, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = scores.reshape(b, kvh, g, s, t)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * kvh, g * s, t)
    out = jnp.einsum("nqt,ntd->nqd", probs, vf)
    return out.reshape(b, kvh, g, s, d).transpose(0, 3, 1, 2, 4)
