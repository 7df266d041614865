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

import pytest
from hf_fixtures import hf_greedy, load_hf, make_checkpoint, random_prompts

from agentrefine_jax.checkpoint import save_model
from agentrefine_jax.hf.io import load_hf_model, save_hf
from agentrefine_jax.inference import cli as inference_cli
from agentrefine_jax.inference.engine import generate, generate_ids

NEW_TOKENS = 24


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


def test_cli_greedy_on_saved_and_exported_checkpoint(models, tmp_path, capsys):
    """Our model -> project checkpoint (the CLI's input) and -> HF export (transformers' input)."""
    model = models["llama"][1]
    ckpt = tmp_path / "ckpt"
    save_model(ckpt, model, model.cfg, step=0)
    save_hf(model, model.cfg, tmp_path / "exported", dtype="float32")
    eos = list(model.cfg.eos_token_ids)
    prompts = random_prompts(model.cfg.vocab_size, [5, 41, 19], eos, seed=8)

    argv = ["generate", "--checkpoint", str(ckpt), "--max-new-tokens", str(NEW_TOKENS), "--greedy"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert inference_cli.main(argv) == 0
    ours = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ours == hf_greedy(load_hf(tmp_path / "exported"), prompts, NEW_TOKENS, eos)
    assert max(len(r) for r in ours) == NEW_TOKENS


def test_cli_entry_point_reports_errors_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    missing = str(tmp_path / "missing")
    cmd = [sys.executable, "-m", "agentrefine_jax.inference", "generate", "--checkpoint", missing]
    res = subprocess.run(
        cmd + ["--prompt-ids", "1,2", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2
    assert "[inference] error:" in res.stderr and "does not exist" in res.stderr
    assert res.stdout == ""


def test_cli_bfloat16_weights_equal_transformers_on_bfloat16_rounded_weights(tmp_path, capsys):
    """`--weights-dtype bfloat16` stores every weight in bfloat16 and changes nothing else: greedy ids
    equal transformers' (float32 compute) on the same weights rounded to bfloat16 once."""
    import jax
    import numpy as np
    import torch
    from flax import nnx

    from agentrefine_jax.inference.loading import load_for_inference

    hf_dir = make_checkpoint(tmp_path / "hf", "llama", seed=5)
    loaded = load_for_inference(hf_dir, dtype="float32", param_dtype="bfloat16")
    leaves = jax.tree.leaves(nnx.state(loaded.model, nnx.Param))
    assert {np.dtype(x.dtype).name for x in leaves} == {"bfloat16"}
    eos = list(loaded.cfg.eos_token_ids)
    prompts = random_prompts(loaded.cfg.vocab_size, [5, 41, 19], eos, seed=9)
    argv = ["generate", "--checkpoint", str(hf_dir), "--max-new-tokens", str(NEW_TOKENS), "--greedy"]
    argv += ["--dtype", "float32", "--weights-dtype", "bfloat16"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert inference_cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "weights bfloat16, compute float32" in captured.err
    ours = [json.loads(line) for line in captured.out.splitlines()]
    hf = load_hf(hf_dir)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    assert ours == hf_greedy(hf, prompts, NEW_TOKENS, eos)
    assert max(len(r) for r in ours) == NEW_TOKENS
