"""Attention implementations behind one call: blocked XLA, Pallas TPU splash, cuDNN.

`model.attention` picks one: "xla" (exact softmax over query blocks, any backend),
"splash" (the Pallas TPU splash-attention kernel, never builds [S, S] scores or masks),
"cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs) or
"auto", decided once per model from the devices the step is compiled for, not the host's
default backend (models/execution.py: AOT compilation on a CPU host for a TPU topology must get
splash); the kernels here take that decided `ExecutionPlan`.

splash and cudnn serve the full-sequence forward (training, eval loss, prefill without a
cache). Decoding with a KV cache always uses the XLA path, whose mask is built from
(segment, position) pairs of the cache slots.

splash's masks work on array indices: `CausalMask`/`LocalMask` compare token indices and
`SegmentIds` separate packed documents. That equals the XLA path's position-based mask
whenever positions inside a segment are consecutive, which the packer guarantees. Padding
(segment 0) rows may differ (they are never read: no real token attends to padding and
padding carries no loss).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from agentrefine_jax import sharding as shd
from agentrefine_jax.models.config import Architecture
from agentrefine_jax.models.execution import ExecutionPlan

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The splash kernel's key blocks must be multiples of the TPU lane width.
_LANES = 128


class Segments(NamedTuple):
    """Which document (segment, 0 = padding) and position each query and key belongs to: all the
    mask is made of. q_*: [B, Sq]; k_*: [B, Sk] (the cache's slots when decoding)."""

    q_seg: jax.Array
    q_pos: jax.Array
    k_seg: jax.Array
    k_pos: jax.Array


def attention_mask(seg: Segments, window: int | None) -> jax.Array:
    """[B, Sq, Sk] boolean: same document, causal by position, inside the sliding window."""
    q_seg, q_pos, k_seg, k_pos = seg
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        mask &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return mask


# ----------------------------------------------------------------------------- choice


def attend(
    cfg: Architecture,
    plan: ExecutionPlan,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg: Segments,
    *,
    cached: bool = False,
) -> jax.Array:
    """q: [B, S, H, D]; k, v: [B, T, KVH, D] -> [B, S, H, D] in q's dtype.

    `cached`: keys come from a KV cache, in the cache's layout [B, KVH, T, D] (T != S, slots beyond
    the written ones), so only the XLA path applies; in the CPU layout a decode step (S = 1) takes
    the flat dots, for which that layout is already [B*KVH, T, D] (a decode loop passes it so).
    """
    impl = "xla" if cached else plan.attention
    if impl == "splash":
        return splash_attention(cfg, plan, q, k, v, seg.q_seg)
    if impl == "cudnn":
        return cudnn_attention(cfg, q, k, v, seg)
    # A 3-D k is a decode loop's flat per-layer cache (`llama.flat_heads`): only the flat dots read it.
    flat = plan.cpu_layout and (not cached or q.shape[1] == 1) or k.ndim == 3
    return xla_attention(cfg, q, k, v, seg, block=plan.attention_block_size, flat=flat, heads_first=cached)


# ----------------------------------------------------------------------------- XLA


def _attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, heads_first: bool = False
) -> jax.Array:
    """q: [B, S, KVH, G, D]; k, v: [B, T, KVH, D] ([B, KVH, T, D] `heads_first`); mask: [B, S, T]
    -> [B, S, KVH, G, D]."""
    kv = "bktd" if heads_first else "btkd"
    scores = jnp.einsum(f"bskgd,{kv}->bkgst", q, k, preferred_element_type=jnp.float32)
    scores = scores * (q.shape[-1] ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum(f"bkgst,{kv}->bskgd", probs, v)


def _attend_blocked(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int, heads_first: bool = False
) -> jax.Array:
    """Exact attention over query blocks; each block is rematerialised in the backward pass."""
    b, s = q.shape[:2]
    if block <= 0 or s <= block or s % block:
        return _attend(q, k, v, mask, heads_first)
    n = s // block
    qb = jnp.moveaxis(q.reshape(b, n, block, *q.shape[2:]), 1, 0)
    mb = jnp.moveaxis(mask.reshape(b, n, block, mask.shape[-1]), 1, 0)
    out = jax.lax.map(jax.checkpoint(lambda args: _attend(args[0], k, v, args[1], heads_first)), (qb, mb))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def attend_flat(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, heads_first: bool = False
) -> jax.Array:
    """q: [B, S, KVH, G, D]; k, v: [B, T, KVH, D] ([B, KVH, T, D] `heads_first`: the KV cache's
    layout, reshaped without a copy; a decode loop's flat cache, `llama.flat_heads`: k [B*KVH, D, T],
    v [B*KVH, T, D]); mask: [B, S, T] -> [B, S, KVH, G, D].

    The grouped queries of one KV head are stacked along the query axis, so each dot has the
    single batch dimension B*KVH.
    """
    b, s, kvh, g, d = q.shape
    if not heads_first:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    t = v.shape[-2]
    qf = q.transpose(0, 2, 3, 1, 4).reshape(b * kvh, g * s, d)
    vf = v.reshape(b * kvh, t, d)
    if k.ndim == 3:  # a decode loop's K, [B*KVH, D, T]: the scores contract its leading axis
        scores = jnp.einsum("nqd,ndt->nqt", qf, k, preferred_element_type=jnp.float32) * (d**-0.5)
    else:
        kf = k.reshape(b * kvh, t, d)
        scores = jnp.einsum("nqd,ntd->nqt", qf, kf, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = scores.reshape(b, kvh, g, s, t)
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * kvh, g * s, t)
    out = jnp.einsum("nqt,ntd->nqd", probs, vf)
    return out.reshape(b, kvh, g, s, d).transpose(0, 3, 1, 2, 4)


def xla_attention(
    cfg: Architecture,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg: Segments,
    *,
    block: int = 0,
    flat: bool = False,
    heads_first: bool = False,
) -> jax.Array:
    """Exact softmax attention, queries in blocks of `block` tokens (0: one); GQA by grouping.
    With `flat` (model.cpu_layout: full sequences and decode steps) one-batch-dimension dots, fast on
    XLA:CPU. `heads_first`: k, v are [B, KVH, T, D] (the KV cache's layout)."""
    b, s, h, d = q.shape
    mask = attention_mask(seg, cfg.sliding_window)
    qg = q.reshape(b, s, cfg.num_kv_heads, h // cfg.num_kv_heads, d)
    if flat:
        return attend_flat(qg, k, v, mask, heads_first).reshape(b, s, h, d)
    return _attend_blocked(qg, k, v, mask, block, heads_first).reshape(b, s, h, d)


# ----------------------------------------------------------------------------- cuDNN


def cudnn_attention(
    cfg: Architecture,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seg: Segments,
    implementation: str | None = "cudnn",
) -> jax.Array:
    """cuDNN flash attention. Packed documents and the window go in as a [B, 1, S, T] mask
    (cuDNN turns it into a bias); `is_causal` lets it skip the upper triangle. GQA is native.
    `implementation=None` runs jax's XLA reference with the same arguments (CPU tests)."""
    mask = attention_mask(seg, cfg.sliding_window)[:, None]
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=q.shape[1] == k.shape[1], implementation=implementation
    )
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------- splash


def _block(want: int, seq: int) -> int:
    """The largest multiple of 128 that is <= `want` and divides `seq` (a multiple of 128)."""
    b = min(want, seq) // _LANES * _LANES
    while seq % b:
        b -= _LANES
    return b


def _splash_kernel(*args: object):
    # The kernel's mask tables must be concrete constants, even when first built under a trace.
    with jax.ensure_compile_time_eval():
        return _make_splash_kernel(*args)


@functools.lru_cache(maxsize=32)
def _make_splash_kernel(
    heads: int,
    seq: int,
    window: int | None,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    interpret: bool,
):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    bq, bkv = _block(block_q, seq), _block(block_kv, seq)
    bkvc = _block(min(block_kv_compute, bkv), bkv)
    sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkvc,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkvc,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    if window is None:
        one = sa.CausalMask(shape=(seq, seq))
    else:
        # Token i sees keys i - (window - 1) .. i: the XLA path's `q_pos - k_pos < window`.
        one = sa.LocalMask(shape=(seq, seq), window_size=(window - 1, 0), offset=0)
    mask = sa.MultiHeadMask([one] * heads)
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(
    cfg: Architecture, plan: ExecutionPlan, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array
) -> jax.Array:
    """The Pallas TPU splash kernel, one call per (batch shard, head shard) via shard_map.

    Batch and heads are split exactly as the activations' logical rules split them, so
    the kernel sees per-device shapes. The sequence axis is whole inside the kernel: if
    the rules shard `activation_seq`, shard_map's specs all-gather it first.
    On CPU devices the kernel runs in Pallas interpret mode (tests).
    """
    platform = plan.platform
    if platform not in ("tpu", "cpu"):
        raise ValueError(f"model.attention='splash' needs TPU devices (or CPU, interpreted), got {platform}")
    interpret = platform != "tpu"
    b, s, h, d = q.shape
    kvh = k.shape[2]
    seq = math.ceil(s / _LANES) * _LANES
    if seq != s:
        # Pad to the lane width; the padding is its own segment (-1) so it never meets real
        # tokens, and every padded row still sees itself (no empty softmax).
        pad = ((0, 0), (0, seq - s), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, seq - s)), constant_values=-1)
    # Scaling q once here is what the XLA path does to the scores.
    q = (q * (d**-0.5)).astype(q.dtype)
    qg = q.reshape(b, seq, kvh, h // kvh, d)

    def local(qg: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        lb, _, lkv, g, _ = qg.shape
        kernel = _splash_kernel(
            lkv * g,
            seq,
            cfg.sliding_window,
            *plan.splash_blocks,
            interpret,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

        # Kernel layout [heads, seq, head_dim]; query head kv*g+j reads kv head kv (GQA).
        qh = qg.reshape(lb, seq, lkv * g, d).transpose(0, 2, 1, 3)
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=SegmentIds(q=s1, kv=s1)))(
            qh, kh, vh, seg
        )
        return out.transpose(0, 2, 1, 3).reshape(lb, seq, lkv, g, d).astype(qg.dtype)

    ctx = shd.current()
    if ctx is None or getattr(ctx.mesh, "devices", None) is None:
        out = local(qg, k, v, segment_ids)
    else:
        # Heads are split on the kv-head axis so each device keeps whole GQA groups.
        spec5 = shd.logical_to_spec(
            ("batch", None, "activation_kv_heads", None, None), ctx.rules, qg.shape, ctx.mesh
        )
        bax, hax = spec5[0], spec5[2]
        spec4 = PartitionSpec(bax, None, hax, None)
        out = jax.shard_map(
            local,
            mesh=ctx.mesh,
            in_specs=(spec5, spec4, spec4, PartitionSpec(bax, None)),
            out_specs=spec5,
            check_vma=False,
        )(qg, k, v, segment_ids)
    return out.reshape(b, seq, h, d)[:, :s]
