"""Refinement-tuning loss: masked next-token cross-entropy, computed in sequence chunks.

The mask already encodes AgentRefine's choice (erroneous assistant turns carry no loss;
see `agentrefine_jax.data`). Here we only make it exact and cheap:
- `loss_mask[i] == 1` means token i is a training *target*, so position i-1 predicts it;
- a target is never the first token of a packed document or a padding token;
- the vocabulary projection runs chunk by chunk, so the full [batch, seq, vocab] float32
  logits never exist, forward or backward;
- the function returns a token *sum* and a token *count*; callers divide once over the
  whole global batch (gradient accumulation sums tokens, never averages means).

Two exact implementations (`train.loss_impl`):
- "remat": each chunk under `jax.checkpoint`; autodiff recomputes the chunk's logits in the
  backward pass. Nothing but the hidden states lives between forward and backward.
- "fused": a custom VJP whose forward pass already forms each chunk's `softmax - onehot`
  and from it `dh` and the lm_head gradient `dW` (accumulated in float32). No recompute, no
  scatter from a `take_along_axis` transpose, and two plain matmuls per chunk; the price is
  `dh` ([B, T, D]) and `dW` ([D, V], sharded like lm_head) held until the backward pass.
  Evaluation (no gradient) runs the plain chunked loss.
"auto" picks fused on both platforms: on CPU it was measured faster (benchmarks/train_step.py);
on TPU the compiler (libtpu 0.0.42.1, before the chunked MLP) put Llama-3-8B on v5p-64 (8192 x
128k vocabulary) at 20.11 GiB per device vs 20.22 GiB for remat, with one vocabulary matmul per
chunk fewer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from agentrefine_jax.sharding import constrain, logical_to_spec, spec_size
from agentrefine_jax.sharding import current as sharding_context

LOSS_IMPLS = ("auto", "fused", "remat")
_AUTO = {"cpu": "fused", "tpu": "fused"}


def resolve_loss_impl(impl: str, platform: str | None = None) -> str:
    """The concrete implementation for `impl` ("auto" -> per-platform default)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"train.loss_impl must be one of {LOSS_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return _AUTO.get(platform or jax.default_backend(), "remat")


