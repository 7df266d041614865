"""The one table of our parameters: shape, sharding axes, initialiser, and Hugging Face name/layout.

Model construction, HF import/export and FLOP counting all read this table, so adding a
tensor (a bias, a q-norm) means adding one row here and using it in the forward pass.

Layouts: HF stores a linear weight as [out, in]; we store [*in, *out] with heads split out so
sharding rules can name the head axis. The conversion is a transpose and a reshape — exact.
Both stacks use the same rotate-half RoPE layout, so q/k need no permutation.

Routed experts (MoE families) are stacked once more: ours [layers, experts, *in, *out], HF one
[out, in] tensor per layer and expert ("{e}" in its name); an HF tensor is then one (layer, expert)
slice of ours, and `Index` is that (layer, expert) pair.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Literal

import numpy as np

from agentrefine_jax.models.config import ModelConfig

Path = tuple[str, ...]
# Which slice of a stacked parameter one HF tensor is: None (not per layer), a layer, or for
# per-expert rows a (layer, expert) pair.
Index = int | tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class Param:
    path: Path  # ours, e.g. ("layers", "wq"); per-layer rows are stacked on a leading "layers" axis
    hf: str  # transformers' name; "{i}" stands for the layer index
    dims: tuple[str, ...]  # our shape (without the layers axis) in `ModelConfig` dimension names
    axes: tuple[str, ...]  # logical axis names, same order as `dims`
    # linear: [*in, *out] <-> HF [out, in]; copy: same layout; flat: ours [*dims] <-> HF [prod(dims)]
    kind: Literal["linear", "copy", "flat"]
    n_in: int = 1  # linear: how many leading `dims` are the input side
    init: Literal["normal", "ones", "zeros"] = "normal"
    # Presence rule (None = always): "untied" = only when the output projection is not tied to
    # the embedding; "qkv_bias" / "qk_norm" = only in families whose row sets that flag
    # (models/families.py: q/k/v biases, q/k RMSNorm).
    # "moe" = only in families that route experts, "dense_mlp" = only in the others.
    when: Literal["untied", "qkv_bias", "qk_norm", "moe", "dense_mlp"] | None = None

    @property
    def per_layer(self) -> bool:
        return self.path[0] == "layers"

    @property
    def per_expert(self) -> bool:
        """One HF tensor per layer and expert; our `dims` then start with "experts"."""
        return "{e}" in self.hf


_L = "model.layers.{i}."  # transformers' per-layer prefix
_QKV = ("hidden", "heads", "head_dim")
_KV = ("hidden", "kv_heads", "head_dim")
_E = _L + "mlp.experts.{e}."  # one expert's projections

# fmt: off
TABLE: tuple[Param, ...] = (
    #      ours                     HF                                        dims (our shape)                    logical axes                           kind
    Param(("embed",),               "model.embed_tokens.weight",              ("vocab", "hidden"),                ("vocab", "embed"),                     "copy"),
    Param(("layers", "attn_norm"),  _L + "input_layernorm.weight",            ("hidden",),                        ("norm",),                              "copy", init="ones"),
    Param(("layers", "wq"),         _L + "self_attn.q_proj.weight",           _QKV,                               ("embed", "heads", "head_dim"),         "linear"),
    Param(("layers", "wk"),         _L + "self_attn.k_proj.weight",           _KV,                                ("embed", "kv_heads", "head_dim"),      "linear"),
    Param(("layers", "wv"),         _L + "self_attn.v_proj.weight",           _KV,                                ("embed", "kv_heads", "head_dim"),      "linear"),
    Param(("layers", "bq"),         _L + "self_attn.q_proj.bias",             ("heads", "head_dim"),              ("heads", "head_dim"),                  "flat", init="zeros", when="qkv_bias"),
    Param(("layers", "bk"),         _L + "self_attn.k_proj.bias",             ("kv_heads", "head_dim"),           ("kv_heads", "head_dim"),               "flat", init="zeros", when="qkv_bias"),
    Param(("layers", "bv"),         _L + "self_attn.v_proj.bias",             ("kv_heads", "head_dim"),           ("kv_heads", "head_dim"),               "flat", init="zeros", when="qkv_bias"),
    Param(("layers", "q_norm"),     _L + "self_attn.q_norm.weight",           ("head_dim",),                      ("head_dim",),                          "copy", init="ones", when="qk_norm"),
    Param(("layers", "k_norm"),     _L + "self_attn.k_norm.weight",           ("head_dim",),                      ("head_dim",),                          "copy", init="ones", when="qk_norm"),
    Param(("layers", "wo"),         _L + "self_attn.o_proj.weight",           ("heads", "head_dim", "hidden"),    ("heads", "head_dim", "embed"),         "linear", n_in=2),
    Param(("layers", "mlp_norm"),   _L + "post_attention_layernorm.weight",   ("hidden",),                        ("norm",),                              "copy", init="ones"),
    Param(("layers", "w_gate"),     _L + "mlp.gate_proj.weight",              ("hidden", "mlp"),                  ("embed", "mlp"),                       "linear", when="dense_mlp"),
    Param(("layers", "w_up"),       _L + "mlp.up_proj.weight",                ("hidden", "mlp"),                  ("embed", "mlp"),                       "linear", when="dense_mlp"),
    Param(("layers", "w_down"),     _L + "mlp.down_proj.weight",              ("mlp", "hidden"),                  ("mlp", "embed"),                       "linear", when="dense_mlp"),
    # Routed experts (models/moe.py): the router [hidden, experts], then per-expert projections
    # stacked on an "experts" axis (n_in counts the input dims after it).
    Param(("layers", "router"),     _L + "mlp.gate.weight",                   ("hidden", "experts"),              ("embed", "router_experts"),            "linear", when="moe"),
    Param(("layers", "we_gate"),    _E + "gate_proj.weight",                  ("experts", "hidden", "moe_mlp"),   ("experts", "embed", "moe_mlp"),        "linear", when="moe"),
    Param(("layers", "we_up"),      _E + "up_proj.weight",                    ("experts", "hidden", "moe_mlp"),   ("experts", "embed", "moe_mlp"),        "linear", when="moe"),
    Param(("layers", "we_down"),    _E + "down_proj.weight",                  ("experts", "moe_mlp", "hidden"),   ("experts", "moe_mlp", "embed"),        "linear", when="moe"),
    Param(("final_norm",),          "model.norm.weight",                      ("hidden",),                        ("norm",),                              "copy", init="ones"),
    Param(("lm_head",),             "lm_head.weight",                         ("hidden", "vocab"),                ("embed", "vocab"),                     "linear", when="untied"),
)
# fmt: on
BY_PATH: dict[Path, Param] = {p.path: p for p in TABLE}
LAYER_PARAMS: tuple[Param, ...] = tuple(p for p in TABLE if p.per_layer)
# The routed experts' projections in the order the expert MLP takes them: gate, up, down.
EXPERT_NAMES: tuple[str, ...] = tuple(p.path[1] for p in LAYER_PARAMS if p.per_expert)
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BY_HF_LAYER_SUFFIX = {p.hf.removeprefix(_L): p for p in LAYER_PARAMS}
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
_BY_HF_TOP = {p.hf: p for p in TABLE if not p.per_layer}


def dim_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {
        "vocab": cfg.vocab_size,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp": cfg.intermediate_size,
        "experts": cfg.num_experts,
        "moe_mlp": cfg.moe_intermediate_size,
    }


def holds(p: Param, cfg: ModelConfig) -> bool:
    """Whether a model under `cfg` holds row `p` (its presence rule)."""
    from agentrefine_jax.models import families

    if p.when == "untied":
        return not cfg.tie_embeddings
    if p.when in ("qkv_bias", "qk_norm", "moe"):
        return bool(getattr(families.get(cfg.family), p.when))
    if p.when == "dense_mlp":
        return not families.get(cfg.family).moe
    return True


def present(cfg: ModelConfig) -> tuple[Param, ...]:
    """The rows a model under `cfg` holds, in table order (e.g. no lm_head when tied)."""
    return tuple(p for p in TABLE if holds(p, cfg))


def layer_names(cfg: ModelConfig) -> tuple[str, ...]:
    """Names of the per-layer parameters a model under `cfg` holds (what the forward pass reads)."""
    return tuple(p.path[1] for p in present(cfg) if p.per_layer)


def shape(p: Param, cfg: ModelConfig, *, stacked: bool = True) -> tuple[int, ...]:
    """Our shape of `p`; with `stacked`, per-layer rows carry the leading layers axis."""
    sizes = dim_sizes(cfg)
    own = tuple(sizes[d] for d in p.dims)
    return (cfg.num_layers, *own) if stacked and p.per_layer else own


def slice_shape(p: Param, cfg: ModelConfig) -> tuple[int, ...]:
    """Our shape of the slice one HF tensor fills: one layer's, for per-expert rows one expert's."""
    own = shape(p, cfg, stacked=False)
    return own[1:] if p.per_expert else own


def logical_axes(p: Param) -> tuple[str, ...]:
    return ("layers", *p.axes) if p.per_layer else p.axes


def hf_shape_of(p: Param, cfg: ModelConfig) -> tuple[int, ...]:
    own = slice_shape(p, cfg)
    if p.kind == "copy":
        return own
    if p.kind == "flat":
        return (math.prod(own),)
    return (math.prod(own[p.n_in :]), math.prod(own[: p.n_in]))


def hf_name(p: Param, layer: Index = None) -> str:
    if p.per_expert:
        assert isinstance(layer, tuple), (p.hf, layer)
        return p.hf.format(i=layer[0], e=layer[1])
    return p.hf.format(i=layer) if p.per_layer else p.hf


def indices(p: Param, cfg: ModelConfig) -> list[Index]:
    """Every slice index of row `p` under `cfg`: one HF tensor each."""
    if p.per_expert:
        return [(i, e) for i in range(cfg.num_layers) for e in range(cfg.num_experts)]
    return list(range(cfg.num_layers)) if p.per_layer else [None]


def lookup_hf(name: str) -> tuple[Param, Index]:
    """HF tensor name -> (row, its Index). KeyError for a tensor we do not know."""
    if name in _BY_HF_TOP:
        return _BY_HF_TOP[name], None
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in _BY_HF_LAYER_SUFFIX:
        return _BY_HF_LAYER_SUFFIX[m.group(2)], int(m.group(1))
    e = _HF_EXPERT_RE.match(m.group(2)) if m else None
    if m and e and f"mlp.experts.{{e}}.{e.group(2)}" in _BY_HF_LAYER_SUFFIX:
        return _BY_HF_LAYER_SUFFIX[f"mlp.experts.{{e}}.{e.group(2)}"], (int(m.group(1)), int(e.group(1)))
    raise KeyError(f"unexpected tensor in HF checkpoint: {name}")


def hf_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The HF shape a tensor named `name` must have under `cfg` (KeyError for names that are not
    tensors of a model under `cfg`: unknown ones, rows its family does not hold, e.g. a q_norm in
    a Llama checkpoint, and layers past `num_layers`, which would be dropped or overwrite one)."""
    p, index = lookup_hf(name)
    if not holds(p, cfg):
        raise KeyError(f"unexpected tensor in HF checkpoint: {name}")
    layer, expert = index if isinstance(index, tuple) else (index, None)
    if layer is not None and layer >= cfg.num_layers:
        raise KeyError(f"unexpected tensor in HF checkpoint: {name} (the config has {cfg.num_layers} layers)")
    if expert is not None and expert >= cfg.num_experts:
        raise KeyError(
            f"unexpected tensor in HF checkpoint: {name} (the config has {cfg.num_experts} experts)"
        )
    return hf_shape_of(p, cfg)


