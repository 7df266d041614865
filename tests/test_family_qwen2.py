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
from hf_fixtures import build_model, save_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO = REPO / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with a default system prompt, as Qwen2.5 ships it (written here, not copied).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATIONS = [json.loads(line)["messages"] for line in DEMO.read_text().splitlines()[:6]]


def _tokenizer(out: pathlib.Path) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c]
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("qwen2")
    tok = _tokenizer(out)
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


def _hf_masks(tok: transformers.PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids, and the assistant tokens found by rendering prefix by prefix: what
    message k adds after the generation prompt, up to its end token."""
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    eos = tok.eos_token_id
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(
            messages[:k], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        upto = tok.apply_chat_template(messages[: k + 1], tokenize=True, return_dict=False)
        assert ids[: len(upto)] == upto and upto[: len(before)] == before
        end = len(before) + upto[len(before) :].index(eos) + 1
        mask[len(before) : end] = [1] * (end - len(before))
    return ids, mask


def test_template_from_directory_matches_apply_chat_template(qwen_dir: pathlib.Path) -> None:
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    ours = get_template("hf", load_tokenizer(str(qwen_dir)))
    for messages in CONVERSATIONS:
        ids, mask = ours.encode(messages, loss_on=("correct", "refinement", "erroneous"))
        want_ids, want_mask = _hf_masks(tok, messages)
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
    from agentrefine_jax.hf.io import read_hf_config

    c = read_hf_config(qwen_dir)
    model_sets = [
        f"model.{k}={getattr(c, k)}"
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings", "tie_embeddings", "bos_token_id")
    ] + [f"model.eos_token_ids={','.join(map(str, c.eos_token_ids))}", "model.param_dtype=float32",
         "model.dtype=float32", "model.remat_policy=none"]  # fmt: skip
    run = tmp_path / "run"
    sets = [*model_sets, f"train.init_from_hf={qwen_dir}", f"data.tokenizer={qwen_dir}",
            f"data.train_files={DEMO}", "data.max_length=512", "train.global_batch_size=8",
            "train.max_steps=3", f"train.run_dir={run}", "train.checkpoint_every=3"]  # fmt: skip
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "qwen2_5_7b"]
    r = subprocess.run(
        cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=900
    )
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
