"""One config-driven LLaMA-3 / Mistral decoder in Flax NNX.

Layer parameters are always stored stacked along a leading "layers" axis, so the
checkpoint layout does not depend on `scan_layers`: scanning only changes how the
forward pass walks that axis (one compiled body vs. an unrolled loop).

Attention masks come from (segment_ids, positions) of queries and keys, never from
array indices: packed documents cannot see each other, per-document positions restart,
and the same rule serves training, left-padded batches and the KV cache.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from agentrefine_jax.models import cpu_layout, rope
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.sharding import constrain

Cache = dict[str, jax.Array]
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_out": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


def _param(rngs: nnx.Rngs, cfg: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    init = jax.nn.initializers.normal(cfg.initializer_range)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)), axes=axes)


def _ones(cfg: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.dtype(cfg.param_dtype)), axes=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in float32, cast back, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def attention_mask(
    q_seg: jax.Array, q_pos: jax.Array, k_seg: jax.Array, k_pos: jax.Array, window: int | None
) -> jax.Array:
    """[B, Sq, Sk] boolean: same document, causal by position, inside the sliding window."""
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        mask &= (q_pos[:, :, None] - k_pos[:, None, :]) < window
    return mask


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q: [B, S, KVH, G, D]; k, v: [B, T, KVH, D]; mask: [B, S, T] -> [B, S, KVH, G, D]."""
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
    scores = scores * (q.shape[-1] ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v)


