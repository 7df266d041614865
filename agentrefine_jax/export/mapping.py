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


def hf_to_ours(
    name: str, tensor: np.ndarray, cfg: ModelConfig
) -> tuple[tuple[str, ...], int | None, np.ndarray]:
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


def layer_to_hf(name: str, layer: int, array: np.ndarray, cfg: ModelConfig) -> tuple[str, np.ndarray]:
    """One layer's slice of our stacked parameter `name` -> (HF tensor name, HF-layout array)."""
    if name not in _OURS_TO_HF_LAYER:
        raise KeyError(f"unexpected layer parameter {name}")
    d = cfg.hidden_size
    if name in ("attn_norm", "mlp_norm"):
        out = array
    elif name in ("wq", "wk", "wv"):
        out = array.reshape(d, -1).T
    elif name == "wo":
        out = array.reshape(-1, d).T
    else:
        out = array.T
    return f"model.layers.{layer}.{_OURS_TO_HF_LAYER[name]}.weight", np.ascontiguousarray(out)


def top_level_to_hf(path: tuple[str, ...], array: np.ndarray) -> tuple[str, np.ndarray]:
    """A non-layer parameter (embed, final_norm, lm_head) -> (HF tensor name, HF-layout array)."""
    if path == ("embed",):
        return "model.embed_tokens.weight", array
    if path == ("final_norm",):
        return "model.norm.weight", array
    if path == ("lm_head",):
        return "lm_head.weight", np.ascontiguousarray(array.T)
    raise KeyError(f"unexpected parameter {'.'.join(path)}")


def ours_to_hf(
    path: tuple[str, ...], array: np.ndarray, cfg: ModelConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """Inverse of `hf_to_ours` for one (possibly layer-stacked) parameter."""
    if len(path) == 2 and path[0] == "layers":
        for i in range(array.shape[0]):
            yield layer_to_hf(path[1], i, array[i], cfg)
        return
    yield top_level_to_hf(path, array)


def hf_layer_order() -> tuple[str, ...]:
    """Our per-layer parameter names in the order transformers writes a layer's tensors."""
    return tuple(_LAYER_NAMES.values())


def hf_layer_tensor_name(name: str, layer: int) -> str:
    """HF tensor name of layer `layer` of our stacked parameter `name`."""
    return f"model.layers.{layer}.{_OURS_TO_HF_LAYER[name]}.weight"


def hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The HF shape a tensor named `name` must have under `cfg` (KeyError for unknown names)."""
    d, h, kv, hd, f, v = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    if name == "model.embed_tokens.weight":
        return (v, d)
    if name == "model.norm.weight":
        return (d,)
    if name == "lm_head.weight":
        return (v, d)
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"unexpected tensor in HF checkpoint: {name}")
    return {
        "input_layernorm": (d,),
        "post_attention_layernorm": (d,),
        "self_attn.q_proj": (h * hd, d),
        "self_attn.k_proj": (kv * hd, d),
        "self_attn.v_proj": (kv * hd, d),
        "self_attn.o_proj": (d, h * hd),
        "mlp.gate_proj": (f, d),
        "mlp.up_proj": (f, d),
        "mlp.down_proj": (d, f),
    }[m.group(2)]


def expected_hf_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        names.update(f"model.layers.{i}.{suffix}.weight" for suffix in _LAYER_NAMES)
    return names
