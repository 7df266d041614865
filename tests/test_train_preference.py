"""Preference objectives against independent oracles.

- per-sequence log-probabilities of a packed pair row equal transformers' on the same weights,
  each sequence run on its own;
- DPO / ORPO / SFT+DPO loss, rewards and gradients equal a PyTorch implementation of TRL's
  documented formulas written here, from transformers' log-probabilities;
- the jitted step with 2 micro batches equals the step with one (the global-batch pair mean);
- the trainer CLI: sft+dpo runs, resumes after SIGKILL bit-exact and exports; dpo on data
  without pairs exits 2 with one line.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from hf_fixtures import load_hf, make_checkpoint
from test_faults_kill import _state
from test_train_loop import _finish, _losses, _train

import agentrefine_jax
from agentrefine_jax import sharding as shd
from agentrefine_jax.data.preference import CHOSEN, REJECTED
from agentrefine_jax.hf.io import load_hf_model
from agentrefine_jax.models import lora
from agentrefine_jax.train import objectives
from agentrefine_jax.train.step import build_steps, preference_loss

BETA = 0.3
# Row layout: (segment kind, length, reply tokens at the end); kind 1 = an SFT example.
ROWS = [
    [(CHOSEN, 9, 4), (REJECTED, 11, 5), (1, 7, 3)],
    [(1, 6, 2), (CHOSEN, 8, 3), (REJECTED, 8, 2)],
]
SEQ = 32


def _batch(vocab: int, seed: int = 0) -> tuple[dict[str, np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    out = {
        k: np.zeros((len(ROWS), SEQ), np.int32)
        for k in ("input_ids", "loss_mask", "segment_ids", "positions")
    }
    seqs = []
    for r, row in enumerate(ROWS):
        pos, row_seqs = 0, []
        for seg, (kind, n, reply) in enumerate(row, start=1):
            ids = rng.integers(0, vocab, n).astype(np.int32)
            out["input_ids"][r, pos : pos + n] = ids
            out["loss_mask"][r, pos + n - reply : pos + n] = kind
            out["segment_ids"][r, pos : pos + n] = seg
            out["positions"][r, pos : pos + n] = np.arange(n)
            row_seqs.append(ids)
            pos += n
        seqs.append(row_seqs)
    return out, seqs


def _torch_logps(model, ids: np.ndarray, reply: int) -> torch.Tensor:
    """Sum of log p of the last `reply` tokens, transformers on the sequence alone."""
    logits = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:], dtype=torch.long)[:, None])[:, 0]
    return lp[-reply:].sum(), lp[-reply:].mean(), -lp[-reply:].sum()


def _torch_reference(policy, ref, seqs, objective):
    """TRL's formulas (sigmoid DPO; ORPO with mean log-probs) with the global-batch pair mean."""
    losses, rc, rr, sft_sum, sft_n = [], [], [], 0.0, 0
    for r, row in enumerate(ROWS):
        for j, (kind, _, reply) in enumerate(row):
            ids = seqs[r][j]
            if kind == 1:
                sft_sum = sft_sum + _torch_logps(policy, ids, reply)[2]
                sft_n += reply
            if kind != CHOSEN:
                continue
            _, _, rej_reply = row[j + 1]
            (pc, mc, _), (pr, mr, _) = (
                _torch_logps(policy, ids, reply),
                _torch_logps(policy, seqs[r][j + 1], rej_reply),
            )
            if objective == "orpo":
                log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
                losses.append(-mc - BETA * F.logsigmoid(log_odds))
                rc.append(BETA * mc.detach())
                rr.append(BETA * mr.detach())
                continue
            with torch.no_grad():
                qc, qr = _torch_logps(ref, ids, reply)[0], _torch_logps(ref, seqs[r][j + 1], rej_reply)[0]
            losses.append(-F.logsigmoid(BETA * ((pc - pr) - (qc - qr))))
            rc.append(BETA * (pc - qc).detach())
            rr.append(BETA * (pr - qr).detach())
    loss = torch.stack(losses).mean()
    if objective == "sft+dpo":
        loss = 0.5 * sft_sum / sft_n + 2.0 * loss
    return loss, torch.stack(rc), torch.stack(rr)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    dirs = [make_checkpoint(root / name, seed=seed) for name, seed in (("policy", 0), ("ref", 7))]
    torch_models = [load_hf(d) for d in dirs]
    loaded = [load_hf_model(d, dtype="float32", param_dtype="float32") for d in dirs]
    return torch_models, [m for _, m in loaded], loaded[0][0]


