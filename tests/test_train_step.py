"""Refinement loss and the sharded train step against independent references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from agentrefine_jax import sharding as shd
from agentrefine_jax.config import MeshConfig, OptimConfig
from agentrefine_jax.models import create, preset
from agentrefine_jax.train.loss import chunked_cross_entropy, target_weights
from agentrefine_jax.train.optimizer import learning_rate_schedule, make_optimizer
from agentrefine_jax.train.step import build_steps

VOCAB = 1000
CFG = preset("tiny", vocab_size=VOCAB)


def _batch(b: int = 8, s: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    seg = np.array([[1] * 30 + [2] * 26 + [0] * 8])
    pos = np.array([list(range(30)) + list(range(26)) + [0] * 8])
    return {
        "input_ids": rng.randint(0, VOCAB, (b, s)).astype(np.int32),
        "loss_mask": ((rng.rand(b, s) > 0.3) & (seg > 0)).astype(np.int32),
        "segment_ids": np.repeat(seg, b, 0).astype(np.int32),
        "positions": np.repeat(pos, b, 0).astype(np.int32),
    }


def _reference_loss(model, batch) -> tuple[float, float]:
    """Full-logit log-softmax in numpy float64: the textbook masked next-token NLL."""
    logits = np.asarray(model(batch["input_ids"], batch["positions"], batch["segment_ids"]), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    total, count = 0.0, 0.0
    ids, mask, seg = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            # Target t is predicted at t-1 only inside one document, never at a boundary or padding.
            if mask[b, t] and seg[b, t] > 0 and seg[b, t] == seg[b, t - 1]:
                total -= logp[b, t - 1, ids[b, t]]
                count += 1
    return total, count


def test_chunked_loss_matches_full_logits_reference():
    model = create(CFG, seed=1)
    batch = _batch()
    hidden, _ = model.forward(batch["input_ids"], batch["positions"], batch["segment_ids"])
    targets, weights = target_weights({k: jnp.asarray(v) for k, v in batch.items()})
    want_sum, want_count = _reference_loss(model, batch)
    for chunk in (7, 16, 63, 1024):  # ragged, even, and larger-than-sequence chunking
        got_sum, got_count = chunked_cross_entropy(
            hidden[:, :-1], model.lm_head_weight(), targets, weights, chunk
        )
        assert float(got_count) == want_count
        np.testing.assert_allclose(float(got_sum), want_sum, rtol=2e-5)


def test_first_token_of_each_packed_document_is_never_a_target():
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    batch["loss_mask"] = jnp.ones_like(batch["loss_mask"])
    _, weights = target_weights(batch)
    # Position 29 would predict document 2's first token (index 30); padding is never a target.
    assert float(weights[0, 29]) == 0.0
    assert float(weights[0, 28]) == 1.0
    assert float(weights[:, 55:].sum()) == 0.0


def _run(mesh_kwargs, devices, micro, steps=3, vary_batch=True):
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    mesh = shd.make_mesh(**mesh_kwargs, devices=devices)
    fns = build_steps(CFG, opt, mesh, MeshConfig().rules, global_batch=8, micro_batch=micro, loss_chunk=16)
    params = fns.init_params(0)
    opt_state = fns.init_opt(params)
    losses = []
    for i in range(steps):
        batch = {
            k: jax.device_put(v, fns.batch_sharding) for k, v in _batch(seed=i if vary_batch else 0).items()
        }
        params, opt_state, m = fns.train(params, opt_state, batch)
        losses.append(float(m["loss"]))
    return losses, params


def test_sharded_8_devices_equals_single_device():
    assert len(jax.devices()) == 8, "conftest must simulate 8 CPU devices"
    one, _ = _run(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1], micro=None, vary_batch=False)
    eight, p8 = _run(dict(data=1, fsdp=4, tensor=2), jax.devices(), micro=None, vary_batch=False)
    np.testing.assert_allclose(one, eight, rtol=1e-5)
    assert p8["layers"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert one[-1] < one[0]  # the same batch, three updates: it must be learning


def test_gradient_accumulation_sums_tokens_not_means():
    # Micro-batches carry different numbers of loss tokens; token-sum accumulation makes
    # the result identical to one big batch, a mean of means would not be.
    full, _ = _run(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1], micro=None, steps=2)
    accum, _ = _run(dict(data=1, fsdp=1, tensor=1), jax.devices()[:1], micro=2, steps=2)
    np.testing.assert_allclose(full, accum, rtol=1e-5)


def test_batch_without_loss_tokens_does_not_update_params():
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = build_steps(CFG, opt, mesh, MeshConfig().rules, global_batch=8, micro_batch=None, loss_chunk=16)
    params = fns.init_params(0)
    before = jax.tree.map(np.asarray, params)
    batch = _batch()
    batch["loss_mask"][:] = 0
    params, _, m = fns.train(params, fns.init_opt(params), {k: jnp.asarray(v) for k, v in batch.items()})
    assert float(m["loss_tokens"]) == 0.0
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))


def test_step_updates_the_donated_state_without_copying_it():
    """The step writes the new params and AdamW moments into the donated buffers. Its guard against a
    bad batch, as a select per leaf, read each old moment beside the in-place update, and XLA:CPU then
    copied every moment first (1.1 GB per SmolLM2-135M step, docs/scale.md "CPU memory of a real
    model"); the compiled step must hold no copy of a parameter or moment array."""
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = build_steps(CFG, opt, mesh, MeshConfig().rules, global_batch=8, micro_batch=None, loss_chunk=16)
    params = fns.init_params(0)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    hlo = fns.train.lower(params, fns.init_opt(params), batch).compile().as_text()
    state_copies = [
        line.strip()[:120]
        for line in hlo.splitlines()
        if " copy(%" in line and ("copy(%opt_state" in line or "copy(%params" in line) and " f32[" in line
    ]
    assert not state_copies, state_copies


def test_cosine_schedule_without_warmup_is_the_paper_schedule():
    sched = learning_rate_schedule(OptimConfig(learning_rate=5e-6, warmup_steps=0), 100)
    for step in (0, 25, 50, 99):
        want = 5e-6 * 0.5 * (1 + np.cos(np.pi * step / 100))
        assert float(sched(step)) == pytest.approx(want, rel=1e-5)


def test_optimizer_is_adamw_with_paper_defaults():
    cfg = OptimConfig()
    assert (cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, cfg.grad_clip_norm) == (0.9, 0.999, 1e-8, 0.0, 1.0)
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-3, schedule="constant", grad_clip_norm=0), 10)
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([0.5, 0.25])}
    ours, _ = opt.update(grads, opt.init(params), params)
    ref_opt = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    ref, _ = ref_opt.update(grads, ref_opt.init(params), params)
    np.testing.assert_allclose(ours["w"], ref["w"])


def test_param_state_roundtrip_through_pure_dict():
    model = create(CFG)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    graphdef = nnx.graphdef(model)
    again = nnx.merge(graphdef, pure)
    ids = jnp.arange(10)[None]
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(again(ids)))