def target_weights(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(targets, weights), each [B, S-1]: what position t predicts and whether it counts."""
    ids, mask, seg = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
    targets = ids[:, 1:]
    same_doc = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    weights = (mask[:, 1:] > 0) & same_doc
    return targets, weights.astype(jnp.float32)


def chunked_cross_entropy(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    chunk_size: int,
    impl: str = "remat",
) -> tuple[jax.Array, jax.Array]:
    """Sum of weighted token losses and sum of weights.

    hidden: [B, T, D] states at the predicting positions; lm_head: [D, V];
    targets/weights: [B, T] (weights are constants: no gradient flows into them).
    Only positions with weight > 0 reach the vocabulary projection (see `TokenLayout`).
    """
    impl = resolve_loss_impl(impl)
    lay = TokenLayout.of(weights, chunk_size)
    if impl == "fused":
        total = _fused_loss(hidden, lm_head, targets, weights, lay)
    else:
        total = _chunked_loss(hidden, lm_head, targets, weights, lay, remat=True)
    return total, jnp.sum(weights)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Where each position goes before the vocabulary projection, and which chunks are worth it
    (also the layout of objectives.token_logps: a pair's or a rollout's scored positions).

    Agent data trains on a minority of its tokens (the demo: 30%; observations, prompts, erroneous
    turns and padding carry no loss), yet a [tokens, vocab] matmul per token is most of a small
    model's step (the tiny test model: 3.4 of 3.7 s). So the rows of each batch shard are joined
    into one, its loss-bearing positions moved to the front (stable, so the order of the sum is the
    positions' own), and the projection runs chunk by chunk only while a chunk still holds one:
    chunks past the longest shard's count are skipped at run time (`lax.cond`), forward and
    backward. Joining only within a shard keeps the batch axis sharded as it was (no gather across
    devices): on one device the whole batch compacts together; with one row per shard each row does.
    A chunk is `chunk_size` tokens (at most a row's length) of each shard's joined row; each row is
    padded to whole chunks before the join, so the program's structure does not depend on how many
    rows a shard holds (the planner compares the traces of micro batches 1 and 2).
    """

    order: jax.Array  # [G, L] source position (in the joined, padded row) of each compacted slot
    inverse: jax.Array  # [G, L] compacted slot of each source position
    live: jax.Array  # [] number of chunks holding a loss-bearing position in some shard
    groups: int = dataclasses.field(metadata={"static": True})
    chunk: int = dataclasses.field(metadata={"static": True})

    @classmethod
    def of(cls, weights: jax.Array, chunk_size: int) -> TokenLayout:
        """For [B, T] `weights`: positions with weight > 0 are the ones projected."""
        b, t = weights.shape
        groups = _batch_shards(b)
        chunk = max(1, min(chunk_size, t))
        idle = (_pad_rows(weights, chunk).reshape(groups, -1) <= 0).astype(jnp.int32)
        order = jnp.argsort(idle, axis=1, stable=True)
        inverse = jnp.argsort(order, axis=1)
        longest = jnp.max(jnp.sum(1 - idle, axis=1))
        return cls(order, inverse, (longest + chunk - 1) // chunk, groups, chunk)

    def split(self, x: jax.Array) -> jax.Array:
        """[B, T, ...] -> [n_chunks, G, chunk, ...]: rows padded, joined per shard, compacted."""
        rest = x.shape[2:]
        x = _permute(_pad_rows(x, self.chunk).reshape(self.groups, -1, *rest), self.order, self.inverse)
        return jnp.moveaxis(x.reshape(self.groups, -1, self.chunk, *rest), 1, 0)

    def merge(self, xs: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """The inverse of `split` for a [n_chunks, G, chunk, ...] result: back to `shape`."""
        b, t = shape[:2]
        rest = xs.shape[3:]
        x = _permute(jnp.moveaxis(xs, 0, 1).reshape(self.groups, -1, *rest), self.inverse, self.order)
        return x.reshape(b, -1, *rest)[:, :t].reshape(shape)


def _pad_rows(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] zero-padded along T to whole chunks (padding has weight 0: never projected)."""
    pad = (-x.shape[1]) % chunk
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x


def _batch_shards(b: int) -> int:
    """How many devices the batch axis is split over in the active sharding context (1 outside)."""
    ctx = sharding_context()
    if ctx is None:
        return 1
    return spec_size(logical_to_spec(("batch",), ctx.rules, (b,), ctx.mesh)[0], ctx.mesh)


@jax.custom_vjp
def _permute(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[g, index[g, i]] along axis 1; its gradient is the inverse gather (no scatter-add)."""
    return _gather_rows(x, index)


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _permute_fwd(x: jax.Array, index: jax.Array, inverse: jax.Array):
    return _gather_rows(x, index), (index, inverse)


def _permute_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array):
    index, inverse = res
    return _gather_rows(g, inverse), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def chunk_logits_lse(h: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A chunk's float32 logits over the vocabulary and their log-sum-exp: what every chunked pass over
    the head reads (the SFT cross-entropy here, the objectives' token log-probabilities)."""
    logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
    return logits, jax.nn.logsumexp(logits, axis=-1)


def target_logit(logits: jax.Array, tgt: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]


def _chunked_loss(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    lay: TokenLayout,
    remat: bool,
) -> jax.Array:
    hs, ts, ws = lay.split(hidden), lay.split(targets), lay.split(weights)
    w = lm_head.astype(hidden.dtype)

    def chunk_loss(h: jax.Array, tgt: jax.Array, wt: jax.Array) -> jax.Array:
        logits, lse = chunk_logits_lse(h, w)
        return jnp.sum((lse - target_logit(logits, tgt)) * wt)

    def maybe(k: jax.Array, h: jax.Array, tgt: jax.Array, wt: jax.Array) -> jax.Array:
        return jax.lax.cond(k < lay.live, chunk_loss, lambda *_: jnp.zeros((), jnp.float32), h, tgt, wt)

    if remat:
        # The checkpoint wraps the cond, not the other way round: autodiff of a cond returns the
        # branch's residuals as outputs, which the scan would stack per chunk (lm_head among them:
        # [n_chunks, D, V]); a checkpoint's residuals are its inputs, and lm_head is loop-invariant.
        maybe = jax.checkpoint(maybe)

    def one(carry: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        return carry + maybe(*xs), None

    steps = jnp.arange(hs.shape[0])
    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), (steps, hs, ts, ws))
    return total


@jax.custom_vjp
def _fused_loss(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, weights: jax.Array, lay: TokenLayout
) -> jax.Array:
    return _chunked_loss(hidden, lm_head, targets, weights, lay, remat=False)


def _fused_fwd(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, weights: jax.Array, lay: TokenLayout
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    # `lay` is an ordinary argument (its arrays are traced); its cotangent is None.
    d = hidden.shape[-1]
    dt = hidden.dtype
    hs, ts, ws = lay.split(hidden), lay.split(targets), lay.split(weights)
    w = lm_head.astype(dt)
    vocab = w.shape[1]

    def work(
        carry: tuple[jax.Array, jax.Array], h: jax.Array, tgt: jax.Array, wt: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        total, dw = carry
        logits, lse = chunk_logits_lse(h, w)
        # A comparison against an iota, not take_along_axis: no gather/scatter pair.
        onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == tgt[..., None]
        tgt_logit = jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
        total = total + jnp.sum((lse - tgt_logit) * wt)
        # d(sum_t wt * (lse - logit_tgt)) / d logits = wt * (softmax - onehot).
        g = ((jnp.exp(logits - lse[..., None]) - onehot) * wt[..., None]).astype(dt)
        dh = jnp.einsum("bcv,dv->bcd", g, w, preferred_element_type=jnp.float32).astype(dt)
        dw = dw + jnp.einsum("bcd,bcv->dv", h, g, preferred_element_type=jnp.float32)
        return (total, constrain(dw, ("embed", "vocab"))), dh

    def idle(
        carry: tuple[jax.Array, jax.Array], h: jax.Array, tgt: jax.Array, wt: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        return carry, jnp.zeros_like(h)

    def one(
        carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        k, h, tgt, wt = xs
        return jax.lax.cond(k < lay.live, work, idle, carry, h, tgt, wt)

    dw0 = constrain(jnp.zeros((d, vocab), jnp.float32), ("embed", "vocab"))
    steps = jnp.arange(hs.shape[0])
    (total, dw), dhs = jax.lax.scan(one, (jnp.zeros((), jnp.float32), dw0), (steps, hs, ts, ws))
    return total, (lay.merge(dhs, hidden.shape), dw.astype(lm_head.dtype))


def _fused_bwd(
    res: tuple[jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array, None, None, None]:
    dh, dw = res
    return dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, None, None


_fused_loss.defvjp(_fused_fwd, _fused_bwd)
