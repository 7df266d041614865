"""The GRPO objective (train/objectives.py's PolicyGradient) run through the one train step, against
an oracle written here: transformers' PyTorch model on the same weights, each episode on its own,
full log-softmax, and the clipped-ratio + k3 formula by hand in float64.

- the step's loss and every metric it logs equal the oracle's on a toy batch of rollouts built
  to cover advantages of both signs, ratios below, inside and above the clip range on each sign,
  environment tokens between two turns, a padding row, and the KL term with a reference;
- the loss's gradient equals PyTorch's autograd of the oracle;
- environment, prompt and padding tokens carry nothing: garbage in their old log-probabilities and
  advantages changes neither the loss, nor a metric, nor a gradient;
- a 4-row batch on 2 devices in 2 micro batches takes the same step as on 1 device in one;
- config: train.objective=grpo validates, builds no SFT data, and holds a reference copy exactly
  when rl.kl_coef > 0 (a LoRA run never copies one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from hf_fixtures import load_hf, make_checkpoint

from agentrefine_jax import objective_table
from agentrefine_jax import sharding as shd
from agentrefine_jax.config import load_config
from agentrefine_jax.data.pipeline import DataError, build_data
from agentrefine_jax.hf.io import load_hf_model
from agentrefine_jax.models import lora
from agentrefine_jax.train import objectives, planner
from agentrefine_jax.train.param_mode import ParamMode
from agentrefine_jax.train.step import build_steps, objective_loss

GRPO = next(e for e in objective_table.TABLE if e.rollouts)
CLIP_LOW, CLIP_HIGH, KL = 0.2, 0.28, 0.05
SEQ = 24
# Episodes: (advantage, [(span length, sampled?)...]); the prompt, then model turns and the
# environment's answers. Row 3 is padding.
EPISODES = [
    (1.3, [(5, False), (6, True), (4, False), (5, True)]),
    (-0.8, [(4, False), (5, True), (3, False), (4, True)]),
    (-1.7, [(6, False), (7, True), (5, False), (6, True)]),
]
ROWS = len(EPISODES) + 1
# log(ratio) of the sampled tokens in turn: below 1 - clip_low (-0.223), inside, above 1 + clip_high
# (0.247); none within 0.05 of a boundary.
DELTAS = [-0.6, -0.1, 0.05, 0.5, -0.35, 0.9, 0.0, 0.15, -0.3, 0.35]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(torch policy, torch reference), (our policy params, our reference params), model config,
    our model's graphdef."""
    root = tmp_path_factory.mktemp("grpo")
    dirs = [make_checkpoint(root / name, seed=seed) for name, seed in (("policy", 0), ("ref", 7))]
    torch_models = [load_hf(d) for d in dirs]
    loaded = [load_hf_model(d, dtype="float32", param_dtype="float32") for d in dirs]
    params = [nnx.to_pure_dict(nnx.state(m, nnx.Param)) for _, m in loaded]
    return torch_models, params, loaded[0][0], nnx.graphdef(loaded[0][1])


