"""Routed experts (Qwen3-MoE): the top-k softmax router and the grouped expert MLP.

Semantics are transformers' `Qwen3MoeSparseMoeBlock`: router logits in the compute dtype, a
float32 softmax over all experts, the top-k probabilities (renormalised to sum 1 when
`norm_topk_prob`) cast back to the compute dtype, and each token's output the weighted sum of its
k experts' SwiGLU MLPs.

The grouped matmul (`ragged`) sorts the B*S*k (token, expert) assignments by expert and runs each
projection as one `jax.lax.ragged_dot` over the expert groups: the work is that of k dense MLPs
per token, whatever the number of experts. `dense` runs every expert on every token and masks
by the routing weights (E/k times the work): the fallback where ragged_dot is missing, and the
oracle the tests hold `ragged` to.

On a mesh (`experts_per_shard`), each batch shard sorts and runs only its own tokens, inside a
shard_map over the batch's mesh axes: sorting the flattened global batch would make GSPMD gather
every token's [T*k, D] row to every device (Qwen3-30B-A3B at 64 x 8192 tokens: 16 GiB per copy;
the XLA TPU compiler asked for 137 GiB of temporaries for two layers on v5p-16). The expert
weights enter whole (the compiler all-gathers their fsdp shards, one layer at a time, as FSDP does
for a dense weight) -- unless the execution plan runs them expert-parallel over a mesh axis
(`tensor`, whose ranks all hold the same tokens): then each rank gathers and runs only its E/n
experts and a psum over that axis adds the ranks' shares. Tokens are never exchanged between
devices (no all-to-all dispatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from agentrefine_jax import sharding as shd

# (x [T, in], w [E, in, out], group_sizes [E], which projection: 0 gate, 1 up, 2 down, the model's
# id of w's first expert: 0, or where this expert-parallel rank's slice starts) -> [T, out]; the
# rows of x sorted by expert (rows past sum(group_sizes) belong to no group: zero out).
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array, int, Any], jax.Array]


def route(
    x: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D], router [D, E] -> (logits [T, E] in x's dtype, top-k weights [T, k] in x's dtype,
    top-k expert ids [T, k]). Ties go to the lower expert id, as torch.topk on CPU."""
    logits = x @ router.astype(x.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return logits, top_w.astype(x.dtype), top_i


def ragged_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, which: int = 0, first: Any = 0
) -> jax.Array:
    del which, first
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def experts_ragged(
    x: jax.Array,
    top_w: jax.Array,
    top_i: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    matmul: GroupedMatmul | None = None,
    first: Any = 0,
) -> jax.Array:
    """x [T, D]; w_gate/w_up [E', D, F], w_down [E', F, D] -> [T, D]: the experts first ..
    first + E' - 1 of the model (all of them by default). `matmul` is the grouped projection
    (default `ragged_matmul`; LoRA wraps it to add its own grouped delta).

    With a slice of the experts (expert parallelism), the (token, slot) assignments to other
    experts sort after this slice's groups: the grouped matmuls give them zero rows (they are in
    no group) and the combine drops them, so this rank's output is its experts' share only."""
    matmul = matmul or ragged_matmul
    t, d = x.shape
    e, k = w_gate.shape[0], top_i.shape[1]
    flat = top_i.reshape(-1) - first  # assignment j = token * k + slot; ids local to the slice
    mine = (flat >= 0) & (flat < e)
    flat = jnp.where(mine, flat, e)  # other slices' assignments: one key past the last group
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xs = jnp.take(x, token, axis=0)  # [T*k, D], grouped by expert
    sizes = jnp.bincount(flat, length=e + 1)[:e]  # (bincount puts ids past `length` in its last bin)
    act = jax.nn.silu(matmul(xs, w_gate, sizes, 0, first)) * matmul(xs, w_up, sizes, 1, first)
    out = matmul(act, w_down, sizes, 2, first) * jnp.take(top_w.reshape(-1), order)[:, None]
    out = jnp.where(jnp.take(mine, order)[:, None], out, 0)
    return jnp.zeros((t, d), out.dtype).at[token].add(out)