def test_sequence_logps_equal_transformers(models):
    (policy, _), (ours, _), cfg = models
    batch, seqs = _batch(cfg.vocab_size)
    hidden, _ = ours.forward(
        jnp.asarray(batch["input_ids"]), jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"])
    )
    logp = objectives.token_logps(
        hidden[:, :-1], ours.lm_head_weight(), jnp.asarray(batch["input_ids"][:, 1:]), 5
    )
    got = objectives.pair_logps(logp, {k: jnp.asarray(v) for k, v in batch.items()})
    for r, row in enumerate(ROWS):
        j = next(j for j, (kind, _, _) in enumerate(row) if kind == CHOSEN)
        with torch.no_grad():
            want_c = float(_torch_logps(policy, seqs[r][j], row[j][2])[0])
            want_r = float(_torch_logps(policy, seqs[r][j + 1], row[j + 1][2])[0])
        seg = j + 1  # a pair's slot is its chosen reply's segment id
        np.testing.assert_allclose(float(got["chosen"][r, seg]), want_c, rtol=2e-5)
        np.testing.assert_allclose(float(got["rejected"][r, seg]), want_r, rtol=2e-5)
        assert int(got["valid"][r, seg]) == 1
    assert float(got["valid"].sum()) == len(ROWS)


@pytest.mark.parametrize("objective", ["dpo", "orpo", "sft+dpo"])
def test_loss_rewards_and_gradients_equal_a_torch_reference(models, objective):
    (t_policy, t_ref), (policy, ref), _ = models
    graphdef = nnx.graphdef(policy)
    p_policy = nnx.to_pure_dict(nnx.state(policy, nnx.Param))
    p_ref = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
    batch, seqs = _batch(512, seed=1)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    counts = (objectives.count_sft_tokens(jb), objectives.count_pairs(jb))
    assert float(counts[1]) == 2 and float(counts[0]) == 5

    def loss_fn(p):
        return preference_loss(graphdef, {"model": p, "ref": p_ref}, jb, 5, objective, counts, BETA, 0.5, 2.0)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(p_policy)
    metrics = objectives.finish_metrics(aux, counts[1], counts[0])

    t_policy.zero_grad()
    want, rc, rr = _torch_reference(t_policy, t_ref, seqs, objective)
    want.backward()
    np.testing.assert_allclose(float(loss), float(want.detach()), rtol=2e-5)
    np.testing.assert_allclose(float(metrics["rewards_chosen"]), float(rc.mean()), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["rewards_rejected"]), float(rr.mean()), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["margin"]), float((rc - rr).mean()), rtol=2e-5, atol=1e-6)
    assert float(metrics["accuracy"]) == float((rc > rr).float().mean())
    pairs = [
        (grads["final_norm"], t_policy.model.norm.weight.grad),
        (grads["embed"], t_policy.model.embed_tokens.weight.grad),
    ]
    for got, want_g in pairs:
        want_g = want_g.numpy()
        got = (
            np.asarray(got).reshape(want_g.shape)
            if np.asarray(got).shape == want_g.shape
            else np.asarray(got).T
        )
        np.testing.assert_allclose(got, want_g, rtol=1e-4, atol=1e-4 * float(np.abs(want_g).max()))


def test_two_devices_two_micro_batches_equal_one_device(models):
    """A 4-row global batch on 2 devices in 2 micro batches takes the same step as on 1 device in
    one: each micro batch adds its share of the global-batch pair mean (no mean of means)."""
    cfg = models[2]
    parts = [_batch(512, seed=s)[0] for s in (2, 3)]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out = []
    for n_dev, micro in ((2, 2), (1, None)):
        mesh = shd.make_mesh(1, n_dev, 1, devices=jax.devices()[:n_dev])
        fns = build_steps(
            cfg, optax.sgd(0.1), mesh, shd.DEFAULT_RULES, global_batch=4, micro_batch=micro,
            loss_chunk=8, objective="dpo", knobs={"beta": BETA},
        )  # fmt: skip
        params = fns.init_params(0)
        params = {"model": params["model"], "ref": fns.built.init_model(1)}  # a reference unlike the start
        opt = fns.init_opt(params)
        jb = {k: jax.device_put(v, fns.batch_sharding) for k, v in batch.items()}
        new, _, m = fns.train(params, opt, jb)
        out.append((jax.device_get(fns.trainable(new)), jax.device_get(m)))
    (p2, m2), (p1, m1) = out
    assert float(m1["pairs"]) == 4 and float(m1["margin"]) != 0
    for k in ("loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy", "pairs", "grad_norm"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p2, p1)


