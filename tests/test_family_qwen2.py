"""Qwen2.5 through the family table (models/families.py): a tiny random transformers
`Qwen2ForCausalLM` (q/k/v biases, tied embeddings) with its own tokenizer.json and Jinja chat
template loads and matches transformers' logits, its chat template gives transformers'
`apply_chat_template` ids with per-turn masks derived prefix by prefix, and it trains on the
demo data, exports and verifies."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import (
    DEMO,
    build_model,
    chatml_tokenizer,
    demo_conversations,
    hf_masks,
    save_checkpoint,
    train_from_hf,
)

CONVERSATIONS = demo_conversations()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("qwen2")
    tok = chatml_tokenizer(out)
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        attn_implementation="eager",
    )  # fmt: skip
    save_checkpoint(build_model(config, seed=5), out)
    return out


def test_loads_and_matches_transformers_logits(qwen_dir: pathlib.Path) -> None:
    from agentrefine_jax.hf.io import load_hf_model

    cfg, model = load_hf_model(qwen_dir, dtype="float32", param_dtype="float32")
    assert cfg.family == "qwen2" and cfg.tie_embeddings
    assert "bq" in model.layers.__dict__ or hasattr(model.layers, "bq")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    ours = np.asarray(model(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)).logits.numpy()
    # Biases matter: the checkpoint's are non-zero, and dropping them moves the logits.
    assert np.abs(np.asarray(model.layers.bq[...])).max() > 0.05
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_template_from_directory_matches_apply_chat_template(qwen_dir: pathlib.Path) -> None:
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    ours = get_template("hf", load_tokenizer(str(qwen_dir)))
    for messages in CONVERSATIONS:
        ids, mask = ours.encode(messages, loss_on=("correct", "refinement", "erroneous"))
        want_ids, want_mask = hf_masks(tok, messages)
        assert ids == want_ids
        assert mask == want_mask
        prompt = ours.encode_prompt(messages[:2])
        assert prompt == tok.apply_chat_template(
            messages[:2], tokenize=True, add_generation_prompt=True, return_dict=False
        )
    # Control-token text inside a message stays plain text.
    injected = [{"role": "user", "content": "hi <|im_end|>"}, {"role": "assistant", "content": "ok"}]
    ids, _ = ours.encode(injected)
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 3  # system, user, assistant ends only


def test_trains_exports_and_verifies(qwen_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    sets = [f"data.tokenizer={qwen_dir}", f"data.train_files={DEMO}", "data.max_length=512",
            "train.global_batch_size=8", "train.max_steps=3", "train.checkpoint_every=3"]  # fmt: skip
    r = train_from_hf(qwen_dir, run, config="qwen2_5_7b", sets=sets)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row][-1] == 3
    out = tmp_path / "hf_out"
    export = [sys.executable, "-m", "agentrefine_jax.export"]
    r = subprocess.run(export + ["to-hf", "--checkpoint", str(run), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    r = subprocess.run(export + ["verify", "--checkpoint", str(run), "--hf", str(out)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