def _torch_stats(model, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Per token t >= 1 of one episode run alone: log p(token t) (float64, differentiable) and the
    entropy of the distribution it was drawn from, from the full log-softmax."""
    logits = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0, :-1].double()
    ls = torch.log_softmax(logits, -1)
    logp = ls.gather(-1, torch.tensor(ids[1:], dtype=torch.long)[:, None])[:, 0]
    entropy = -(ls.exp() * ls).sum(-1)
    return logp, entropy.detach().numpy()


def _batch(models, seed: int = 0, garbage: bool = False) -> dict[str, np.ndarray]:
    """The rollouts' arrays (rl/batch.py's layout). old_logprobs = the policy's own log-probability
    (transformers') minus a chosen delta, so each ratio lands where DELTAS says. `garbage`: random
    old log-probabilities and advantages (and ids on the padding row) where nothing is trained."""
    (t_policy, _), _, cfg, _ = models
    rng = np.random.default_rng(seed)
    out = {
        "input_ids": np.zeros((ROWS, SEQ), np.int32),
        "positions": np.zeros((ROWS, SEQ), np.int32),
        "segment_ids": np.zeros((ROWS, SEQ), np.int32),
        "loss_mask": np.zeros((ROWS, SEQ), np.int32),
        "old_logprobs": np.zeros((ROWS, SEQ), np.float32),
        "advantages": np.zeros((ROWS, SEQ), np.float32),
    }
    k = 0
    for r, (adv, spans) in enumerate(EPISODES):
        mask = np.concatenate([np.full(n, s) for n, s in spans]).astype(np.int32)
        n = len(mask)
        ids = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        with torch.no_grad():
            logp = _torch_stats(t_policy, ids)[0].numpy()
        out["input_ids"][r, :n] = ids
        out["positions"][r, :n] = np.arange(n)
        out["segment_ids"][r, :n] = 1
        out["loss_mask"][r, :n] = mask
        for t in np.flatnonzero(mask):
            out["old_logprobs"][r, t] = logp[t - 1] - DELTAS[k % len(DELTAS)]
            out["advantages"][r, t] = adv
            k += 1
    if garbage:
        off = out["loss_mask"] == 0
        out["old_logprobs"][off] = rng.uniform(-9.0, 3.0, off.sum())
        out["advantages"][off] = rng.normal(0.0, 5.0, off.sum())
        out["input_ids"][-1] = rng.integers(0, cfg.vocab_size, SEQ)
    return out


def _oracle(models, batch: dict[str, np.ndarray], kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = -(1/N) sum min(r A, clip(r, 1 - lo, 1 + hi) A) + kl_coef (1/N) sum k3 over the N sampled
    tokens (differentiable in the torch policy) and the metrics the step logs, by hand."""
    (t_policy, t_ref), _, _, _ = models
    logp, old, adv, ent, ref = [], [], [], [], []
    for r in range(ROWS):
        n = int(batch["segment_ids"][r].sum())
        if n == 0:
            continue
        ids = batch["input_ids"][r, :n]
        sampled = np.flatnonzero(batch["loss_mask"][r, :n])  # token t >= 1: predicted at t - 1
        lp, h = _torch_stats(t_policy, ids)
        logp.append(lp[sampled - 1])
        ent.append(h[sampled - 1])
        old.append(batch["old_logprobs"][r, sampled])
        adv.append(batch["advantages"][r, sampled])
        with torch.no_grad():
            ref.append(_torch_stats(t_ref, ids)[0][sampled - 1])
    logp, ref = torch.cat(logp), torch.cat(ref)
    old_t = torch.tensor(np.concatenate(old), dtype=torch.float64)
    adv_t = torch.tensor(np.concatenate(adv), dtype=torch.float64)
    ratio = torch.exp(logp - old_t)
    surrogate = torch.minimum(ratio * adv_t, torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv_t)
    d = ref - logp
    k3 = torch.exp(d) - d - 1
    loss = -surrogate.mean() + (kl_coef * k3.mean() if kl_coef else 0.0)
    r_np, a_np = ratio.detach().numpy(), adv_t.numpy()
    low, high = (r_np < 1 - CLIP_LOW) & (a_np < 0), (r_np > 1 + CLIP_HIGH) & (a_np > 0)
    metrics = {
        "loss": float(loss.detach()),
        "loss_tokens": float(len(r_np)),
        "tokens": float(batch["segment_ids"].sum()),
        "clip_fraction": float(np.mean(low | high)),
        "kl": float(k3.detach().mean()) if kl_coef else 0.0,
        "entropy": float(np.concatenate(ent).mean()),
        "ratio_mean": float(r_np.mean()),
        "advantage_mean": float(a_np.mean()),
        "advantage_std": float(a_np.std()),
        "max_abs_logp_delta": float(np.abs((logp - old_t).detach().numpy()).max()),
    }
    # What the toy batch covers: without each case the comparison would prove less.
    outside = (r_np < 1 - CLIP_LOW) | (r_np > 1 + CLIP_HIGH)
    assert low.any() and high.any() and (outside & ~(low | high)).any() and (~outside).any()
    assert (a_np > 0).any() and (a_np < 0).any()
    return loss, metrics


_STEPS: dict[tuple, object] = {}


def _steps(cfg, kl_coef: float, n_dev: int = 1, micro: int | None = None, lr: float = 0.1):
    """The jitted GRPO steps, built (and compiled) once per setting for the module."""
    key = (kl_coef, n_dev, micro, lr)
    if key not in _STEPS:
        _STEPS[key] = _build(cfg, kl_coef, n_dev, micro, lr)
    return _STEPS[key]


def _build(cfg, kl_coef: float, n_dev: int, micro: int | None, lr: float):
    mesh = shd.make_mesh(1, n_dev, 1, devices=jax.devices()[:n_dev])
    knobs = {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH, "kl_coef": kl_coef}
    return build_steps(
        cfg, optax.sgd(lr), mesh, shd.DEFAULT_RULES, global_batch=ROWS, micro_batch=micro, loss_chunk=8,
        objective=GRPO.name, knobs=knobs,
    )  # fmt: skip


def _params(fns, models):
    _, (policy, ref), _, _ = models
    params = {"model": policy, "ref": ref} if "ref" in fns.abstract_params else policy
    return jax.device_put(jax.tree.map(jnp.copy, params), fns.param_shardings)  # the step donates them


def _run(fns, models, batch):
    params = _params(fns, models)
    new, _, m = fns.train(params, fns.init_opt(params), jax.device_put(batch, fns.batch_sharding))
    return jax.device_get(fns.trainable(new)), {k: float(v) for k, v in jax.device_get(m).items()}


@pytest.mark.parametrize("kl_coef", [0.0, KL], ids=["no_reference", "kl_to_reference"])
def test_step_loss_and_metrics_equal_the_oracle(models, kl_coef):
    cfg = models[2]
    fns = _steps(cfg, kl_coef)
    assert ("ref" in fns.abstract_params) == (kl_coef > 0)  # full fine-tuning copies it only for KL
    batch = _batch(models, seed=1)
    _, want = _oracle(models, batch, kl_coef)
    _, got = _run(fns, models, batch)
    assert set(got) == set(want) | {"grad_norm", "projected_tokens"}
    assert got["projected_tokens"] == want["loss_tokens"]  # only the sampled tokens are projected
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-5, atol=2e-6, err_msg=k)
    # Evaluation: (loss x sampled tokens, sampled tokens), the mean per token over batches.
    total, weight = jax.device_get(
        fns.evaluate(_params(fns, models), jax.device_put(batch, fns.batch_sharding))
    )
    np.testing.assert_allclose([total, weight], [want["loss"] * want["loss_tokens"], want["loss_tokens"]],
                               rtol=2e-5, atol=1e-6)  # fmt: skip


