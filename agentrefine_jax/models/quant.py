"""The QLoRA-style int8 frozen base (`train.lora.base_dtype=int8`), quantised with qwix.

The decoder's seven projection weights (q, k, v, o, gate, up, down; targeted by LoRA or not) are
held as qwix `QArray`s in the params pytree: int8 values of W's shape and one float32 scale per
layer and output channel (symmetric absmax over the input axes, qwix's `quantize`). Embeddings,
norms and the LM head stay bfloat16. The base is built in bfloat16 (random init or HF import) and
quantised once, by `quantize_base` on the materialised bfloat16 arrays, so a resumed run and
`checkpoint.load_lora` re-quantise bit for bit what the run was tuned on (absmax, an elementwise
division and rounding do not depend on sharding or reduction order). Layers dequantise their own
weights to the compute dtype inside the scanned layer body, so only one layer's weights exist in
full precision at a time.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from agentrefine_jax.models import params

# The dense projections (the router and routed experts of MoE families are not quantised).
QUANTIZED = tuple(p.path[1] for p in params.LAYER_PARAMS if p.kind == "linear" and p.when != "moe")
SOURCE_DTYPE = "bfloat16"  # the dtype the base is built in before it is quantised
SCALE_DTYPE = jnp.float32
QTYPE = jnp.int8


def storage_dtype(base_dtype: str) -> str:
    """The model param_dtype the base is created or imported in (before any quantisation)."""
    return SOURCE_DTYPE if base_dtype == "int8" else base_dtype


def _qwix() -> Any:
    try:
        import qwix
    except ImportError as e:  # a main dependency; say what is missing rather than a traceback
        raise RuntimeError(f"train.lora.base_dtype=int8 needs qwix (pip install qwix): {e}") from None
    return qwix


def _channel_axes(name: str, ndim: int) -> tuple[int, ...]:
    """Stacked W is [layers, *in, *out]: one scale per layer and output channel."""
    n_in = params.BY_PATH[("layers", name)].n_in
    return (0, *range(1 + n_in, ndim))


def scale_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales of projection `name` quantised from `shape` (a global or a per-device shard's
    shape: the scales shard as W along the axes they keep)."""
    keep = _channel_axes(name, len(shape))
    return tuple(d if i in keep else 1 for i, d in enumerate(shape))


def quantize_base(base: dict[str, Any]) -> dict[str, Any]:
    """A base's pure-dict params with every projection replaced by an int8 QArray."""
    qwix = _qwix()
    layers = dict(base["layers"])
    for name in (n for n in QUANTIZED if n in layers):  # an MoE model holds no dense MLP
        w = layers[name].astype(jnp.float32)  # scales computed in float32 whatever W's dtype
        layers[name] = qwix.quantize(w, QTYPE, channelwise_axes=_channel_axes(name, w.ndim))
    return {**base, "layers": layers}


def is_quantized(x: Any) -> bool:
    qwix = sys.modules.get("qwix")  # not imported yet: nothing can be a QArray (bf16/f32 bases)
    return qwix is not None and isinstance(x, qwix.QArray)


def dequantize(w: Any, dtype: Any) -> jax.Array:
    """A projection weight in `dtype`: int8 x scale (in float32) for a QArray, else a cast."""
    if is_quantized(w):
        return _qwix().dequantize(w).astype(dtype)
    return w.astype(dtype)


def dequantize_base(base: dict[str, Any], dtype: Any = jnp.float32) -> dict[str, Any]:
    """The base with every QArray dequantised to `dtype` (other tensors untouched)."""
    layers = {k: dequantize(v, dtype) if is_quantized(v) else v for k, v in base["layers"].items()}
    return {**base, "layers": layers}


def shardings(base_shardings: dict[str, Any]) -> dict[str, Any]:
    """Shardings of the quantised base: int8 values as W; scales as W along the output axes
    (their input axes have size 1, so those are replicated)."""
    qwix = _qwix()
    layers = dict(base_shardings["layers"])
    for name in (n for n in QUANTIZED if n in layers):
        s: NamedSharding = layers[name]
        row = params.BY_PATH[("layers", name)]
        spec = list(s.spec) + [None] * (len(params.logical_axes(row)) - len(s.spec))
        spec[1 : 1 + row.n_in] = [None] * row.n_in
        scale = NamedSharding(s.mesh, PartitionSpec(*spec))
        layers[name] = qwix.QArray(s, scale, None, QTYPE)
    return {**base_shardings, "layers": layers}