@pytest.mark.parametrize("objective", ["dpo", "sft+dpo"])
def test_lora_reference_is_the_base_with_adapters_off(models, objective):
    """A LoRA run holds no reference copy (params are the base and the adapters), and the trainer's
    DPO rewards use, as the reference, the base's log-probabilities with the adapters off: here
    transformers' on the base weights, each sequence on its own."""
    (t_base, _), (base, _), cfg = models
    spec = lora.LoraSpec(("q", "v", "down"), rank=4, alpha=8.0)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = build_steps(
        cfg, optax.adam(1e-3), mesh, shd.DEFAULT_RULES, global_batch=2, micro_batch=None,
        loss_chunk=8, lora_spec=spec, objective=objective, knobs={"beta": BETA},
    )  # fmt: skip
    assert set(fns.init_params(0)) == {"base", "lora"}  # no "ref": nothing copied
    # Non-zero B, so the policy differs from the base (fresh adapters would make them equal).
    adapters = jax.tree.map(
        lambda a: 0.05 * jax.random.normal(jax.random.key(3), a.shape, a.dtype),
        lora.init(spec, cfg, jax.random.key(2)),
    )
    params = {"base": nnx.to_pure_dict(nnx.state(base, nnx.Param)), "lora": adapters}
    batch, seqs = _batch(cfg.vocab_size, seed=4)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    on = (spec, adapters, None)
    hidden, _ = base.forward(jb["input_ids"], jb["positions"], jb["segment_ids"], adapters=on)
    logp = objectives.token_logps(hidden[:, :-1], base.lm_head_weight(), jb["input_ids"][:, 1:], 8)
    pi = objectives.pair_logps(logp, jb)
    reward_c, reward_r = [], []
    for r, row in enumerate(ROWS):
        j = next(j for j, (kind, _, _) in enumerate(row) if kind == CHOSEN)
        with torch.no_grad():
            ref_c = float(_torch_logps(t_base, seqs[r][j], row[j][2])[0])
            ref_r = float(_torch_logps(t_base, seqs[r][j + 1], row[j + 1][2])[0])
        pi_c, pi_r = float(pi["chosen"][r, j + 1]), float(pi["rejected"][r, j + 1])
        assert abs(pi_c - ref_c) > 1e-3  # the adapters are on in the policy
        reward_c.append(BETA * (pi_c - ref_c))
        reward_r.append(BETA * (pi_r - ref_r))
    params = jax.device_put(jax.tree.map(jnp.copy, params), fns.param_shardings)  # the step donates them
    _, _, m = fns.train(params, fns.init_opt(params), jax.device_put(jb, fns.batch_sharding))
    m = jax.device_get(m)
    np.testing.assert_allclose(m["rewards_chosen"], np.mean(reward_c), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["rewards_rejected"], np.mean(reward_r), rtol=1e-4, atol=1e-6)
    want = np.mean([-np.log(1 / (1 + np.exp(-(c - r)))) for c, r in zip(reward_c, reward_r, strict=True)])
    np.testing.assert_allclose(m["pair_loss"], want, rtol=1e-4)


SMALL_DATA = pathlib.Path(agentrefine_jax.__file__).parent / "data" / "demo" / "eval.jsonl"  # 40 rows
RUN = [
    *("--set", f"data.train_files={SMALL_DATA}"),
    *("--set", "train.objective=sft+dpo"),
    *("--set", "data.max_length=512"),  # a pair (two renders of the prompt) needs more than FAST's 256
    *("--set", "train.max_steps=4"),
    *("--set", "train.keep_checkpoints=1"),
]