def _value_and_grad(graphdef, spec, settings):
    """The loss's value and gradient in the policy's params, as the step computes a micro batch
    (jitted once: the batch is an argument)."""
    loss = objectives.loss_of(spec)

    def f(policy, ref, jb):
        return objective_loss(graphdef, {"model": policy, "ref": ref}, jb, spec, loss.counts(jb), settings)[0]

    return jax.jit(jax.value_and_grad(f))


def test_gradients_equal_torch_autograd_and_skip_unsampled_tokens(models):
    """With the KL term: the gradient equals PyTorch's of the oracle; garbage in the old
    log-probabilities and advantages of every token that is not sampled (prompt, environment,
    padding row) changes neither the loss nor any gradient."""
    spec = dataclasses.replace(GRPO, reference=True, reference_knob="")
    settings = objectives.Settings(chunk=8, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=KL)
    (t_policy, _), (policy, ref), _, graphdef = models
    grad_fn = _value_and_grad(graphdef, spec, settings)
    batch = _batch(models, seed=2)
    value, grads = grad_fn(policy, ref, batch)
    t_policy.zero_grad()
    want, _ = _oracle(models, batch, KL)
    want.backward()
    np.testing.assert_allclose(float(value), float(want.detach()), rtol=2e-5)
    for got, w in (
        (grads["final_norm"], t_policy.model.norm.weight.grad),
        (grads["embed"], t_policy.model.embed_tokens.weight.grad),
    ):
        w = w.numpy()
        got = np.asarray(got).reshape(w.shape) if np.asarray(got).shape == w.shape else np.asarray(got).T
        assert np.abs(w).max() > 0
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))

    noisy = _batch(models, seed=2, garbage=True)
    assert not np.array_equal(noisy["advantages"], batch["advantages"])
    value2, grads2 = grad_fn(policy, ref, noisy)
    assert float(value2) == float(value)
    jax.tree.map(np.testing.assert_array_equal, grads2, grads)

    # A sampled token far below its trainer log-probability (a stale or broken rollout: log ratio
    # ~ +80, exp overflows float32) with a negative advantage: the ratio is clamped at e^20, the
    # loss and every gradient stay finite.
    stale = {k: v.copy() for k, v in batch.items()}
    r, t = np.argwhere((stale["loss_mask"] > 0) & (stale["advantages"] < 0))[0]
    stale["old_logprobs"][r, t] -= 80.0
    value3, grads3 = grad_fn(policy, ref, stale)
    n = float(batch["loss_mask"].sum())
    assert np.isfinite(float(value3)) and float(value3) > float(value) + 1e6 / n
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads3))


