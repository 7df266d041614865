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
from agentrefine_jax.train import objectives
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


def _poisoned_problem(b: int = 4, t: int = 40, chunk: int = 8):
    """Each row holds exactly one chunk's worth of loss-bearing positions, scattered (the last
    position among them, the first not: without compaction they touch every chunk); every other
    position's hidden state is NaN. A chunk that projected a loss-free position would turn the sum
    NaN (NaN x weight 0 is NaN), so a finite, exact result says no such chunk ran."""
    rng = np.random.RandomState(5)
    wt = np.zeros((b, t), np.float32)
    for row in range(b):
        wt[row, 1 + rng.choice(t - 2, chunk - 1, replace=False)] = 1.0
        wt[row, t - 1] = 1.0
    h = rng.randn(b, t, 16).astype(np.float32)
    clean = h.copy()
    h[wt == 0] = np.nan
    w = (rng.randn(16, 50) * 0.1).astype(np.float32)
    tgt = rng.randint(0, 50, (b, t))
    return h, clean, w, tgt, wt


@pytest.mark.parametrize("impl", ["fused", "remat"])
def test_loss_free_positions_never_reach_the_vocabulary_projection(impl):
    h, clean, w, tgt, wt = _poisoned_problem()
    # float64 reference over the loss-bearing positions only, from the clean states.
    logits = clean.astype(np.float64) @ w.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = float(((lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]) * wt).sum())

    def f(h, w):
        return chunked_cross_entropy(h, w, jnp.asarray(tgt), jnp.asarray(wt), 8, impl)[0]

    got, (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(float(got), want, rtol=2e-6)
    assert np.all(np.asarray(dh)[wt == 0] == 0.0) and np.isfinite(np.asarray(dw)).all()
    _, (dh_clean, dw_clean) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(clean), jnp.asarray(w))
    _assert_trees_close((np.asarray(dh)[wt > 0], dw), (np.asarray(dh_clean)[wt > 0], dw_clean))


def test_each_batch_shard_compacts_its_own_rows_on_an_8_device_mesh():
    """One row per shard: each row's loss positions move to its front and the result is the
    one-device one; the batch axis stays split (no position crosses a shard)."""
    h, clean, w, tgt, wt = _poisoned_problem(b=8)

    def f(h, w):
        return chunked_cross_entropy(h, w, jnp.asarray(tgt), jnp.asarray(wt), 8, "fused")[0]

    want, (_, dw_one) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(clean), jnp.asarray(w))
    mesh = shd.make_mesh(data=2, fsdp=4, tensor=1, devices=jax.devices())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    with shd.use_sharding(mesh, MeshConfig().rules):
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        got, (dh, dw) = grad(jax.device_put(h, rows), jnp.asarray(w))
    np.testing.assert_allclose(float(got), float(want), rtol=2e-6)
    assert np.all(np.asarray(dh)[wt == 0] == 0.0)
    _assert_trees_close(dw, dw_one)
    assert dh.sharding.spec[0] == ("data", "fsdp")


@pytest.mark.parametrize("entropy", [False, True])
def test_token_logps_project_only_the_needed_positions(entropy):
    """A pair loss's or a rollout's log-probabilities: exact where needed, 0 elsewhere, and the
    NaN states at the other positions never reach a projected chunk (value or gradient)."""
    h, clean, w, tgt, needed = _poisoned_problem()
    logits = clean.astype(np.float64) @ w.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = np.where(needed > 0, np.take_along_axis(logits, tgt[..., None], -1)[..., 0] - lse, 0.0)
    fn = objectives.token_logps_entropy if entropy else objectives.token_logps

    def f(h, w):
        out = fn(h, w, jnp.asarray(tgt), 8, jnp.asarray(needed > 0))
        logp = out[0] if entropy else out
        return jnp.sum(logp * jnp.asarray(needed)), out

    (_, out), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        jnp.asarray(h), jnp.asarray(w)
    )
    logp = out[0] if entropy else out
    np.testing.assert_allclose(np.asarray(logp), want, rtol=2e-5, atol=1e-6)
    if entropy:
        p = np.exp(logits - lse[..., None])
        want_h = np.where(needed > 0, lse - (p * logits).sum(-1), 0.0)
        np.testing.assert_allclose(np.asarray(out[1]), want_h, rtol=2e-5, atol=1e-6)
    assert np.all(np.asarray(dh)[needed == 0] == 0.0) and np.isfinite(np.asarray(dw)).all()
