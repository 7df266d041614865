"""The memory-saving execution choices compute the same numbers: the sequence-chunked MLP
(model.mlp_chunk_size) and RoPE's own gradient (models/rope.apply) against the plain forms."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrefine_jax.models import create, preset, rope
from agentrefine_jax.train.step import loss_sums

# The TPU layout (scanned layers, 4-D projections), where the chunked MLP applies; full remat as in
# the paper configs.
CFG = preset("tiny", vocab_size=500, num_layers=2, cpu_layout=False, remat_policy="full")


def _batch() -> dict[str, jax.Array]:
    rng = np.random.RandomState(0)
    seg = np.array([[1] * 20 + [2] * 9 + [0] * 3, [1] * 32])
    pos = np.array([list(range(20)) + list(range(9)) + [0] * 3, list(range(32))])
    return {
        "input_ids": jnp.asarray(rng.randint(0, 500, (2, 32)), jnp.int32),
        "loss_mask": jnp.asarray(seg > 0, jnp.int32),
        "segment_ids": jnp.asarray(seg, jnp.int32),
        "positions": jnp.asarray(pos, jnp.int32),
    }


def _loss_and_grads(cfg, batch):
    model = create(cfg, seed=2)
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    fn = jax.jit(jax.value_and_grad(lambda p: loss_sums(graphdef, p, batch, 8, "fused"), has_aux=True))
    (total, count), grads = fn(params)
    return model(batch["input_ids"], batch["positions"], batch["segment_ids"]), total, count, grads


def test_chunked_mlp_matches_the_whole_sequence_mlp():
    batch = _batch()
    logits, total, count, grads = _loss_and_grads(CFG, batch)
    c_logits, c_total, c_count, c_grads = _loss_and_grads(dataclasses.replace(CFG, mlp_chunk_size=8), batch)
    np.testing.assert_allclose(np.asarray(c_logits), np.asarray(logits), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(c_total), float(total), rtol=1e-6)
    assert float(c_count) == float(count) > 0
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert all(float(jnp.abs(g).max()) > 0 for _, g in leaves)
    for (path, g), c in zip(leaves, jax.tree.leaves(c_grads), strict=True):
        g, c = np.asarray(g), np.asarray(c)
        np.testing.assert_allclose(c, g, rtol=1e-5, atol=1e-5 * np.abs(g).max(), err_msg=str(path))


def _rotate_half_reference(x, sin, cos):
    """The textbook form (HF's `x*cos + rotate_half(x)*sin`), differentiated by autodiff."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def test_rope_and_its_gradient_equal_the_rotate_half_form_exactly():
    cfg = preset("tiny")
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 1000], [7, 0, 1, 2, 3, 4, 5, 6]], jnp.int32)
    sin, cos = rope.sin_cos(cfg, positions)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(0), (2, 8, 3, cfg.head_dim)).astype(dtype)
        g = jax.random.normal(jax.random.key(1), x.shape).astype(dtype)
        out, vjp = jax.vjp(lambda x: rope.apply(x, sin, cos), x)
        ref, ref_vjp = jax.vjp(lambda x: _rotate_half_reference(x, sin, cos), x)
        assert out.dtype == dtype
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
        (dx,), (ref_dx,) = vjp(g), ref_vjp(g)
        np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(ref_dx, np.float32))
