"""A llama.cpp GGUF file -> a Hugging Face model directory, with numpy only (no torch).

What it writes (the same files `export to-hf` writes, so every reader of HF directories in the
project takes it as is): `config.json` and `generation_config.json` (through `hf.io`'s writers),
`model.safetensors`, `tokenizer.json` built from the file's vocabulary, merges and token types,
`tokenizer_config.json` (special tokens and the chat template) and `chat_template.jinja`.

How the file is read:

* Tensors through the `gguf` package's reader (llama.cpp's own Python reader, a memory map) and
  its numpy dequantisation (`gguf.quants.dequantize`): float formats and the block formats in
  `SUPPORTED_TYPES`. Every value comes out as llama.cpp computes it (float32), then is cast to the
  asked storage dtype.
* llama.cpp's converter permutes the rows of Q and K (it interleaves each head's two rotary
  halves, for its rotate-adjacent RoPE); `_unpermute` undoes that, so the weights are the
  transformers layout (rotate-half).
* Special tokens come from the file's own token ids (`tokenizer.ggml.bos_token_id`, ...), written
  both as ids (config/generation config) and as token strings (tokenizer_config.json). We never take
  them from transformers' GGUF tokenizer conversion, which derives the strings itself and has
  mixed bos and eos up across versions (docs/export.md). A chat model's end-of-turn token
  (`tokenizer.ggml.eot_token_id`, when the file has one) is added to the eos ids, so generation
  stops at the end of an assistant turn.
* Float hyper-parameters stored as float32 (rms_norm_eps 9.999999747378752e-06) are written as
  the shortest decimal that is the same float32 (1e-05): what the original config.json said.

Anything it cannot convert faithfully is refused up front with a `GGUFError` (a ValueError: the
CLI prints one line and exits 2): other architectures, quantisation types the numpy
dequantiser lacks, other tokenizer models or pre-tokenizers, llama3 rope scaling (`rope_freqs`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Log = Callable[[str], None]


class GGUFError(ValueError):
    """A GGUF file this converter refuses (unsupported, or not a GGUF file at all)."""


SUPPORTED_ARCHITECTURES = ("llama",)
# ggml types gguf.quants.dequantize handles in numpy and that llama.cpp writes for llama models.
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# tokenizer.ggml.model: "gpt2" is byte-level BPE (the vocabulary is already in the byte alphabet).
SUPPORTED_TOKENIZERS = ("gpt2",)
# tokenizer.ggml.pre -> the pre-tokenizer that splits text the way the merges were learned.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool = True) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    # GPT-2's regex.
    "gpt2": _byte_level(),
    # SmolLM: every digit its own piece, then GPT-2's regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM,
    # the original tokenizer.json's Digits + ByteLevel).
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level()],
    },
    # Llama 3's tiktoken-style regex.
    "llama-bpe": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            _byte_level(use_regex=False),
        ],
    },
}
# llama.cpp token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4


def _reader(path: str | pathlib.Path) -> Any:
    import gguf

    p = pathlib.Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: no such file")
    try:
        return gguf.GGUFReader(str(p))
    except (ValueError, OSError, KeyError, IndexError) as e:  # the reader's errors for a bad file
        raise GGUFError(f"{p}: not a readable GGUF file ({e})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 (GGUF stores these hyper-parameters as float32)."""
    return float(str(np.float32(x)))


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """What a supported GGUF file holds, read and checked (the tensors are still memory-mapped)."""

    path: pathlib.Path
    reader: Any
    arch: str
    cfg: Any  # models.config.ModelConfig
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    add_bos: bool
    add_eos: bool
    special: dict[str, int]  # bos/eos/pad/unk -> token id, as the file gives them
    chat_template: str | None

    def token(self, name: str) -> str | None:
        i = self.special.get(name)
        return None if i is None else self.tokens[i]


