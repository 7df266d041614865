"""Qwen3-MoE (routed experts) through the family table, held to transformers' Qwen3MoeForCausalLM:
a tiny random model (8 experts, top 2, 3 layers; every weight redrawn, the router included, so each
token's routing differs) written with `save_pretrained` imports and gives transformers' logits and
loss, exports back bit for bit into a directory transformers loads, passes `export verify`, and
trains (LoRA on attention and on the experts) from `train.init_from_hf=DIR` into a run whose merged
export transformers loads. The grouped matmul (`jax.lax.ragged_dot`) is held to the dense
all-experts oracle, forward and backward; the Qwen3-30B-A3B preset has the published sizes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import hf_fixtures as F
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from agentrefine_jax.hf.io import load_hf_model, read_hf_config, save_hf
from agentrefine_jax.models import lora, moe


def _moe_dir(out: pathlib.Path, *, seed: int, **overrides) -> pathlib.Path:
    """A Qwen3-MoE directory with its own ChatML tokenizer (bos <|endoftext|>, eos <|im_end|>)."""
    tok = F.chatml_tokenizer(out)
    bos, eos = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = F.qwen3_moe_config(vocab_size=len(tok), bos_token_id=bos, eos_token_id=eos, **overrides)
    F.save_checkpoint(F.build_model(config, seed=seed), out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    return _moe_dir(tmp_path_factory.mktemp("qwen3_moe"), seed=21)


@pytest.fixture(scope="module")
def loaded(hf_dir):
    return F.load_hf(hf_dir), load_hf_model(hf_dir, dtype="float32", param_dtype="float32")[1]


def test_imports_and_matches_transformers_logits_and_loss(hf_dir, loaded) -> None:
    from agentrefine_jax.train.loss import chunked_cross_entropy

    hf, model = loaded
    cfg = model.cfg
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 48,
    )  # fmt: skip
    assert cfg.norm_topk_prob and cfg.router_aux_loss_coef == 0.001
    assert model.layers.we_gate[...].shape == (3, 8, 64, 48)
    assert model.layers.we_down[...].shape == (3, 8, 48, 64)
    assert model.layers.router[...].shape == (3, 64, 8)
    assert not hasattr(model.layers, "w_gate")  # no dense MLP in an all-sparse model
    ids = F.random_ids(np.random.default_rng(0), cfg.vocab_size, 2, 40)
    ours = np.asarray(model(ids))
    ref = F.hf_logits(hf, ids)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    # The loss: our training loss (chunked cross-entropy on the final hidden states) vs HF's labels=.
    hidden, _ = model.forward(ids)
    total, count = chunked_cross_entropy(
        hidden[:, :-1], model.lm_head_weight(), jnp.asarray(ids[:, 1:]), jnp.ones(ids[:, 1:].shape), 16
    )
    with torch.no_grad():
        hf_loss = hf(input_ids=torch.tensor(ids), labels=torch.tensor(ids)).loss.item()
    assert abs(float(total / count) - hf_loss) < 1e-5
    # The routing matters: the renormalisation of the top-k weights alone moves the logits.
    unnormed = nnx.clone(model)
    unnormed.cfg = dataclasses.replace(cfg, norm_topk_prob=False)
    assert np.abs(np.asarray(unnormed(ids)) - ours).max() > 0.05


def test_grouped_matmul_equals_the_dense_oracle_forward_and_backward() -> None:
    rng = jax.random.split(jax.random.key(0), 5)
    t, d, f, e, k = 37, 16, 12, 6, 3
    x = jax.random.normal(rng[0], (t, d))
    router = jax.random.normal(rng[1], (d, e))
    ws = [
        jax.random.normal(r, s) * 0.3 for r, s in zip(rng[2:], [(e, d, f), (e, d, f), (e, f, d)], strict=True)
    ]

    def run(impl):
        def f_(x, router, *ws):
            _, w, i = moe.route(x, router, k, True)
            return impl(x, w, i, *ws)

        out = f_(x, router, *ws)
        grads = jax.grad(lambda *a: jnp.sum(f_(*a) ** 2), argnums=(0, 1, 2, 3, 4))(x, router, *ws)
        return out, grads

    (a, ga), (b, gb) = run(moe.experts_ragged), run(moe.experts_dense)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    for u, v in zip(ga, gb, strict=True):
        np.testing.assert_allclose(u, v, atol=1e-4, rtol=1e-4)
    assert moe.experts is moe.experts_ragged  # this jax has ragged_dot: the grouped path runs


def test_kv_cache_greedy_matches_transformers(loaded) -> None:
    """Decoding routes one token at a time through the experts, as transformers' `generate`."""
    from agentrefine_jax.inference.engine import generate_ids

    hf, model = loaded
    eos = list(model.cfg.eos_token_ids)
    prompts = F.random_prompts(model.cfg.vocab_size, [5, 23], eos, seed=7)
    ours = generate_ids(model, prompts, max_new_tokens=12, stop_token_ids=eos)
    assert ours == F.hf_greedy(hf, prompts, 12, eos)


