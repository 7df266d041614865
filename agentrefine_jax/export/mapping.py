"""Name and layout mapping between HF Llama/Mistral tensors and our parameters.

HF stores linear weights as [out, in]; we store [in, ...out] with heads split out so
sharding rules can name the head axis. Both stacks use the same rotate-half RoPE layout,
so q/k need no permutation — only transposes and reshapes, which are exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from agentrefine_jax.models.config import ModelConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")

# HF per-layer suffix -> our stacked parameter name
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "wq",
    "self_attn.k_proj": "wk",
    "self_attn.v_proj": "wv",
    "self_attn.o_proj": "wo",
    "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "w_gate",
    "mlp.up_proj": "w_up",
    "mlp.down_proj": "w_down",
}
_OURS_TO_HF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}


def hf_to_ours(name: str, tensor: np.ndarray, cfg: ModelConfig) -> tuple[tuple[str, ...], int | None, np.ndarray]:
    """Map one HF tensor to (our parameter path, layer index or None, array in our layout).

    Raises KeyError for a tensor we do not know — a silently ignored weight is a bug.
    """
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if name == "model.embed_tokens.weight":
        return ("embed",), None, tensor
    if name == "model.norm.weight":
        return ("final_norm",), None, tensor
    if name == "lm_head.weight":
        return ("lm_head",), None, tensor.T
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"unexpected tensor in HF checkpoint: {name}")
    layer, ours = int(m.group(1)), _LAYER_NAMES[m.group(2)]
    if ours in ("attn_norm", "mlp_norm"):
        out = tensor
    elif ours == "wq":
        out = tensor.T.reshape(d, h, hd)
    elif ours in ("wk", "wv"):
        out = tensor.T.reshape(d, kv, hd)
    elif ours == "wo":
        out = tensor.T.reshape(h, hd, d)
    else:
        out = tensor.T
    return ("layers", ours), layer, out


def ours_to_hf(path: tuple[str, ...], array: np.ndarray, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `hf_to_ours` for one (possibly layer-stacked) parameter."""
    d = cfg.hidden_size
    if path == ("embed",):
        yield "model.embed_tokens.weight", array
        return
    if path == ("final_norm",):
        yield "model.norm.weight", array
        return
    if path == ("lm_head",):
        yield "lm_head.weight", np.ascontiguousarray(array.T)
        return
    if len(path) != 2 or path[0] != "layers" or path[1] not in _OURS_TO_HF_LAYER:
        raise KeyError(f"unexpected parameter {'.'.join(path)}")
    ours = path[1]
    for i in range(array.shape[0]):
        a = array[i]
        if ours in ("attn_norm", "mlp_norm"):
            out = a
        elif ours in ("wq", "wk", "wv"):
            out = a.reshape(d, -1).T
        elif ours == "wo":
            out = a.reshape(-1, d).T
        else:
            out = a.T
        yield f"model.layers.{i}.{_OURS_TO_HF_LAYER[ours]}.weight", np.ascontiguousarray(out)


def expected_hf_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        names.update(f"model.layers.{i}.{suffix}.weight" for suffix in _LAYER_NAMES)
    return names
