"""Qwen3 (tied and untied) and Llama-3.2 through the family table, each proven like Qwen2.5
(tests/test_family_qwen2.py): a tiny random transformers model of the family, written to an HF
directory, imports and gives transformers' logits, passes `export verify`, decodes greedily with
the KV cache exactly as transformers' `generate`, exports back bit for bit, and trains a few steps
from `train.init_from_hf=DIR` into a run whose export carries the directory's special tokens.

Qwen3: q/k RMSNorm over head_dim before RoPE, no biases, head_dim (32) apart from hidden / heads
(16), the directory's own ChatML tokenizer and template. Llama-3.2: tied embeddings and llama3 rope
scaling with factor 32 (positions reach all three bands), Llama-3's tokenizer and template.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import hf_fixtures as F
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from agentrefine_jax.hf.io import load_hf_model, read_hf_config, save_hf

MODELS = ("qwen3_tied", "qwen3_untied", "llama3.2")
NEW_TOKENS = 24


def _qwen3_dir(out: pathlib.Path, *, tied: bool, seed: int) -> pathlib.Path:
    """A Qwen3 directory laid out as Qwen ships one: bos <|endoftext|>, config.json's eos
    <|im_end|>, generation_config.json's eos [<|im_end|>, <|endoftext|>] and pad <|endoftext|>."""
    tok = F.chatml_tokenizer(out)
    bos, eos = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = F.qwen3_config(vocab_size=len(tok), tie_word_embeddings=tied, bos_token_id=bos, eos_token_id=eos)
    F.save_checkpoint(F.build_model(config, seed=seed), out)
    gen = {"bos_token_id": bos, "eos_token_id": [eos, bos], "pad_token_id": bos}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    return {
        "qwen3_tied": _qwen3_dir(tmp_path_factory.mktemp("qwen3_tied"), tied=True, seed=11),
        "qwen3_untied": _qwen3_dir(tmp_path_factory.mktemp("qwen3_untied"), tied=False, seed=12),
        # Llama-3's vocabulary, so the built-in llama3 tokenizer and template train it.
        "llama3.2": F.make_checkpoint(
            tmp_path_factory.mktemp("llama32"), "llama3.2", seed=13, vocab_size=128256
        ),
    }


@pytest.fixture(scope="module")
def loaded(hf_dirs):
    """name -> (transformers model, our model loaded from the same safetensors)."""
    return {
        name: (F.load_hf(d), load_hf_model(d, dtype="float32", param_dtype="float32")[1])
        for name, d in hf_dirs.items()
    }


@pytest.mark.parametrize("name", MODELS)
def test_imports_and_matches_transformers_logits(name: str, hf_dirs, loaded) -> None:
    hf, model = loaded[name]
    cfg = model.cfg
    assert cfg.family == ("llama" if name == "llama3.2" else "qwen3")
    assert cfg.tie_embeddings == (name != "qwen3_untied")
    assert hasattr(model, "lm_head") == (name == "qwen3_untied")
    if name == "llama3.2":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0
    else:
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
        assert not hasattr(model.layers, "bq")
        assert model.layers.q_norm[...].shape == model.layers.k_norm[...].shape == (cfg.num_layers, 32)
    # Positions up to 80 cross the llama3 scaling's bands (original context 64).
    ids = F.random_ids(np.random.default_rng(0), cfg.vocab_size, 2, 80)
    ours = np.asarray(model(ids))
    np.testing.assert_allclose(ours, F.hf_logits(hf, ids), atol=1e-4, rtol=0)
    if name != "llama3.2":  # the q/k norms matter: unit norms move the logits far past the tolerance
        plain = nnx.clone(model)
        plain.layers.q_norm.set_value(jnp.ones_like(plain.layers.q_norm[...]))
        plain.layers.k_norm.set_value(jnp.ones_like(plain.layers.k_norm[...]))
        assert np.abs(np.asarray(plain(ids)) - ours).max() > 0.1


@pytest.mark.parametrize("name", MODELS)
def test_export_verify_passes_on_the_import(name: str, hf_dirs, loaded, tmp_path) -> None:
    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.export.parity import verify

    _, model = loaded[name]
    save_model(tmp_path / "ckpt", model, model.cfg, step=0)
    result = verify(tmp_path / "ckpt", hf_dirs[name], seq_lens=(16, 96))
    assert result.passed, (result.problems, result.max_abs_diff, result.mean_kl)
    assert result.max_abs_diff < 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_greedy_matches_transformers(name: str, loaded) -> None:
    from agentrefine_jax.inference.engine import generate_ids

    hf, model = loaded[name]
    eos = list(model.cfg.eos_token_ids)
    prompts = F.random_prompts(model.cfg.vocab_size, [5, 41, 19], eos, seed=7)
    ours = generate_ids(model, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=eos)
    assert ours == F.hf_greedy(hf, prompts, NEW_TOKENS, eos)
    assert max(len(r) for r in ours) == NEW_TOKENS  # rows generate for a while, past position 64