def _more(items: list[str], what: str, limit: int = 8) -> str:
    """`; 5 more <what>: [...]` for the items after the first one named in full."""
    rest = items[1:]
    if not rest:
        return ""
    tail = f" (+{len(rest) - limit} more)" if len(rest) > limit else ""
    return f"; {len(rest)} more {what}: {rest[:limit]}{tail}"


def hf_set_problems(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, source: str) -> str | None:
    """What is wrong with a whole set of HF tensors {name: shape} against `cfg`, in one line (None
    when it is exactly the model's): missing tensors, extra ones (unknown, not held by the family, or
    layers past num_layers) and misshapen ones, each named; `source` says where `cfg` came from
    ("config.json"). Every import checks this before it writes or trains anything, so nothing is
    dropped, left at zero or overwritten silently."""
    extra, misshapen = [], []
    for name, got in sorted(shapes.items()):
        try:
            want = hf_shape(name, cfg)
        except KeyError:
            extra.append(name)
            continue
        if tuple(got) != want:
            misshapen.append(f"{name} has shape {tuple(got)}, {source} implies {want}")
    missing = sorted(expected_hf_names(cfg) - set(shapes))
    parts = []
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        parts.append(f"lacks {len(missing)} tensors: {missing[:10]}{more}")
    if extra:
        m = _HF_LAYER_RE.match(extra[0])
        e = _HF_EXPERT_RE.match(m.group(2)) if m else None
        past = m is not None and int(m.group(1)) >= cfg.num_layers
        why = f"{source} says {cfg.num_layers} layers" if past else f"not part of a {cfg.family} model"
        if not past and e is not None and cfg.num_experts and int(e.group(1)) >= cfg.num_experts:
            why = f"{source} says {cfg.num_experts} experts"
        parts.append(f"unexpected tensor in HF checkpoint: {extra[0]} ({why}){_more(extra, 'unexpected')}")
    if misshapen:
        parts.append(misshapen[0] + _more(misshapen, "misshapen"))
    return "; ".join(parts) or None


