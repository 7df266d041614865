"""One config-driven decoder (Llama-3, Mistral, Qwen2.5, Qwen3, Qwen3-MoE: models/families.py) in Flax NNX.

Layer parameters are always stored stacked along a leading "layers" axis, so the
checkpoint layout does not depend on `scan_layers`: scanning only changes how the
forward pass walks that axis (one compiled body vs. an unrolled loop).

The model reads its architecture from `cfg` and every run-time choice (compute dtype, kernel,
CPU layout, scan, remat, chunk sizes) from `plan`, an `ExecutionPlan` decided once for the
devices it is compiled for (models/execution.py) and fixed at construction.

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

from agentrefine_jax.models import cpu_layout, execution, lora, moe, params, quant, rope
from agentrefine_jax.models.attention import Segments, attend
from agentrefine_jax.models.config import Architecture, ModelConfig
from agentrefine_jax.models.execution import ExecutionPlan
from agentrefine_jax.sharding import constrain

Cache = dict[str, jax.Array]

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_out": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


def _create(rngs: nnx.Rngs, cfg: ModelConfig, row: params.Param) -> nnx.Param:
    shape, dtype = params.shape(row, cfg), jnp.dtype(cfg.param_dtype)
    if row.init in ("ones", "zeros"):
        value = (jnp.ones if row.init == "ones" else jnp.zeros)(shape, dtype)
    else:
        value = jax.nn.initializers.normal(cfg.initializer_range)(rngs.params(), shape, dtype)
    return nnx.Param(value, axes=params.logical_axes(row))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in float32, cast back, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked along a leading `num_layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        for row in params.present(cfg):
            if row.per_layer:
                setattr(self, row.path[1], _create(rngs, cfg, row))


def layer_forward(
    cfg: Architecture,
    plan: ExecutionPlan,
    p: dict[str, jax.Array],
    x: jax.Array,
    sin: jax.Array,
    cos: jax.Array,
    seg: Segments,
    kv: tuple[jax.Array, jax.Array] | None,
    index: jax.Array | None,
    lora_spec: lora.LoraSpec | None = None,
    mlp_chunk: int = 0,
    router_mask: jax.Array | None = None,
) -> tuple[Any, ...]:
    """One decoder layer on per-layer weights `p` (a slice of DecoderLayers): (x, new kv); with
    `router_mask` ([B, S], 1 = a real token; MoE layers) also its router statistics [2, E]
    (`moe.router_stats`) for the load-balancing loss. With `lora_spec`,
    `p["lora"]` holds this layer's adapters and `p["lora_key"]` (optional) its dropout key.
    `mlp_chunk`: the MLP's sequence chunk in a full-sequence pass (0 = whole; `forward` decides)."""
    dt = jnp.dtype(plan.dtype)
    flat = kv is None and plan.cpu_layout
    proj_in = cpu_layout.project_in if flat else _project_in
    proj_out = cpu_layout.project_out if flat else _project_out
    # With a KV cache (prefill and decode), 16-bit projections on CPU ask for a float32 result and
    # round it once: XLA:CPU then runs its bfloat16 x bfloat16 -> float32 kernels, 1.9-3.1x faster
    # than the bfloat16-output dots at 8-32 rows (Intel Xeon with AMX, 30 layers of 576x1536). A lone
    # dot gives the same values either way (XLA:CPU accumulates in float32); in the model the fusions
    # around it may round differently. Not in training: the float32 result would make the backward's
    # dots mixed-precision. Other platforms keep the dot as written.
    acc = jnp.float32 if kv is not None and plan.platform == "cpu" and dt.itemsize == 2 else None

    def proj(matmul: Any, h: jax.Array, name: str) -> jax.Array:
        w = quant.dequantize(p[name], dt)  # an int8 base (QArray) dequantises per layer
        if acc is None:
            y = matmul(h, w)
        else:
            y = matmul(h, w, preferred_element_type=acc).astype(dt)
        if lora_spec is not None and name in p["lora"]:
            key = p.get("lora_key")
            key = None if key is None else jax.random.fold_in(key, lora_spec.names.index(name))
            y = y + lora.delta(h, p["lora"][name], params.BY_PATH[("layers", name)].n_in, lora_spec, key)
        return y

    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q = proj(proj_in, h, "wq")
    k = proj(proj_in, h, "wk")
    v = proj(proj_in, h, "wv")
    if "bq" in p:  # families with q/k/v biases (models/families.py), added before RoPE as in HF
        q, k, v = (t + p[b].astype(t.dtype) for t, b in ((q, "bq"), (k, "bk"), (v, "bv")))
    if "q_norm" in p:  # families with q/k RMSNorm (Qwen3): per head over head_dim, before RoPE as in HF
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = constrain(rope.apply(q, sin, cos), ("batch", "activation_seq", "activation_heads", None))
    k = constrain(rope.apply(k, sin, cos), ("batch", "activation_seq", "activation_kv_heads", None))
    v = constrain(v, ("batch", "activation_seq", "activation_kv_heads", None))
    new_kv = None
    if kv is not None:  # the cache is [B, KVH, T, D] (`init_cache`): the new columns go in along T
        k_new, v_new = (t.transpose(0, 2, 1, 3).astype(kv[0].dtype) for t in (k, v))
        axis = 2
        k_axis = axis
        if kv[0].ndim == 3:  # a decode loop's per-layer K [B*KVH, D, T] and V [B*KVH, T, D] (`flat_heads`)
            k_new, v_new = (t.reshape(-1, *t.shape[2:]) for t in (k_new, v_new))
            k_new, k_axis, axis = k_new.transpose(0, 2, 1), 2, 1
        k_cache = jax.lax.dynamic_update_slice_in_dim(kv[0], k_new, index, axis=k_axis)
        v_cache = jax.lax.dynamic_update_slice_in_dim(kv[1], v_new, index, axis=axis)
        new_kv = (k_cache, v_cache)
        k, v = k_cache.astype(dt), v_cache.astype(dt)
    attn = attend(cfg, plan, q, k, v, seg, cached=kv is not None)
    attn = checkpoint_name(attn, "attn_out")
    x = x + proj(proj_out, attn, "wo")
    x = constrain(x, ("batch", "activation_seq", "activation_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)

    def mlp(h: jax.Array) -> jax.Array:
        if "router" in p:  # routed experts (families with `moe`): models/moe.py
            return _moe_mlp(cfg, plan, p, h, dt, lora_spec)[0]
        gate = proj(proj_in, h, "w_gate")
        up = proj(proj_in, h, "w_up")
        act = constrain(jax.nn.silu(gate) * up, ("batch", "activation_seq", "activation_mlp"))
        return proj(proj_out, act, "w_down")

    if router_mask is not None:  # the whole sequence at once: the statistics are over all of it
        out, stats = _moe_mlp(cfg, plan, p, h, dt, lora_spec, router_mask)
        return constrain(x + out, ("batch", "activation_seq", "activation_embed")), new_kv, stats
    chunked = kv is None and not flat
    x = x + (mlp_in_chunks(mlp, h, mlp_chunk) if chunked else mlp(h))
    return constrain(x, ("batch", "activation_seq", "activation_embed")), new_kv


def _moe_mlp(
    cfg: Architecture,
    plan: ExecutionPlan,
    p: dict[str, Any],
    h: jax.Array,
    dt: Any,
    lora_spec: lora.LoraSpec | None,
    router_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The routed-expert MLP on [B, S, D]: every token's top-k experts (models/moe.py), and with
    `router_mask` the router statistics (else None). With `lora_spec` naming expert projections,
    their grouped LoRA deltas join each grouped matmul. The plan's `expert_axis` splits the experts'
    compute over that mesh axis (expert parallelism)."""
    b, s, d = h.shape
    x = h.reshape(b * s, d)
    logits, top_w, top_i = moe.route(x, p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    stats = None if router_mask is None else moe.router_stats(logits, top_i, router_mask.reshape(-1))
    weights = [quant.dequantize(p[name], dt) for name in params.EXPERT_NAMES]
    # LoRA on the experts (when handed expert adapters) wraps the grouped matmul: models/lora.py.
    matmul = lora.expert_matmul(p.get("lora"), lora_spec, p.get("lora_key"))
    k = top_i.shape[-1]
    top_w, top_i = top_w.reshape(b, s, k), top_i.reshape(b, s, k)
    out = moe.experts_per_shard(h, top_w, top_i, *weights, matmul=matmul, expert_axis=plan.expert_axis)
    return out, stats


def mlp_in_chunks(mlp: Any, h: jax.Array, chunk: int) -> jax.Array:
    """`mlp` over sequence chunks of `chunk` tokens, each under `jax.checkpoint`: the backward pass
    holds one chunk's [B, chunk, intermediate] gate/up/activation tensors and their gradients
    instead of the whole sequence's (at 8B, 8k tokens: 448 MiB each per 2 sequences). Exact: the MLP
    acts per token. The weights enter as the layer's stored (float32) slices and are cast inside,
    so the chunks' weight gradients add up in float32."""
    b, s, d = h.shape
    if chunk <= 0 or s <= chunk or s % chunk:
        return mlp(h)
    n = s // chunk
    hs = jnp.moveaxis(h.reshape(b, n, chunk, d), 1, 0)
    out = jax.lax.map(jax.checkpoint(mlp), hs)
    return jnp.moveaxis(out, 0, 1).reshape(b, s, d)


def _project_in(x: jax.Array, w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """[B, S, D] x [D, *out] -> [B, S, *out] (the default, sharding-friendly einsum)."""
    spec = "bsd,dhk->bshk" if w.ndim == 3 else "bsd,df->bsf"
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)


def _project_out(x: jax.Array, w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """[B, S, *in] x [*in, D] -> [B, S, D] (the default, sharding-friendly einsum)."""
    spec = "bshk,hkd->bsd" if x.ndim == 4 else "bsf,fd->bsd"
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, plan: ExecutionPlan | None = None):
        """`plan`: how it runs; by default decided for the active mesh's devices, else the default
        devices' (a step compiled for other devices passes its own: train/param_mode.py)."""
        self.cfg = cfg
        self.plan = plan if plan is not None else execution.for_devices(cfg)
        # Table order is also the order random initialisers draw in: embed, layers, head.
        for row in params.present(cfg):
            if not row.per_layer:
                setattr(self, row.path[0], _create(rngs, cfg, row))
            elif not hasattr(self, "layers"):
                self.layers = DecoderLayers(cfg, rngs=rngs)

    # ----------------------------------------------------------------------------- API

    def lm_head_weight(self) -> jax.Array:
        """[hidden, vocab] output projection (the embedding, transposed, when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Logits [B, S, vocab] float32. `head`: the output projection again as [hidden, vocab] (a
        decode step's transposed copy of a tied embedding: `inference.engine.head_weight` says why)."""
        if head is not None:
            w = head.astype(hidden.dtype)
            out = jnp.einsum("bsd,dv->bsv", hidden, w, preferred_element_type=jnp.float32)
        elif self.cfg.tie_embeddings:
            # The embedding as stored, [vocab, hidden], contracted on its last axis: `embed.T` made
            # XLA:CPU copy (transpose) the whole 113 MB table on every decode step of SmolLM2.
            w = self.embed[...].astype(hidden.dtype)
            out = jnp.einsum("bsd,vd->bsv", hidden, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head[...].astype(hidden.dtype)
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
        adapters: tuple[lora.LoraSpec, lora.Adapters, jax.Array | None] | None = None,
        layers: tuple[dict[str, Any], ...] | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Final-normed hidden states [B, S, hidden] (compute dtype) and the updated cache.

        `segment_ids` 0 marks padding; `positions` restart per segment. With a cache the
        tokens are written at `cache["index"]` and attend to every live cache slot.
        `adapters` = (spec, stacked LoRA weights, dropout key or None) adds LoRA deltas.
        `layers`: the layer weights again, one dict per layer, for an unrolled stack to read instead
        of slicing the stacked parameters (`cpu_layout.layer_views`: the same memory, no copy).
        """
        hidden, new_cache, _ = self._forward(
            input_ids, positions, segment_ids, cache, adapters, layers=layers
        )
        return hidden, new_cache

    def forward_with_router_loss(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        adapters: tuple[lora.LoraSpec, lora.Adapters, jax.Array | None] | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """A full-sequence pass of an MoE model: hidden states and transformers' auxiliary
        load-balancing loss over every layer's routing of the real (segment > 0) tokens."""
        if not self.cfg.num_experts:
            raise ValueError(f"a {self.cfg.family} model routes no experts: it has no load-balancing loss")
        hidden, _, stats = self._forward(input_ids, positions, segment_ids, None, adapters, router_stats=True)
        n = jnp.sum(segment_ids > 0).astype(jnp.float32) * self.cfg.num_layers
        return hidden, moe.load_balancing_loss(stats, n)

    def _forward(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None,
        segment_ids: jax.Array | None,
        cache: Cache | None,
        adapters: tuple[lora.LoraSpec, lora.Adapters, jax.Array | None] | None,
        router_stats: bool = False,
        layers: tuple[dict[str, Any], ...] | None = None,
    ) -> tuple[jax.Array, Cache | None, jax.Array | None]:
        """`forward`, and with `router_stats` (no cache) the router statistics summed over the
        layers ([2, E], `moe.router_stats`)."""
        cfg, plan = self.cfg, self.plan
        b, s = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(jnp.dtype(plan.dtype))
        x = constrain(x, ("batch", "activation_seq", "activation_embed"))
        sin, cos = rope.sin_cos(cfg, positions)

        index = None
        if cache is None:
            k_seg, k_pos = segment_ids, positions
        else:
            index = cache["index"]
            k_seg = jax.lax.dynamic_update_slice_in_dim(cache["segment_ids"], segment_ids, index, axis=1)
            k_pos = jax.lax.dynamic_update_slice_in_dim(cache["positions"], positions, index, axis=1)

        seg = Segments(segment_ids, positions, k_seg, k_pos)
        weights: dict[str, Any] = {name: getattr(self.layers, name)[...] for name in params.layer_names(cfg)}
        spec, key = None, None
        if adapters is not None:
            spec, weights["lora"], key = adapters
        dropout_keys = lora.dropout_keys(spec, key, cfg.num_layers)
        # Dropout draws one mask per call, so a layer that draws it runs its MLP unchunked.
        mlp_chunk = plan.mlp_chunk_size if dropout_keys is None else 0
        if dropout_keys is not None:
            weights["lora_key"] = dropout_keys

        real = (segment_ids > 0).astype(jnp.float32) if router_stats else None

        def body(carry: Any, xs: tuple[dict[str, jax.Array], Any]) -> tuple[Any, Any]:
            p, kv = xs
            if real is None:
                return layer_forward(cfg, plan, p, carry, sin, cos, seg, kv, index, spec, mlp_chunk)
            x, acc = carry  # the router statistics ride in the carry, summed over the layers
            x, new_kv, stats = layer_forward(cfg, plan, p, x, sin, cos, seg, kv, index, spec, 0, real)
            return (x, acc + stats), new_kv

        # The CPU layout unrolls the layers of a full-sequence pass (models/cpu_layout.py); decoding
        # keeps the scan unless the cache comes as one array per layer (`init_cache(per_layer=True)`).
        layered = cache is not None and isinstance(cache["k"], tuple)
        scan = plan.scan_full_sequence if cache is None else plan.scan_layers and not layered
        if layers is not None and (adapters is not None or len(layers) != cfg.num_layers):
            raise ValueError("per-layer weights serve a forward pass without adapters, one dict per layer")
        scan = scan and layers is None
        if plan.remat_policy != "none":
            body = jax.checkpoint(body, policy=_REMAT[plan.remat_policy], prevent_cse=not scan)
        kv_stack = None if cache is None else (cache["k"], cache["v"])
        stats = None
        if real is not None:
            x = (x, jnp.zeros((2, cfg.num_experts), jnp.float32))
        if scan:
            x, new_kv = jax.lax.scan(body, x, (weights, kv_stack))
        else:
            outs = []
            per_layer = _unstack_layers(weights, cfg.num_layers) if layers is None else layers
            for i in range(cfg.num_layers):
                layer_kv = None if kv_stack is None else (kv_stack[0][i], kv_stack[1][i])
                x, kv_i = body(x, (per_layer[i], layer_kv))
                outs.append(kv_i)
            new_kv = None
            if kv_stack is not None:
                new_kv = tuple((tuple if layered else jnp.stack)(t) for t in zip(*outs, strict=True))

        if real is not None:
            x, stats = x
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
        return hidden, new_cache, stats


def _unstack_layers(weights: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Each layer's weights out of the stacked [layers, ...] arrays, for the unrolled stack. One unstack per
    array, not a slice per layer: a slice's gradient is the whole stacked array zero-padded around it, and
    XLA:CPU summed the layers' padded gradients in one fusion reading every layer per element (30x the
    work on SmolLM2: ~0.9 s of a 4 s train step); an unstack's gradient is one stack."""
    flat, treedef = jax.tree.flatten(weights)
    parts = [jax.lax.unstack(a) for a in flat]
    return [jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(n)]


def flat_heads(cache: Cache) -> Cache:
    """A per-layer cache (`init_cache(per_layer=True)`) with each layer's V as [B*KVH, T, D] (a
    reshape: no copy) and K as [B*KVH, D, T] (a transpose), the forms a loop of decode steps carries.

    Why flat: that is the form the attention dots read (`attention.attend_flat`). With
    [B, KVH, T, D] arrays the step's column write fed both the loop's carry and, through a reshape,
    the dot, and XLA:CPU duplicated the write into both consumers -- two updates of one buffer, so it
    copied every layer's K and V four times per step (SmolLM2, batch 8, 128 columns: 189 MB per
    step). `unflat_heads` undoes it.

    Why K transposed: the step's scores dot then contracts K's leading axis ([n, 3, D] x [n, D, T]),
    the form XLA:CPU's dot runs fastest; contracting K's last axis ([n, T, D]) it ran the attention
    of SmolLM2's 30 layers at batch 8 1.35x slower, at 128 and at 1,088 columns (docs/inference.md,
    "The decode step at batch 8"). The transpose is two copies of K per decode *call*, not per step.
    """
    k = tuple(_flat(a).transpose(0, 2, 1) for a in cache["k"])
    return {**cache, "k": k, "v": tuple(_flat(a) for a in cache["v"])}


def _flat(a: jax.Array) -> jax.Array:
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def unflat_heads(cache: Cache, batch: int) -> Cache:
    """`flat_heads` undone: each layer's K and V as [batch, kv_heads, T, D] again."""
    return {
        **cache,
        "k": tuple(a.transpose(0, 2, 1).reshape(batch, -1, a.shape[2], a.shape[1]) for a in cache["k"]),
        "v": tuple(a.reshape(batch, -1, *a.shape[1:]) for a in cache["v"]),
    }


def map_kv(cache: Cache, f: Any) -> Cache:
    """`cache` with `f` applied to each layer's K and V ([batch, kv_heads, T, D] -> same rank),
    whether the cache is stacked ([layers, ...] arrays: `f` is vmapped over the layers) or per layer."""
    if isinstance(cache["k"], tuple):
        return {**cache, "k": tuple(map(f, cache["k"])), "v": tuple(map(f, cache["v"]))}
    return {**cache, "k": jax.vmap(f)(cache["k"]), "v": jax.vmap(f)(cache["v"])}


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None, *, per_layer: bool = False
) -> Cache:
    """An empty KV cache: every slot has segment 0, which no real query (segment >= 1) sees.

    K and V are [layers, batch, kv_heads, max_len, head_dim]: heads before columns, so attention reads
    each (row, head)'s keys as one contiguous [max_len, head_dim] block; with columns before heads
    XLA:CPU transposed every layer's whole cache on every decode step to get that form.

    `per_layer` (the CPU layout's unrolled stack, `ExecutionPlan.cpu_layout`): K and V are tuples of
    one [batch, kv_heads, max_len, head_dim] array per layer instead, kept so from prefill through
    every decode call. A stacked cache had to be split into per-layer arrays for each decode call (so
    a step writes its column in place) and stacked again after it: two copies of the whole cache per
    call, i.e. per 16 steps where a stop string makes the engine decode in chunks (8 rows x 1,024
    columns: ~0.75 GB each way).
    """
    dt = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    if per_layer:
        k = tuple(jnp.zeros(shape[1:], dt) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(shape[1:], dt) for _ in range(cfg.num_layers))
    else:
        k, v = jnp.zeros(shape, dt), jnp.zeros(shape, dt)
    return {
        "k": k,
        "v": v,
        "segment_ids": jnp.zeros((batch, max_len), jnp.int32),
        "positions": jnp.zeros((batch, max_len), jnp.int32),
        "index": jnp.zeros((), jnp.int32),
    }


def create(cfg: ModelConfig, seed: int = 0, plan: ExecutionPlan | None = None) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), plan=plan)


def abstract(cfg: ModelConfig, plan: ExecutionPlan | None = None) -> Transformer:
    """The model with ShapeDtypeStruct leaves: shapes and axes, no memory allocated."""
    return nnx.eval_shape(lambda: create(cfg, plan=plan))


def abstract_params(cfg: ModelConfig, plan: ExecutionPlan | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """GraphDef and ShapeDtypeStruct parameter state of the model `cfg` describes (no memory);
    the graphdef carries `plan` (default: see `Transformer`)."""
    graphdef, state, rest = nnx.split(abstract(cfg, plan), nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise RuntimeError("Transformer holds non-parameter state; the checkpoint format must be extended")
    return graphdef, state


def param_count(model_or_state: Any) -> int:
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    return sum(int(x.size) for x in jax.tree.leaves(state))