@pytest.mark.parametrize("name", MODELS)
def test_export_round_trip_is_exact(name: str, hf_dirs, loaded, tmp_path) -> None:
    _, model = loaded[name]
    out = tmp_path / "hf"
    save_hf(model, model.cfg, out, dtype="float32")
    source = load_file(hf_dirs[name] / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(source)  # tied: no lm_head on either side
    for key, tensor in source.items():
        assert np.array_equal(exported[key], tensor), key
    assert read_hf_config(out) == read_hf_config(hf_dirs[name])
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [F.load_hf(out).__class__.__name__]  # loads cleanly, same class


def _train_sets(name: str, hf_dir: pathlib.Path) -> tuple[str, list[str]]:
    """(config, --set list) for two steps of the demo recipe on `hf_dir`'s model."""
    sets = ["data.max_length=256", "train.global_batch_size=8", "train.max_steps=2",
            "train.checkpoint_every=2", "train.eval_every=0"]  # fmt: skip
    if name != "llama3.2":  # the directory's own tokenizer and chat template
        sets += [f"data.tokenizer={hf_dir}", "data.template=hf"]
    else:  # no tokenizer files (Llama-3's vocabulary): the tokenizer is named, never implied
        sets += ["data.tokenizer=llama3"]
    return "tiny", sets


@pytest.mark.parametrize("name", MODELS)
def test_trains_from_hf_dir_and_exports_its_special_tokens(name: str, hf_dirs, tmp_path) -> None:
    hf_dir, run = hf_dirs[name], tmp_path / "run"
    config, sets = _train_sets(name, hf_dir)
    r = F.train_from_hf(hf_dir, run, config=config, sets=sets)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # The demo recipe exports at the end: the directory's family, context and special tokens.
    source = json.loads((hf_dir / "config.json").read_text())
    exported = json.loads((run / "hf" / "config.json").read_text())
    for key in ("architectures", "model_type", "head_dim", "tie_word_embeddings", "max_position_embeddings",
                "bos_token_id", "rope_parameters"):  # fmt: skip
        assert exported[key] == source[key], key
    assert read_hf_config(run / "hf").eos_token_ids == read_hf_config(hf_dir).eos_token_ids
    from agentrefine_jax.export.parity import verify

    # What `export verify --checkpoint RUN --hf RUN/hf` runs (its CLI: tests/test_family_qwen2.py).
    result = verify(run, run / "hf", seq_lens=(16, 64))
    assert result.passed, (result.problems, result.max_abs_diff, result.mean_kl)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, "attention_bias=true is not supported for Qwen3"),
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=true"),
        ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "rope type 'yarn'"),
    ],
    ids=["attention_bias", "sliding_window", "layer_types", "yarn"],
)
def test_what_we_cannot_run_is_refused_in_one_line(change: dict, message: str, hf_dirs, tmp_path) -> None:
    config = json.loads((hf_dirs["qwen3_tied"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message) as e:
        read_hf_config(tmp_path)
    assert "\n" not in str(e.value)


def test_a_llama_checkpoint_with_q_norm_tensors_is_refused(hf_dirs, tmp_path) -> None:
    """A Qwen3 checkpoint relabelled as Llama: its q_norm / k_norm are no tensors of a Llama model."""
    from agentrefine_jax.hf.io import check_hf_dir

    src = hf_dirs["qwen3_tied"]
    config = json.loads((src / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    for check in (check_hf_dir, lambda d: load_hf_model(d, dtype="float32")):
        with pytest.raises(ValueError, match=r"self_attn\.[qk]_norm\.weight \(not part of a llama model\)"):
            check(tmp_path)


def test_lora_forward_on_qwen3_equals_its_merged_weights(loaded) -> None:
    """The LoRA path (delta added to each projection, then the q/k norms) computes the function of
    the merged weights: adapters sit in q_proj/k_proj before q_norm/k_norm, as PEFT's do."""
    import jax

    from agentrefine_jax.models import lora

    _, model = loaded["qwen3_untied"]
    spec = lora.LoraSpec(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8.0)
    adapters = lora.init(spec, model.cfg, jax.random.key(0))
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