def expected_hf_names(cfg: ModelConfig) -> set[str]:
    names: set[str] = set()
    for p in present(cfg):
        names.update(hf_name(p, i) for i in indices(p, cfg))
    return names


def hf_order(cfg: ModelConfig) -> Iterator[tuple[str, Param, Index]]:
    """(HF name, row, index) in writing order: embed, layer 0..L-1 (a per-expert row's experts in
    order), final norm, lm_head."""
    rows = present(cfg)
    for p in rows:
        if p.path == ("embed",):
            yield hf_name(p), p, None
    for i in range(cfg.num_layers):
        for p in rows:
            if p.per_expert:
                for e in range(cfg.num_experts):
                    yield hf_name(p, (i, e)), p, (i, e)
            elif p.per_layer:
                yield hf_name(p, i), p, i
    for p in rows:
        if not p.per_layer and p.path != ("embed",):
            yield hf_name(p), p, None


def hf_to_ours(name: str, tensor: np.ndarray, cfg: ModelConfig) -> tuple[Path, Index, np.ndarray]:
    """One HF tensor -> (our path, its Index, array in our layout: the slice that Index names)."""
    p, layer = lookup_hf(name)
    if p.kind == "copy":
        return p.path, layer, tensor
    if p.kind == "flat":
        return p.path, layer, tensor.reshape(slice_shape(p, cfg))
    return p.path, layer, tensor.T.reshape(slice_shape(p, cfg))


def ours_to_hf(p: Param, array: np.ndarray, layer: Index = None) -> tuple[str, np.ndarray]:
    """One slice (`layer` names it, see `Index`) of a parameter in our layout -> (HF tensor name,
    HF-layout array)."""
    if p.kind == "copy":
        out = array
    elif p.kind == "flat":
        out = array.reshape(-1)
    else:
        n_in = math.prod(array.shape[: p.n_in])
        out = array.reshape(n_in, -1).T
    return hf_name(p, layer), np.ascontiguousarray(out)