def test_export_round_trip_is_exact_and_transformers_loads_it(hf_dir, loaded, tmp_path) -> None:
    _, model = loaded
    out = tmp_path / "hf"
    save_hf(model, model.cfg, out, dtype="float32")
    source, exported = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(source)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in exported
    for key, tensor in source.items():
        assert np.array_equal(exported[key], tensor), key
    assert read_hf_config(out) == read_hf_config(hf_dir)
    written = json.loads((out / "config.json").read_text())
    assert written["num_experts"] == 8 and written["decoder_sparse_step"] == 1
    ids = F.random_ids(np.random.default_rng(3), model.cfg.vocab_size, 1, 24)
    np.testing.assert_array_equal(F.hf_logits(out, ids), F.hf_logits(hf_dir, ids))  # loads cleanly


def test_export_verify_passes_on_the_import(hf_dir, loaded, tmp_path) -> None:
    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.export.parity import verify

    _, model = loaded
    save_model(tmp_path / "ckpt", model, model.cfg, step=0)
    result = verify(tmp_path / "ckpt", hf_dir, seq_lens=(16, 64))
    assert result.passed, (result.problems, result.max_abs_diff, result.mean_kl)
    assert result.max_abs_diff < 1e-4


def test_lora_on_attention_and_experts_equals_its_merged_weights(loaded) -> None:
    _, model = loaded
    spec = lora.LoraSpec(targets=("q", "v", "expert_gate", "expert_up", "expert_down"), rank=4, alpha=8.0)
    adapters = lora.init(spec, model.cfg, jax.random.key(0))
    assert adapters["we_gate"]["a"].shape == (3, 8, 64, 4) and adapters["we_down"]["b"].shape == (3, 8, 4, 64)
    key = jax.random.key(1)
    for i, ab in enumerate(adapters.values()):  # B = 0 at init: draw it so the deltas matter
        ab["b"] = 0.3 * jax.random.normal(jax.random.fold_in(key, i), ab["b"].shape, ab["b"].dtype)
    ids = F.random_ids(np.random.default_rng(1), model.cfg.vocab_size, 2, 32)
    hidden, _ = model.forward(ids, adapters=(spec, adapters, None))
    with_adapters = np.asarray(model.logits(hidden))
    merged = nnx.clone(model)
    state = nnx.state(merged, nnx.Param)
    nnx.replace_by_pure_dict(state, lora.merge(nnx.to_pure_dict(nnx.state(model, nnx.Param)), adapters, spec))
    nnx.update(merged, state)
    assert np.abs(with_adapters - np.asarray(model(ids))).max() > 0.1
    np.testing.assert_allclose(with_adapters, np.asarray(merged(ids)), atol=1e-4, rtol=0)
    # The dense MLP's targets are refused on an MoE model, never silently left untrained.
    with pytest.raises(ValueError, match=r"\['gate'\].*qwen3_moe model has no such projections"):
        lora.shapes(lora.LoraSpec(targets=("q", "gate"), rank=4, alpha=8.0), model.cfg)


