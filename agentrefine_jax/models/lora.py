"""LoRA adapters on the decoder's projections: shapes, logical axes, init, forward delta, merge.

For a frozen projection W stored [*in, *out] (see `params.py`), an adapter is A [*in, r] and
B [r, *out], stacked over layers like W; the forward adds (dropout(x) @ A) @ B * alpha / r.
B starts at zero, so a fresh adapter leaves the model's output unchanged. A and B carry the
logical axes of W's input/output sides plus "lora_rank" (no rule maps it: replicated), so they
shard by the same rules as the base. Adapters are kept in float32 whatever the base's dtype.

Routed experts (MoE families) get one adapter per expert: A [E, *in, r], B [E, r, *out] (stacked
over layers as well), applied by the grouped matmul like the expert weights (models/llama.py).

PEFT's layout (`peft_name`): lora_A.weight is [r, in] and lora_B.weight is [out, r], the
HF-layout factors of the same product, under `base_model.model.` + the HF module name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrefine_jax.models import params, quant
from agentrefine_jax.models.config import ModelConfig

# train.lora.targets name -> our layer parameter (the HF module is the table's hf name).
TARGETS: dict[str, str] = {
    "q": "wq",
    "k": "wk",
    "v": "wv",
    "o": "wo",
    "gate": "w_gate",
    "up": "w_up",
    "down": "w_down",
    # Routed experts (MoE families): one adapter per expert.
    "expert_gate": "we_gate",
    "expert_up": "we_up",
    "expert_down": "we_down",
}
# "int8": the QLoRA-style base, projections quantised with qwix (`quant.py`); "auto": the model's
# own param_dtype (a float32 model keeps a float32 base: no rounding the user did not ask for).
BASE_DTYPES = ("bfloat16", "float32", "int8", "auto")
RANK_AXIS = "lora_rank"
ADAPTER_DTYPE = "float32"

Adapters = dict[str, dict[str, Any]]  # {"wq": {"a": [L, *in, r], "b": [L, r, *out]}, ...}


def resolve_base_dtype(base_dtype: str, param_dtype: str) -> str:
    """`train.lora.base_dtype` as the run holds it: "auto" is the model's `param_dtype`."""
    return param_dtype if base_dtype == "auto" else base_dtype


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What the forward needs: which projections, rank, scale, dropout."""

    targets: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(TARGETS[t] for t in self.targets)

    @classmethod
    def of(cls, lora_cfg: Any) -> LoraSpec | None:
        """From a `train.lora` config; None when LoRA is off (rank 0)."""
        if lora_cfg is None or not lora_cfg.rank:
            return None
        return cls(
            tuple(lora_cfg.targets), int(lora_cfg.rank), float(lora_cfg.alpha), float(lora_cfg.dropout)
        )


def _row(name: str) -> params.Param:
    return params.BY_PATH[("layers", name)]


def missing_targets(targets: Any, cfg: ModelConfig) -> list[str]:
    """The `targets` a model under `cfg` does not hold (e.g. the dense MLP's in an MoE model)."""
    return [t for t in targets if not params.holds(_row(TARGETS[t]), cfg)]


def _check_held(spec: LoraSpec, cfg: ModelConfig) -> None:
    missing = missing_targets(spec.targets, cfg)
    if missing:
        raise ValueError(f"train.lora.targets {missing}: a {cfg.family} model has no such projections")


def shapes(spec: LoraSpec, cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    _check_held(spec, cfg)
    out = {}
    for name in spec.names:
        row = _row(name)
        own = params.slice_shape(row, cfg)
        lead = (cfg.num_layers, cfg.num_experts) if row.per_expert else (cfg.num_layers,)
        n_in = row.n_in
        out[name] = {
            "a": (*lead, *own[:n_in], spec.rank),
            "b": (*lead, spec.rank, *own[n_in:]),
        }
    return out


def max_rank(targets: Any, cfg: ModelConfig) -> int:
    """The largest useful rank over `targets`: min(fan-in, fan-out) of the smallest projection
    (a larger rank adds parameters and memory but no expressiveness)."""
    ranks = []
    for t in targets:
        row = _row(TARGETS[t])
        own = params.slice_shape(row, cfg)
        ranks.append(min(math.prod(own[: row.n_in]), math.prod(own[row.n_in :])))
    return min(ranks)


def logical_axes(spec: LoraSpec) -> dict[str, dict[str, tuple[str, ...]]]:
    out = {}
    for name in spec.names:
        row = _row(name)
        axes = params.logical_axes(row)[1:]  # without "layers"
        lead: tuple[str, ...] = ("layers",)
        if row.per_expert:
            lead, axes = ("layers", axes[0]), axes[1:]
        out[name] = {
            "a": (*lead, *axes[: row.n_in], RANK_AXIS),
            "b": (*lead, RANK_AXIS, *axes[row.n_in :]),
        }
    return out


def init(spec: LoraSpec, cfg: ModelConfig, key: jax.Array) -> Adapters:
    """A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PEFT's default bound), B = 0."""
    out: Adapters = {}
    for i, (name, s) in enumerate(shapes(spec, cfg).items()):
        lead = 2 if _row(name).per_expert else 1
        fan_in = math.prod(s["a"][lead:-1])
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), s["a"], ADAPTER_DTYPE, -bound, bound)
        out[name] = {"a": a, "b": jnp.zeros(s["b"], ADAPTER_DTYPE)}
    return out