def test_sft_dpo_cli_resumes_after_sigkill_bit_exact_and_exports(tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    code, out = _finish(_train(reference, *RUN), timeout=900)
    assert code == 0, out
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert all(
        {"rewards_chosen", "rewards_rejected", "margin", "accuracy", "pairs"} <= set(r)
        for r in rows
        if "loss" in r
    )
    assert (reference / "hf" / "config.json").is_file()
    code, out = _finish(_train(killed, *RUN, fault="after_commit@2:KILL"), timeout=900)
    assert code == -9, out
    code, out = _finish(_train(killed, *RUN), timeout=900)
    assert code == 0, out
    assert "resumed from" in out
    assert _losses(killed) == _losses(reference)
    jax.tree.map(np.testing.assert_array_equal, _state(killed, 4), _state(reference, 4))


def test_dpo_on_data_without_pairs_exits_2_with_one_line(tmp_path):
    rows = [json.loads(x) for x in SMALL_DATA.read_text().splitlines()]
    clean = tmp_path / "clean.jsonl"
    clean.write_text(
        "".join(json.dumps(r) + "\n" for r in rows if all(m.get("loss", True) for m in r["messages"]))
    )
    code, out = _finish(
        _train(tmp_path / "run", "--set", f"data.train_files={clean}", "--set", "train.objective=dpo"),
        timeout=600,
    )
    assert code == 2, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines[-1].startswith("[train] error: ") and "needs preference pairs" in lines[-1], out
    assert "Traceback" not in out


def _trl_rows() -> list[dict]:
    """The demo's own error/refinement pairs, written as a TRL user would (no trajectories):
    conversational, implicit-prompt and standard (text) rows in turn."""
    from agentrefine_jax.data.preference import PairReport, trajectory_pairs

    rows = []
    for i, line in enumerate(SMALL_DATA.read_text().splitlines()):
        for pair in trajectory_pairs(json.loads(line)["messages"], f"row {i}", PairReport()):
            prompt = [{"role": m["role"], "content": m["content"]} for m in pair.prompt]
            chosen, rejected = pair.chosen, pair.rejected
            good, bad = {"role": "assistant", "content": chosen}, {"role": "assistant", "content": rejected}
            match len(rows) % 3:
                case 0:
                    rows.append({"prompt": prompt, "chosen": [good], "rejected": [bad]})
                case 1:
                    rows.append({"chosen": [*prompt, good], "rejected": [*prompt, bad]})
                case _:
                    rows.append({"prompt": prompt[-1]["content"], "chosen": chosen, "rejected": rejected})
    return rows


def test_a_plain_trl_preference_file_trains_with_dpo(tmp_path):
    """No trajectories at all: a TRL-layout JSONL is the whole training set of a DPO run."""
    rows = _trl_rows()
    assert len(rows) >= 8
    data = tmp_path / "trl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    sets = [f"data.train_files={data}", "train.objective=dpo", "data.max_length=512", "train.max_steps=2"]
    code, out = _finish(_train(run, *[a for s in sets for a in ("--set", s)]), timeout=900)
    assert code == 0, out
    assert f"pairs: {len(rows)}" in out, out
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["pairs"] > 0 and np.isfinite(r["loss"]) and np.isfinite(r["margin"]), r


def test_dpo_on_mostly_malformed_trl_rows_stops_with_one_line(tmp_path):
    """Issue 44: 8 of 10 malformed TRL rows were skipped and `objective=dpo` trained on the other two
    (the data.max_skip_fraction check counted no pairs)."""
    good = _trl_rows()[:2]
    bad = [{"prompt": 5, "chosen": "a", "rejected": "b"}] * 8  # a prompt must be text or messages
    data = tmp_path / "trl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    sets = [f"data.train_files={data}", "train.objective=dpo", "data.max_length=512", "train.max_steps=2"]
    code, out = _finish(_train(tmp_path / "run", *[a for s in sets for a in ("--set", s)]), timeout=600)
    assert code == 1, out  # the exit of the SFT path's own max_skip_fraction refusal (TrainingError)
    lines = [x for x in out.splitlines() if x.strip()]
    assert lines[-1].startswith("[train] error: train: 8 of 10 records skipped (bad preference row 8)"), out
    assert "data.max_skip_fraction=0.5" in lines[-1] and f"{data}:3" in lines[-1]
    assert "Traceback" not in out and not (tmp_path / "run" / "metrics.jsonl").exists()