def read_gguf(path: str | pathlib.Path, *, param_dtype: str = "float32") -> GGUFModel:
    """Read and check a GGUF file; refuse (GGUFError) what `write_hf_dir` cannot convert faithfully."""
    from agentrefine_jax.models.config import ModelConfig

    p = pathlib.Path(path)
    r = _reader(p)
    arch = _field(r, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{p}: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    bad = sorted({t.tensor_type.name for t in r.tensors} - set(SUPPORTED_TYPES))
    if bad:
        raise GGUFError(
            f"{p}: tensor type(s) {', '.join(bad)} not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    names = {t.name for t in r.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{p}: llama3 rope scaling (rope_freqs) is not supported yet")
    model = _field(r, "tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZERS:
        raise GGUFError(
            f"{p}: tokenizer model {model!r} is not supported "
            f"({', '.join(SUPPORTED_TOKENIZERS)}: byte-level BPE)"
        )
    pre = _field(r, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{p}: pre-tokenizer {pre!r} is not supported ({', '.join(PRE_TOKENIZERS)})")

    def need(key: str) -> Any:
        v = _field(r, f"{arch}.{key}")
        if v is None:
            raise GGUFError(f"{p}: lacks {arch}.{key}")
        return v

    tokens = list(_field(r, "tokenizer.ggml.tokens", []))
    keys = (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"), ("eot", "eot"))
    special = {
        name: int(v) for name, key in keys if (v := _field(r, f"tokenizer.ggml.{key}_token_id")) is not None
    }
    for name, i in special.items():
        if not 0 <= i < len(tokens):
            raise GGUFError(f"{p}: {name} token id {i} is outside the vocabulary ({len(tokens)})")
    eos = [special[k] for k in ("eos", "eot") if k in special]
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = int(_field(r, f"{arch}.vocab_size", len(tokens)))
    if vocab != len(tokens):
        raise GGUFError(f"{p}: {arch}.vocab_size {vocab} but {len(tokens)} tokens")
    head_dim = int(_field(r, f"{arch}.attention.key_length", hidden // heads))
    rot = _field(r, f"{arch}.rope.dimension_count", head_dim)
    if int(rot) != head_dim:
        raise GGUFError(f"{p}: partial rotary embeddings ({rot} of {head_dim}) are not supported")
    cfg = ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(r, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32(_field(r, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_embeddings="output.weight" not in names,
        param_dtype=param_dtype,
        bos_token_id=special.get("bos", 1),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=special.get("pad"),
    )
    _check_tensor_set(p, r, cfg)
    return GGUFModel(
        path=p,
        reader=r,
        arch=arch,
        cfg=cfg,
        tokens=tokens,
        token_types=[int(t) for t in _field(r, "tokenizer.ggml.token_type", [1] * len(tokens))],
        merges=list(_field(r, "tokenizer.ggml.merges", [])),
        pre=pre,
        add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(_field(r, "tokenizer.ggml.add_eos_token", False)),
        special=special,
        chat_template=_field(r, "tokenizer.chat_template"),
    )


# ----------------------------------------------------------------------------------- weights

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{suffix}"
    raise GGUFError(f"tensor {gguf_name!r} has no transformers Llama counterpart")


def _check_tensor_set(p: pathlib.Path, r: Any, cfg: Any) -> None:
    """Every tensor the metadata implies, present once with its shape, and nothing else: a missing
    or misshapen tensor would otherwise be written into a directory that only fails when loaded."""
    from agentrefine_jax.models import params

    shapes: dict[str, tuple[int, ...]] = {}
    unknown = []
    for t in r.tensors:
        try:
            name = hf_name(t.name)
        except GGUFError:
            unknown.append(t.name)
            continue
        if name in shapes:
            raise GGUFError(f"{p}: tensor {t.name} appears twice")
        shapes[name] = tuple(int(n) for n in reversed(t.shape))  # ggml lists dimensions innermost first
    problems = params.hf_set_problems(shapes, cfg, "the file's metadata")
    if unknown or problems:
        known = f"tensors with no transformers Llama counterpart: {unknown[:8]}" if unknown else ""
        raise GGUFError(f"{p}: " + "; ".join(x for x in (known, problems) if x))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter's `permute`): per head, rows were
    reordered from [first half; second half] to interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(m: GGUFModel) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in transformers' layout), one tensor at a time."""
    from gguf.quants import dequantize

    for t in m.reader.tensors:
        name = hf_name(t.name)
        # Dequantised rows come out in ggml's row-major order: numpy shape (out, in), the torch layout.
        shape = tuple(int(n) for n in reversed(t.shape))
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, m.cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, m.cfg.num_kv_heads)
        if not np.isfinite(w).all():
            raise GGUFError(f"{m.path}: tensor {t.name} holds non-finite values")
        yield name, w


# --------------------------------------------------------------------------------- tokenizer


def tokenizer_json(m: GGUFModel) -> dict[str, Any]:
    """A `tokenizers` tokenizer.json for the file's byte-level BPE vocabulary."""
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == _CONTROL,
        }
        for i, (tok, kind) in enumerate(zip(m.tokens, m.token_types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    single: list[dict[str, Any]] = [{"Sequence": {"id": "A", "type_id": 0}}]
    specials: dict[str, Any] = {}
    for name, on, first in (("bos", m.add_bos, True), ("eos", m.add_eos, False)):
        tok = m.token(name)
        if on and tok is not None:
            single.insert(0 if first else len(single), {"SpecialToken": {"id": tok, "type_id": 0}})
            specials[tok] = {"id": tok, "ids": [m.special[name]], "tokens": [tok]}
    post: dict[str, Any] = (
        {"type": "TemplateProcessing", "single": single, "pair": single, "special_tokens": specials}
        if specials
        else {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[m.pre],
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(m.tokens)},
            "merges": [pair.split(" ", 1) for pair in m.merges],
        },
    }


def tokenizer_config(m: GGUFModel) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": m.add_bos,
        "add_eos_token": m.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": m.cfg.max_position_embeddings,
    }
    for name in ("bos", "eos", "pad", "unk"):
        if (tok := m.token(name)) is not None:
            out[f"{name}_token"] = tok
    if m.chat_template:
        out["chat_template"] = m.chat_template
    return out


# ------------------------------------------------------------------------------------ writing

NP_STORAGE = ("float32", "bfloat16", "float16")


def write_hf_dir(m: GGUFModel, out: pathlib.Path, *, dtype: str = "float32", log: Log | None = None) -> int:
    """Write the HF directory into `out` (an empty directory: the caller publishes it). Returns the
    parameter count."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from agentrefine_jax.hf.io import generation_config_dict, hf_config_dict
    from agentrefine_jax.outputs import json_dumps

    log = log or (lambda s: None)
    if dtype not in NP_STORAGE:
        raise GGUFError(f"dtype must be one of {', '.join(NP_STORAGE)}, got {dtype!r}")
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {name: w.astype(np_dtype) for name, w in hf_tensors(m)}
    count = sum(w.size for w in tensors.values())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    log(f"wrote model.safetensors: {count:,} parameters as {dtype}")
    (out / "config.json").write_text(json_dumps(hf_config_dict(m.cfg, dtype), indent=2) + "\n")
    (out / "generation_config.json").write_text(json_dumps(generation_config_dict(m.cfg), indent=2) + "\n")
    (out / "tokenizer.json").write_text(json_dumps(tokenizer_json(m), ensure_ascii=False))
    tok_cfg = json_dumps(tokenizer_config(m), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(tok_cfg + "\n")
    if m.chat_template:
        (out / "chat_template.jinja").write_text(m.chat_template)
    log(
        f"wrote config.json, generation_config.json, tokenizer.json ({len(m.tokens):,} tokens, "
        f"{len(m.merges):,} merges, pre-tokenizer {m.pre}), tokenizer_config.json"
        f"{', chat_template.jinja' if m.chat_template else ' (the file has no chat template)'}"
    )
    return count
