"""The fused cross-entropy (custom VJP) against the rematerialised chunked loss it replaces.

Both are exact; the remat path is itself checked against a float64 full-logit reference in
test_train_step.py. Here: same loss and same gradients, to float32 tolerance, through the
real model (padding, packing, loss masks, tied embeddings), the jitted train step with
gradient accumulation, and a sharded 8-device mesh.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrefine_jax import sharding as shd
from agentrefine_jax.config import MeshConfig, OptimConfig, load_config
from agentrefine_jax.models import create, preset
from agentrefine_jax.train.loss import chunked_cross_entropy, resolve_loss_impl
from agentrefine_jax.train.optimizer import make_optimizer
from agentrefine_jax.train.step import build_steps, loss_sums

VOCAB = 1000
CFG = preset("tiny", vocab_size=VOCAB)


def _batch(b: int = 8, s: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """Two packed documents and trailing padding per row; a random loss mask inside documents."""
    rng = np.random.RandomState(seed)
    cut = 20 + seed % 13
    seg = np.array([[1] * cut + [2] * (56 - cut) + [0] * 8])
    pos = np.array([list(range(cut)) + list(range(56 - cut)) + [0] * 8])
    return {
        "input_ids": rng.randint(0, VOCAB, (b, s)).astype(np.int32),
        "loss_mask": ((rng.rand(b, s) > 0.3) & (seg > 0)).astype(np.int32),
        "segment_ids": np.repeat(seg, b, 0).astype(np.int32),
        "positions": np.repeat(pos, b, 0).astype(np.int32),
    }


def _assert_trees_close(a, b, rtol=2e-5):
    """Elementwise at float32 tolerance, relative to each array's scale (sums of many terms cancel)."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        atol = rtol * float(np.abs(y).max())
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# Ragged (padded) and larger-than-sequence chunking; untied and tied output projection.
@pytest.mark.parametrize(("chunk", "tie"), [(7, False), (1024, True)])
def test_fused_loss_and_gradients_equal_remat(tie, chunk):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    model = create(cfg, seed=3)
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    out = {}
    for impl in ("remat", "fused"):
        fn = jax.jit(
            jax.value_and_grad(lambda p, b, impl=impl: loss_sums(graphdef, p, b, chunk, impl), has_aux=True)
        )
        out[impl] = fn(params, batch)
    (l_r, n_r), g_r = out["remat"]
    (l_f, n_f), g_f = out["fused"]
    assert float(n_r) == float(n_f) > 0
    np.testing.assert_allclose(float(l_f), float(l_r), rtol=1e-6)
    _assert_trees_close(g_f, g_r)
    assert float(jnp.abs(g_f["embed"]).sum()) > 0  # gradient reaches the embedding (tied or looked up)


def test_fused_gradient_scales_with_the_cotangent_and_ignores_zero_weight_positions():
    rng = np.random.RandomState(0)
    h = jnp.asarray(rng.randn(2, 9, 16), jnp.float32)
    w = jnp.asarray(rng.randn(16, 50) * 0.1, jnp.float32)
    tgt = jnp.asarray(rng.randint(0, 50, (2, 9)))
    wt = jnp.asarray(rng.rand(2, 9) > 0.5, jnp.float32)

    def f(h, w, impl):
        return 3.5 * chunked_cross_entropy(h, w, tgt, wt, 4, impl)[0]

    g_r = jax.grad(f, argnums=(0, 1))(h, w, "remat")
    g_f = jax.grad(f, argnums=(0, 1))(h, w, "fused")
    _assert_trees_close(g_f, g_r)
    dead = np.asarray(wt) == 0
    assert np.all(np.asarray(g_f[0])[dead] == 0.0)


def _train(impl, mesh_kwargs, devices, micro, steps=3, tie=False):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    mesh = shd.make_mesh(**mesh_kwargs, devices=devices)
    fns = build_steps(
        cfg, opt, mesh, MeshConfig().rules, global_batch=8, micro_batch=micro, loss_chunk=16, loss_impl=impl
    )
    params = fns.init_params(0)
    opt_state = fns.init_opt(params)
    metrics = []
    for i in range(steps):
        batch = {k: jax.device_put(v, fns.batch_sharding) for k, v in _batch(seed=i).items()}
        params, opt_state, m = fns.train(params, opt_state, batch)
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return metrics, params


def _assert_params_close(a, b, lr=1e-2):
    # Adam divides by each gradient's own scale, so float32 noise in a near-zero gradient can move a
    # single weight by a visible fraction of a step (seen: up to 7% after three steps); a wrong
    # gradient moves many weights by whole steps. Exactness itself is asserted on the per-step
    # losses and gradient norms, which are scale-sensitive (Adam is not).
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        diff = np.abs(np.asarray(x) - np.asarray(y))
        assert diff.max() < 0.5 * lr, jax.tree_util.keystr(path)
        assert np.mean(diff > 0.01 * lr) < 1e-3, jax.tree_util.keystr(path)


def test_fused_with_accumulation_equals_remat_on_one_batch():
    one = jax.devices()[:1]
    m_r, p_r = _train("remat", dict(data=1, fsdp=1, tensor=1), one, micro=None)
    m_f, p_f = _train("fused", dict(data=1, fsdp=1, tensor=1), one, micro=2)
    np.testing.assert_allclose(m_f, m_r, rtol=2e-5)
    _assert_params_close(p_f, p_r)


def test_fused_loss_on_sharded_8_device_mesh_equals_remat_on_one_device():
    assert len(jax.devices()) == 8, "conftest must simulate 8 CPU devices"
    m_r, p_r = _train("remat", dict(data=1, fsdp=1, tensor=1), jax.devices()[:1], micro=None, tie=True)
    m_f, p_f = _train("fused", dict(data=2, fsdp=2, tensor=2), jax.devices(), micro=2, tie=True)
    np.testing.assert_allclose(m_f, m_r, rtol=2e-5)
    _assert_params_close(p_f, p_r)
    assert p_f["embed"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


def test_loss_impl_is_validated_and_auto_resolves_per_platform():
    assert resolve_loss_impl("auto", "cpu") == "fused"
    assert resolve_loss_impl("remat", "cpu") == "remat"
    with pytest.raises(ValueError, match="loss_impl"):
        resolve_loss_impl("fast")
    with pytest.raises(ValueError, match="must be one of"):
        load_config("tiny", ["train.loss_impl=fast"])
    assert load_config("tiny", ["train.loss_impl=remat"]).train.loss_impl == "remat"
