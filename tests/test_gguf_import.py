"""`export from-gguf` on small GGUF files written here with the `gguf` package's writer, as
llama.cpp's converter writes them (Q/K rows permuted for its RoPE): the HF weights come back
exactly, transformers' own GGUF load of the same file agrees, and what we cannot convert is
refused in one line (exit 2). The real model is tests/test_real_model.py."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import pre_tokenizers

L, H, NH, NKV, FF = 2, 64, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (its definition, written here)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    vocab = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIALS)
    hd = H // NH
    out = {"model.embed_tokens.weight": rng.normal(size=(vocab, H)), "model.norm.weight": rng.normal(size=H)}
    for i in range(L):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": rng.normal(size=H),
            p + "post_attention_layernorm.weight": rng.normal(size=H),
            p + "self_attn.q_proj.weight": rng.normal(size=(NH * hd, H)),
            p + "self_attn.k_proj.weight": rng.normal(size=(NKV * hd, H)),
            p + "self_attn.v_proj.weight": rng.normal(size=(NKV * hd, H)),
            p + "self_attn.o_proj.weight": rng.normal(size=(H, NH * hd)),
            p + "mlp.gate_proj.weight": rng.normal(size=(FF, H)),
            p + "mlp.up_proj.weight": rng.normal(size=(FF, H)),
            p + "mlp.down_proj.weight": rng.normal(size=(H, FF)),
        }
    return {k: (0.05 * v).astype(np.float32) for k, v in out.items()}


_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


Extra = dict[str, tuple[np.ndarray, object]]


def write_gguf(
    path: pathlib.Path, weights: dict[str, np.ndarray], *, arch: str = "llama", tokenizer: str = "gpt2",
    extra: Extra | None = None,
) -> pathlib.Path:  # fmt: skip
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(L)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // NH)
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in weights.items():
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{_TO_GGUF[rest.removesuffix('.weight')]}.weight"
        if "q_proj" in name:
            t = _llama_cpp_permute(t, NH)
        elif "k_proj" in name:
            t = _llama_cpp_permute(t, NKV)
        w.add_tensor(out, t)
    for name, (t, raw) in (extra or {}).items():
        w.add_tensor(name, t, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrefine_jax.export", *args],
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    weights = _hf_weights()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", weights), weights


def test_from_gguf_gives_back_the_hf_weights(small, tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import load_file

    path, weights = small
    out = tmp_path / "hf"
    r = _export("from-gguf", "--gguf", str(path), "--out", str(out))
    assert r.returncode == 0, r.stderr
    ours = load_file(out / "model.safetensors")
    assert ours.keys() == weights.keys()
    for name, w in weights.items():
        assert np.array_equal(ours[name], w), name  # the Q/K permutation undone exactly
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    for name, w in theirs.state_dict().items():
        if name != "lm_head.weight":
            assert np.array_equal(w.numpy(), ours[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] and (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert (out / "chat_template.jinja").read_text() == tok_cfg["chat_template"]
    # --overwrite replaces our own earlier output, and only with the flag.
    again = _export("from-gguf", "--gguf", str(path), "--out", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr
    assert _export("from-gguf", "--gguf", str(path), "--out", str(out), "--overwrite").returncode == 0


def test_refuses_what_it_cannot_convert(tmp_path: pathlib.Path, capsys) -> None:
    from agentrefine_jax.export.cli import main

    weights = _hf_weights()
    cases = {
        "architecture 'qwen3' is not supported": write_gguf(tmp_path / "a.gguf", weights, arch="qwen3"),
        "tokenizer model 'llama' is not supported": write_gguf(
            tmp_path / "t.gguf", weights, tokenizer="llama"
        ),
        "tensor type(s) IQ2_XXS not supported": write_gguf(
            tmp_path / "q.gguf",
            weights,
            extra={"blk.0.extra.weight": (np.zeros((4, 66), np.uint8), gguf.GGMLQuantizationType.IQ2_XXS)},
        ),
    }
    (tmp_path / "not.gguf").write_text("hello")
    cases["not a readable GGUF file"] = tmp_path / "not.gguf"
    for needle, path in cases.items():
        out = tmp_path / f"out-{path.stem}"
        assert main(["from-gguf", "--gguf", str(path), "--out", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("[export] error: ") and needle in lines[0], lines
        assert not out.exists() and not list(tmp_path.glob(f"out-{path.stem}.partial-*"))


def test_init_from_gguf_resolves_through_the_cache(small) -> None:
    """`train.init_from_gguf=FILE` becomes `train.init_from_hf=<cached conversion>` when training
    starts (converted once: a second resolution reuses the entry); setting both is refused."""
    from agentrefine_jax.config import load_config
    from agentrefine_jax.config_checks import ConfigError
    from agentrefine_jax.hf.gguf_cache import cache_root
    from agentrefine_jax.hf.model_source import resolve_init_from_gguf

    path, weights = small
    cfg = load_config("tiny", [f"train.init_from_gguf={path}"])
    resolved = resolve_init_from_gguf(cfg)
    hf_dir = pathlib.Path(resolved.train.init_from_hf)
    assert resolved.train.init_from_gguf is None and hf_dir.parent == cache_root()
    assert (hf_dir / "model.safetensors").is_file() and (hf_dir / "tokenizer.json").is_file()
    mtime = (hf_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_init_from_gguf(cfg).train.init_from_hf == str(hf_dir)
    assert (hf_dir / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    with pytest.raises(ConfigError, match="set one"):
        load_config("tiny", [f"train.init_from_gguf={path}", f"train.init_from_hf={hf_dir}"])