def test_trains_with_lora_from_hf_dir_and_exports_a_model_transformers_loads(hf_dir, tmp_path) -> None:
    run = tmp_path / "run"
    sets = ["data.max_length=256", "train.global_batch_size=8", "train.max_steps=2",
            "train.checkpoint_every=2", "train.eval_every=0", f"data.tokenizer={hf_dir}", "data.template=hf",
            "train.lora.rank=4", "train.lora.alpha=8", "train.router_aux_loss=true",
            "train.lora.targets=q,k,v,o,expert_gate,expert_up,expert_down"]  # fmt: skip
    r = F.train_from_hf(hf_dir, run, config="tiny", sets=sets)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(np.isfinite(losses))
    exported = json.loads((run / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["num_experts"] == 8
    # The export is the merged model: the expert adapters trained (their weights moved) and
    # transformers loads every tensor.
    source, merged = load_file(hf_dir / "model.safetensors"), load_file(run / "hf" / "model.safetensors")
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert not np.array_equal(source[name].astype(np.float32), merged[name].astype(np.float32))
    F.load_hf(run / "hf")
    from agentrefine_jax.export.parity import verify

    result = verify(run, run / "hf", seq_lens=(16, 64))
    assert result.passed, (result.problems, result.max_abs_diff, result.mean_kl)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
        ({"attention_bias": True}, "attention_bias=true"),
    ],
    ids=["sparse_step", "mlp_only_layers", "attention_bias"],
)
def test_what_we_cannot_run_is_refused_in_one_line(change, message, hf_dir, tmp_path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as e:
        read_hf_config(tmp_path)
    assert "\n" not in str(e.value)


def test_an_expert_past_num_experts_is_refused(hf_dir, tmp_path) -> None:
    """config.json with fewer experts than the weights: the extra experts are named, not dropped."""
    from agentrefine_jax.hf.io import check_hf_dir

    config = json.loads((hf_dir / "config.json").read_text())
    config["num_local_experts"] = config.pop("num_experts", config.get("num_local_experts")) - 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(hf_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.6\.\w+\.weight \(config\.json says 6 experts\)"):
        check_hf_dir(tmp_path)


def test_qwen3_30b_a3b_preset_has_the_published_sizes() -> None:
    """48 layers of 128 experts, top 8: 30.5B parameters, 3.3B of them active per token."""
    from agentrefine_jax.models import abstract_params, param_count, preset
    from agentrefine_jax.train import flops

    cfg = preset("qwen3_30b_a3b")
    _, state = abstract_params(cfg)  # eval_shape: no memory
    total = param_count(state)
    assert total == 30_532_122_624
    experts = sum(
        int(np.prod(x.shape)) for k, x in nnx.to_flat_state(state) if k[-1] in ("we_gate", "we_up", "we_down")
    )
    active = total - experts + experts * 8 // 128
    assert active == 3_353_032_704  # the model card's "3.3B activated" (29.9B non-embedding in all)
    assert round((total - 2 * cfg.vocab_size * cfg.hidden_size) / 1e9, 1) == 29.9
    # FLOPs count the active experts (and the untied lm_head, not the embedding lookup).
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    assert flops.matmul_params(cfg) == active - cfg.vocab_size * cfg.hidden_size - norms


def test_load_balancing_loss_is_transformers(hf_dir, loaded) -> None:
    """train.router_aux_loss: our SFT loss sum / count is transformers' `loss` with
    output_router_logits=True (cross-entropy + router_aux_loss_coef x load_balancing_loss_func)."""
    from agentrefine_jax.train.step import loss_sums

    hf, model = loaded
    ids = F.random_ids(np.random.default_rng(5), model.cfg.vocab_size, 2, 24)
    batch = {
        "input_ids": jnp.asarray(ids, jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24)),
        "segment_ids": jnp.ones((2, 24), jnp.int32),
        "loss_mask": jnp.ones((2, 24), jnp.int32),
    }
    graphdef, params = nnx.split(model, nnx.Param)
    coef = model.cfg.router_aux_loss_coef
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), labels=torch.tensor(ids), output_router_logits=True)
    total, count = loss_sums(graphdef, params, batch, 16, router_aux_coef=coef)
    plain, _ = loss_sums(graphdef, params, batch, 16)
    assert abs(float(total / count) - out.loss.item()) < 1e-5
    # (float32 sums of ~300 cancel here: the aux term itself is held to 1e-5 just below)
    np.testing.assert_allclose(float((total - plain) / count) / coef, out.aux_loss.item(), rtol=1e-3)
    assert out.aux_loss.item() > model.cfg.num_experts_per_tok + 0.01  # routing not balanced: it bites
    _, aux = model.forward_with_router_loss(batch["input_ids"], batch["positions"], batch["segment_ids"])
    np.testing.assert_allclose(float(aux), out.aux_loss.item(), rtol=1e-5)
    # Padding (segment 0) is left out, as transformers' attention_mask leaves it out.
    seg = batch["segment_ids"].at[1, 16:].set(0)
    with torch.no_grad():
        mask = torch.tensor(np.asarray(seg))
        ref = hf(input_ids=torch.tensor(ids), attention_mask=mask, output_router_logits=True).aux_loss.item()
    _, aux = model.forward_with_router_loss(batch["input_ids"], batch["positions"], seg)
    np.testing.assert_allclose(float(aux), ref, rtol=1e-5)
