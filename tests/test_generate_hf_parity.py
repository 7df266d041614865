"""Greedy KV-cache generation equals transformers' `generate(do_sample=False)` token for token.

Oracles: random tiny transformers checkpoints (tests/hf_fixtures.py; weights drawn large
enough that logits are far from ties), a Llama with GQA + llama3 rope scaling and a
Mistral whose sliding window (8) is much shorter than the sequences. Prompts of different
lengths share a left-padded batch, and generation runs long enough to cross the rope
scaling bands and the window. Also checked through the CLI on a checkpoint saved in our
format and exported with `save_hf`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hf_fixtures import load_hf, make_checkpoint

from agentrefine_jax.checkpoint import save_model
from agentrefine_jax.export.hf_io import load_hf_model, save_hf
from agentrefine_jax.inference.engine import generate, generate_ids
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import ModelConfig

NEW_TOKENS = 24


def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new: int, eos: list[int]
) -> list[list[int]]:
    """transformers' batched greedy generation (left padding), cut after the first eos like ours."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    rows = []
    for r in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(r) if t in eos), None)
        rows.append(r if cut is None else r[: cut + 1])
    return rows


def random_prompts(vocab: int, lengths: list[int], avoid: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab), avoid)
    return [rng.choice(allowed, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (transformers model, our model loaded from the same safetensors)."""
    out = {}
    for family in ("llama", "mistral"):
        hf_dir = make_checkpoint(tmp_path_factory.mktemp(family), family, seed=3)
        out[family] = (load_hf(hf_dir), load_hf_model(hf_dir, dtype="float32")[1])
    return out


@pytest.mark.parametrize("family, lengths", [("llama", [5, 41, 19]), ("mistral", [30, 3])])
def test_greedy_matches_transformers(models, family, lengths):
    hf, model = models[family]
    eos = list(model.cfg.eos_token_ids)
    prompts = random_prompts(model.cfg.vocab_size, lengths, eos, seed=7)

    ours = generate_ids(model, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=eos)
    theirs = hf_greedy(hf, prompts, NEW_TOKENS, eos)
    assert ours == theirs
    # Meaningful only if rows generate for a while (not all cut by an early eos).
    assert max(len(r) for r in ours) == NEW_TOKENS


def test_rows_stop_independently_on_stop_tokens(models):
    """A row that emits a stop token ends there (keeping it) while the others continue."""
    hf, model = models["llama"]
    prompts = random_prompts(model.cfg.vocab_size, [5, 41, 19], list(model.cfg.eos_token_ids), seed=7)
    free = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=())
    assert all(g.finish_reason == "length" and len(g.tokens) == NEW_TOKENS for g in free)
    # Declare the 6th token of row 1 a stop token: row 1 must end there, the others run on
    # unchanged unless that token occurs in them too.
    stop = free[1].tokens[5]
    gens = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    for g, f in zip(gens, free, strict=True):
        cut = f.tokens.index(stop) + 1 if stop in f.tokens else None
        assert g.tokens == f.tokens[:cut]
        assert g.finish_reason == ("stop" if cut else "length")
    assert hf_greedy(hf, prompts, NEW_TOKENS, [stop]) == [g.tokens for g in gens]


def test_cli_greedy_on_saved_and_exported_checkpoint(tmp_path):
    """Our model -> project checkpoint (CLI input) and -> HF export (transformers' input)."""
    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=256,
        initializer_range=0.15,  # logits spread well beyond float32 noise: no argmax ties
        param_dtype="float32",
        dtype="float32",
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    model = llama.create(cfg, seed=5)
    ckpt = tmp_path / "ckpt"
    save_model(ckpt, model, cfg, step=0)
    save_hf(model, cfg, tmp_path / "hf", dtype="float32")
    prompts = random_prompts(cfg.vocab_size, [9, 4], [2], seed=11)

    cmd = [
        sys.executable,
        "-m",
        "agentrefine_jax.generate",
        "--checkpoint",
        str(ckpt),
        "--max-new-tokens",
        "20",
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    cmd += ["--greedy"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device is plenty
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    ours = [json.loads(line) for line in res.stdout.splitlines()]
    assert ours == hf_greedy(load_hf(tmp_path / "hf"), prompts, 20, [2])
    assert max(len(r) for r in ours) == 20