def dropout_keys(spec: LoraSpec | None, key: jax.Array | None, num_layers: int) -> jax.Array | None:
    """One dropout key per layer when the adapters draw dropout (training with a key), else None."""
    if spec is None or key is None or spec.dropout <= 0:
        return None
    return jax.random.split(key, num_layers)


def delta(
    x: jax.Array, ab: dict[str, jax.Array], n_in: int, spec: LoraSpec, key: jax.Array | None
) -> jax.Array:
    """(dropout(x) @ A) @ B * alpha / r for one layer; x's last `n_in` dims meet A's first."""
    if key is not None and spec.dropout > 0:
        keep = jax.random.bernoulli(key, 1.0 - spec.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - spec.dropout), 0).astype(x.dtype)
    xa = jnp.tensordot(x, ab["a"].astype(x.dtype), axes=n_in)
    return jnp.tensordot(xa, ab["b"].astype(x.dtype), axes=1) * jnp.asarray(spec.scale, x.dtype)


def expert_matmul(layer_adapters: dict[str, Any] | None, spec: LoraSpec | None, key: jax.Array | None) -> Any:
    """The grouped matmul of the routed experts (`moe.GroupedMatmul`) with this layer's expert
    adapters' grouped deltas added, (dropout(x) @ A_e) @ B_e * alpha / r per expert e; None (the
    plain grouped matmul) when there are none."""
    from agentrefine_jax.models import moe

    held = {} if spec is None or layer_adapters is None else layer_adapters
    ours = {i: held[n] for i, n in enumerate(params.EXPERT_NAMES) if n in held}
    if not ours:
        return None

    def matmul(xs: jax.Array, w: jax.Array, sizes: jax.Array, which: int, first: Any = 0) -> jax.Array:
        y = moe.ragged_matmul(xs, w, sizes)
        ab = ours.get(which)
        if ab is None:
            return y
        if ab["a"].shape[0] != w.shape[0]:  # expert parallelism: w holds experts first.. of the stack
            ab = {n: jax.lax.dynamic_slice_in_dim(m, first, w.shape[0]) for n, m in ab.items()}
        name = params.EXPERT_NAMES[which]
        drop = None if key is None else jax.random.fold_in(key, spec.names.index(name))
        if drop is not None and spec.dropout > 0:  # as `delta`: dropout on the input
            keep = jax.random.bernoulli(drop, 1.0 - spec.dropout, xs.shape)
            xs = jnp.where(keep, xs / (1.0 - spec.dropout), 0).astype(xs.dtype)
        xa = moe.ragged_matmul(xs, ab["a"].astype(xs.dtype), sizes)
        return y + moe.ragged_matmul(xa, ab["b"].astype(xs.dtype), sizes) * jnp.asarray(spec.scale, xs.dtype)

    return matmul


def merged_weight(
    w: jax.Array, ab: dict[str, jax.Array], n_in: int, spec: LoraSpec, dtype: Any = None
) -> jax.Array:
    """W + A @ B * alpha / r, in float32, cast to `dtype` (default W's; leading layers axis kept)."""
    a, b = ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32)
    lead = a.ndim - n_in - 1  # 1 for stacked adapters, 0 for one layer's
    ein_a = "xyz"[:lead] + "ijk"[:n_in] + "r"
    ein_b = "xyz"[:lead] + "r" + "uvw"[: b.ndim - lead - 1]
    out = ein_a[:-1] + ein_b[lead + 1 :]
    ab_prod = jnp.einsum(f"{ein_a},{ein_b}->{out}", a, b)
    return (w.astype(jnp.float32) + ab_prod * spec.scale).astype(dtype or w.dtype)


def merge(base: dict[str, Any], adapters: Adapters, spec: LoraSpec, dtype: Any = None) -> dict[str, Any]:
    """The base's pure-dict params with every adapter folded into its projection; with `dtype`,
    every tensor is cast to it (the merge itself is float32). An int8 base is dequantised first."""
    base = quant.dequantize_base(base)
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    layers = {k: cast(v) for k, v in base["layers"].items()}
    for name, ab in adapters.items():
        layers[name] = merged_weight(base["layers"][name], ab, _row(name).n_in, spec, dtype)
    return {**{k: cast(v) for k, v in base.items() if k != "layers"}, "layers": layers}


# ------------------------------------------------------------------------------ PEFT layout


def peft_module(name: str, layer: int) -> str:
    """transformers' module path of our projection `name` in `layer`, e.g. model.layers.0.self_attn.q_proj."""
    return params.hf_name(_row(name), layer).removesuffix(".weight")


def _no_expert_targets(spec: LoraSpec) -> None:
    experts = [t for t in spec.targets if _row(TARGETS[t]).per_expert]
    if experts:
        raise ValueError(
            f"PEFT adapters of routed experts {experts} are not supported (transformers 5 fuses the "
            "experts into one tensor); export the merged model instead"
        )


def peft_target_modules(spec: LoraSpec) -> list[str]:
    _no_expert_targets(spec)
    return [params.hf_name(_row(n), 0).removesuffix(".weight").rsplit(".", 1)[1] for n in spec.names]


def to_peft(adapters: Adapters, spec: LoraSpec) -> dict[str, np.ndarray]:
    """PEFT tensor names -> float32 arrays: lora_A [r, in], lora_B [out, r] per layer."""
    _no_expert_targets(spec)
    out: dict[str, np.ndarray] = {}
    for name, ab in adapters.items():
        a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
        for i in range(a.shape[0]):
            prefix = f"base_model.model.{peft_module(name, i)}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, spec.rank).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(spec.rank, -1).T)
    return out