def _attend_blocked(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int) -> jax.Array:
    """Exact attention over query blocks; each block is rematerialised in the backward pass."""
    b, s = q.shape[:2]
    if block <= 0 or s <= block or s % block:
        return _attend(q, k, v, mask)
    n = s // block
    qb = jnp.moveaxis(q.reshape(b, n, block, *q.shape[2:]), 1, 0)
    mb = jnp.moveaxis(mask.reshape(b, n, block, mask.shape[-1]), 1, 0)
    out = jax.lax.map(jax.checkpoint(lambda args: _attend(args[0], k, v, args[1])), (qb, mb))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked along a leading `num_layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        n, d, h, kv, hd, f = (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        self.attn_norm = _ones(cfg, (n, d), ("layers", "norm"))
        self.wq = _param(rngs, cfg, (n, d, h, hd), ("layers", "embed", "heads", "head_dim"))
        self.wk = _param(rngs, cfg, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, cfg, (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, cfg, (n, h, hd, d), ("layers", "heads", "head_dim", "embed"))
        self.mlp_norm = _ones(cfg, (n, d), ("layers", "norm"))
        self.w_gate = _param(rngs, cfg, (n, d, f), ("layers", "embed", "mlp"))
        self.w_up = _param(rngs, cfg, (n, d, f), ("layers", "embed", "mlp"))
        self.w_down = _param(rngs, cfg, (n, f, d), ("layers", "mlp", "embed"))


def layer_forward(
    cfg: ModelConfig,
    p: dict[str, jax.Array],
    x: jax.Array,
    sin: jax.Array,
    cos: jax.Array,
    q_seg: jax.Array,
    q_pos: jax.Array,
    k_seg: jax.Array,
    k_pos: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    index: jax.Array | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """One decoder layer on per-layer weights `p` (a slice of DecoderLayers)."""
    dt = jnp.dtype(cfg.dtype)
    b, s, _ = x.shape
    flat = cfg.cpu_layout and kv is None
    proj_in = cpu_layout.project_in if flat else _project_in
    proj_out = cpu_layout.project_out if flat else _project_out
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q = proj_in(h, p["wq"].astype(dt))
    k = proj_in(h, p["wk"].astype(dt))
    v = proj_in(h, p["wv"].astype(dt))
    q = constrain(rope.apply(q, sin, cos), ("batch", "activation_seq", "activation_heads", None))
    k = constrain(rope.apply(k, sin, cos), ("batch", "activation_seq", "activation_kv_heads", None))
    v = constrain(v, ("batch", "activation_seq", "activation_kv_heads", None))
    new_kv = None
    if kv is not None:
        k_cache = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), index, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), index, axis=1)
        new_kv = (k_cache, v_cache)
        k, v = k_cache.astype(dt), v_cache.astype(dt)
    mask = attention_mask(q_seg, q_pos, k_seg, k_pos, cfg.sliding_window)
    qg = q.reshape(b, s, cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim)
    if flat:
        attn = cpu_layout.attend_flat(qg, k, v, mask)
    else:
        attn = _attend_blocked(qg, k, v, mask, cfg.attention_block_size)
    attn = attn.reshape(b, s, cfg.num_heads, cfg.head_dim)
    attn = checkpoint_name(attn, "attn_out")
    x = x + proj_out(attn, p["wo"].astype(dt))
    x = constrain(x, ("batch", "activation_seq", "activation_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    gate = proj_in(h, p["w_gate"].astype(dt))
    up = proj_in(h, p["w_up"].astype(dt))
    act = constrain(jax.nn.silu(gate) * up, ("batch", "activation_seq", "activation_mlp"))
    x = x + proj_out(act, p["w_down"].astype(dt))
    return constrain(x, ("batch", "activation_seq", "activation_embed")), new_kv


def _project_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, S, D] x [D, *out] -> [B, S, *out] (the default, sharding-friendly einsum)."""
    if w.ndim == 3:
        return jnp.einsum("bsd,dhk->bshk", x, w)
    return jnp.einsum("bsd,df->bsf", x, w)


def _project_out(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, S, *in] x [*in, D] -> [B, S, D] (the default, sharding-friendly einsum)."""
    if x.ndim == 4:
        return jnp.einsum("bshk,hkd->bsd", x, w)
    return jnp.einsum("bsf,fd->bsd", x, w)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        embed_init = jax.nn.initializers.normal(cfg.initializer_range)
        self.embed = nnx.Param(
            embed_init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdt), axes=("vocab", "embed")
        )
        self.layers = DecoderLayers(cfg, rngs=rngs)
        self.final_norm = _ones(cfg, (cfg.hidden_size,), ("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

    # ----------------------------------------------------------------------------- API

    def lm_head_weight(self) -> jax.Array:
        """[hidden, vocab] output projection (the embedding, transposed, when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        w = self.lm_head_weight().astype(hidden.dtype)
        out = jnp.einsum("bsd,dv->bsv", hidden, w, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "activation_seq", "activation_vocab"))

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, S, vocab] (float32) for a (possibly packed) batch."""
        hidden, _ = self.forward(input_ids, positions, segment_ids)
        return self.logits(hidden)

    def forward(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: Cache | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Final-normed hidden states [B, S, hidden] (compute dtype) and the updated cache.

        `segment_ids` 0 marks padding; `positions` restart per segment. With a cache the
        tokens are written at `cache["index"]` and attend to every live cache slot.
        """
        cfg = self.cfg
        b, s = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(jnp.dtype(cfg.dtype))
        x = constrain(x, ("batch", "activation_seq", "activation_embed"))
        sin, cos = rope.sin_cos(cfg, positions)

        index = None
        if cache is None:
            k_seg, k_pos = segment_ids, positions
        else:
            index = cache["index"]
            k_seg = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids"], segment_ids, index, axis=1)
            k_pos = jax.lax.dynamic_update_slice_in_dim(cache["positions"], positions, index, axis=1)

        weights = {name: getattr(self.layers, name)[...] for name in _LAYER_PARAMS}

        def body(carry: jax.Array, xs: tuple[dict[str, jax.Array], Any]) -> tuple[jax.Array, Any]:
            p, kv = xs
            return layer_forward(cfg, p, carry, sin, cos, segment_ids, positions, k_seg, k_pos, kv, index)

        if cfg.remat_policy != "none":
            body = jax.checkpoint(body, policy=_REMAT[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
        kv_stack = None if cache is None else (cache["k"], cache["v"])
        if cfg.scan_layers:
            x, new_kv = jax.lax.scan(body, x, (weights, kv_stack))
        else:
            outs = []
            for i in range(cfg.num_layers):
                layer_kv = None if kv_stack is None else (kv_stack[0][i], kv_stack[1][i])
                x, kv_i = body(x, (jax.tree.map(lambda a, i=i: a[i], weights), layer_kv))
                outs.append(kv_i)
            new_kv = None if kv_stack is None else tuple(jnp.stack(t) for t in zip(*outs, strict=True))

        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        new_cache = None
        if cache is not None:
            new_cache = {
                "k": new_kv[0],
                "v": new_kv[1],
                "segment_ids": k_seg,
                "positions": k_pos,
                "index": index + s,
            }
        return hidden, new_cache


_LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> Cache:
    """An empty KV cache: every slot has segment 0, which no real query (segment >= 1) sees."""
    dt = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {
        "k": jnp.zeros(shape, dt),
        "v": jnp.zeros(shape, dt),
        "segment_ids": jnp.zeros((batch, max_len), jnp.int32),
        "positions": jnp.zeros((batch, max_len), jnp.int32),
        "index": jnp.zeros((), jnp.int32),
    }


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def abstract(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves: shapes and axes, no memory allocated."""
    return nnx.eval_shape(lambda: create(cfg))


def param_count(model_or_state: Any) -> int:
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    return sum(int(x.size) for x in jax.tree.leaves(state))