def experts_dense(
    x: jax.Array,
    top_w: jax.Array,
    top_i: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    matmul: Any = None,
    first: Any = 0,
) -> jax.Array:
    """Every expert on every token, combined by the routing weights (zero off the top k); with a
    slice of the experts (first .. first + E' - 1), that slice's share."""
    if matmul is not None:  # a wrapped grouped matmul (expert adapters) needs ragged_dot
        raise NotImplementedError("adapters on routed experts need jax.lax.ragged_dot (jax >= 0.4.31)")
    e = w_gate.shape[0]
    combine = jnp.sum(jax.nn.one_hot(top_i - first, e, dtype=x.dtype) * top_w[..., None], axis=1)  # [T, E']
    act = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
    return jnp.einsum("tef,efd,te->td", act, w_down, combine)


# The grouped matmul where this jax has it, else the dense fallback.
experts = experts_ragged if hasattr(jax.lax, "ragged_dot") else experts_dense


def experts_per_shard(
    x: jax.Array,
    top_w: jax.Array,
    top_i: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    matmul: GroupedMatmul | None = None,
    expert_axis: str | None = None,
) -> jax.Array:
    """`experts` on x [B, S, D], top_w/top_i [B, S, k] -> [B, S, D], each batch shard of the
    active mesh (sharding.use_sharding) routing its own rows; plain `experts` without a mesh.

    With `expert_axis` (the execution plan's: expert parallelism), each rank of that mesh axis
    takes its E/n experts' slice of the weights and runs only the assignments routed to them; the
    ranks' shares are summed over the axis. The rows must be replicated over it (the batch is not
    split over `tensor`), so no token moves between devices."""
    b, s, d = x.shape
    k = top_i.shape[-1]
    e = w_gate.shape[0]
    ctx = shd.current()
    on_mesh = ctx is not None and getattr(ctx.mesh, "devices", None) is not None
    bax = shd.logical_to_spec(("batch",), ctx.rules, (b,), ctx.mesh)[0] if on_mesh else None
    batch_axes = () if bax is None else (bax,) if isinstance(bax, str) else tuple(bax)
    n = ctx.mesh.shape.get(expert_axis, 1) if on_mesh and expert_axis else 1
    ep = expert_axis if n > 1 and e % n == 0 and expert_axis not in batch_axes else None

    def local(x: jax.Array, top_w: jax.Array, top_i: jax.Array, *w: jax.Array) -> jax.Array:
        lb = x.shape[0]
        first = 0 if ep is None else jax.lax.axis_index(ep) * w[0].shape[0]
        out = experts(
            x.reshape(lb * s, d),
            top_w.reshape(lb * s, k),
            top_i.reshape(lb * s, k),
            *w,
            matmul=matmul,
            first=first,
        )
        if ep is not None:
            out = jax.lax.psum(out, ep)
        return out.reshape(lb, s, d)

    if bax is None and ep is None:  # no mesh, or one device, or rows that do not divide
        return local(x, top_w, top_i, w_gate, w_up, w_down)
    rows = PartitionSpec(bax, None, None)
    weights = PartitionSpec(ep, None, None)  # E/n whole experts per rank of the expert axis
    # check_vma off, as for the splash kernel's shard_map. The weights are unmapped over the batch
    # axes, so shard_map's transpose sums their cotangents over the batch shards (an all-reduce).
    return jax.shard_map(
        local,
        mesh=ctx.mesh,
        in_specs=(rows, rows, rows, weights, weights, weights),
        out_specs=rows,
        check_vma=False,
    )(x, top_w, top_i, w_gate, w_up, w_down)


def router_stats(logits: jax.Array, top_i: jax.Array, mask: jax.Array) -> jax.Array:
    """One layer's share of the load-balancing loss: [2, E] = (how many of the real tokens' top-k
    slots went to each expert, the sum of their router probabilities per expert). logits [T, E],
    top_i [T, k], mask [T] (1 = a real token, as transformers' attention_mask)."""
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    m = mask.astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(top_i, e, dtype=jnp.float32) * m[:, None, None], axis=(0, 1))
    return jnp.stack([counts, jnp.sum(probs * m[:, None], axis=0)])


def load_balancing_loss(stats: jax.Array, rows: jax.Array) -> jax.Array:
    """transformers' `load_balancing_loss_func` (Switch Transformer) from the router statistics
    summed over the layers and `rows` (real tokens x layers): E * sum_e (top-k slots routed to e /
    rows) * (router probability of e summed / rows). Balanced routing gives k."""
    counts, probs = stats[0], stats[1]
    rows = jnp.maximum(rows, 1.0)
    return jnp.sum((counts / rows) * (probs / rows)) * stats.shape[-1]