def test_unsampled_tokens_change_no_metric(models):
    fns = _steps(models[2], KL)
    _, clean = _run(fns, models, _batch(models, seed=3))
    _, noisy = _run(fns, models, _batch(models, seed=3, garbage=True))
    assert noisy == clean


def test_two_devices_two_micro_batches_equal_one_device(models):
    """Each micro batch adds its share of the global token mean; the maximum |delta| and the
    advantage statistics are the global batch's."""
    batch = _batch(models, seed=4)
    (p2, m2), (p1, m1) = (
        _run(_steps(models[2], KL, n, micro), models, batch) for n, micro in ((2, 2), (1, None))
    )
    assert m1["clip_fraction"] > 0 and m1["kl"] > 0
    assert set(m2) == set(m1)
    for k in m1:
        np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p2, p1)


def test_lora_reference_is_the_base_with_adapters_off(models):
    """A LoRA run holds no copy; its KL term's reference is the base with the adapters off: the
    step's kl is the mean k3 between our policy (adapters on) and transformers on the base."""
    (t_base, _), (base, _), cfg, graphdef = models
    spec = lora.LoraSpec(("q", "v", "down"), rank=4, alpha=8.0)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    knobs = {"clip_low": CLIP_LOW, "clip_high": CLIP_HIGH, "kl_coef": KL}
    fns = build_steps(  # adam: LoRA's dropout keys come from the optimizer's update count
        cfg, optax.adam(1e-3), mesh, shd.DEFAULT_RULES, global_batch=ROWS, micro_batch=None, loss_chunk=8,
        lora_spec=spec, objective=GRPO.name, knobs=knobs,
    )  # fmt: skip
    assert set(fns.abstract_params) == {"base", "lora"}  # no "ref": nothing copied
    # Non-zero B, so the policy differs from the base (fresh adapters would make them equal).
    adapters = jax.tree.map(
        lambda a: 0.05 * jax.random.normal(jax.random.key(3), a.shape, a.dtype),
        lora.init(spec, cfg, jax.random.key(2)),
    )
    batch = _batch(models, seed=5)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}

    @jax.jit
    def policy_logps(base, adapters, jb):
        model = nnx.merge(graphdef, base)
        hidden, _ = model.forward(
            jb["input_ids"], jb["positions"], jb["segment_ids"], adapters=(spec, adapters, None)
        )
        return objectives.token_logps(hidden[:, :-1], model.lm_head_weight(), jb["input_ids"][:, 1:], 8)

    logp = np.asarray(policy_logps(base, adapters, jb))
    k3 = []
    for r in range(len(EPISODES)):
        n = int(batch["segment_ids"][r].sum())
        sampled = np.flatnonzero(batch["loss_mask"][r, :n])
        with torch.no_grad():
            ref = _torch_stats(t_base, batch["input_ids"][r, :n])[0].numpy()[sampled - 1]
        d = ref - logp[r, sampled - 1].astype(np.float64)
        k3.append(np.exp(d) - d - 1)
    want = float(np.concatenate(k3).mean())
    assert want > 1e-4  # the adapters are on in the policy
    params = jax.device_put({"base": jax.tree.map(jnp.copy, base), "lora": adapters}, fns.param_shardings)
    _, _, m = fns.train(params, fns.init_opt(params), jax.device_put(batch, fns.batch_sharding))
    np.testing.assert_allclose(float(m["kl"]), want, rtol=1e-4, atol=1e-7)


def test_config_validates_and_the_reference_follows_kl_coef():
    on = [f"train.objective={GRPO.name}", "rl.kl_coef=0.05"]
    off = [f"train.objective={GRPO.name}", "rl.kl_coef=0"]
    cfg_on, cfg_off = load_config("tiny", on), load_config("tiny", off)
    assert cfg_on.train.objective == GRPO.name and cfg_on.rl.kl_coef == 0.05
    assert ParamMode.of(cfg_on).reference and not ParamMode.of(cfg_off).reference
    # The planner counts what the mode holds: a reference copy only with the KL term.
    mesh = planner.abstract_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    assert planner.param_bytes(cfg_on, mesh, cfg_on.mesh.rules).reference
    assert not planner.param_bytes(cfg_off, mesh, cfg_off.mesh.rules).reference
    # A LoRA run's reference is its base, adapters off: never a copy.
    assert not ParamMode.of(load_config("tiny", [*on, "train.lora.rank=2"])).reference
    # Rollouts are its batches: the data pipeline builds none, with one line saying why.
    with pytest.raises(DataError, match="trains on rollouts"):
        build_data(cfg_on.data, "train", objective=GRPO.name)


@pytest.mark.parametrize("kl_coef", [0.0, KL], ids=["no_reference", "kl_to_reference"])
def test_the_trainers_step_lowers_for_rollout_batches(kl_coef):
    """The step the trainer builds from a config (train/loop.py's build_train_step; train/aot.py
    compiles the same one for a TPU slice) takes rl/batch.py's arrays and lowers; lowered, not run."""
    from agentrefine_jax.rl.batch import ARRAY_KEYS
    from agentrefine_jax.train.loop import build_train_step

    cfg = load_config("tiny", [f"train.objective={GRPO.name}", f"rl.kl_coef={kl_coef}", "model.num_layers=1"])
    fns, _ = build_train_step(cfg, shd.make_mesh(1, 1, 1, devices=jax.devices()[:1]), total_steps=10)
    assert set(fns.batch_dtypes) == set(ARRAY_KEYS) and ("ref" in fns.abstract_params) == (kl_coef > 0)
    shape = (cfg.train.global_batch_size, 32)
    batch = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=fns.batch_sharding)
        for k, dtype in fns.batch_dtypes.items()
    }
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        fns.abstract_params,
        fns.param_shardings,
    )
    opt = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), fns.abstract_opt, fns.opt_shardings
    )
    metrics = fns.train.lower(params, opt, batch).out_info[2]
    assert set(metrics) == {"loss", "loss_tokens", "tokens", "projected_tokens", "grad_norm", *GRPO.metrics}
