"""A LoRA run's frozen base: its reference in the checkpoint (`lora_reference`), its identity
(`weights_digest` of an HF directory, `shapes_digest` of a random model; `check_lora_base`), and
the one rebuild (`rebuild_base`) that both the trainer (start and resume) and every loader
(`load_lora`, `load_merged`: generate, serve, eval) use, so the base the adapters meet is the
same bit for bit.

Two models come out of a LoRA run. The *trained* model is the base as the run held it
(`train.lora.base_dtype`: possibly rounded to bfloat16 or quantised to int8) plus the adapters:
what the loss saw, and what inference loads. The *hand-off* (`load_handoff`) is the adapters
merged in float32 into the base as the user has it — the init_from_hf directory's tensors at
their stored precision — which is what PEFT on the adapter export computes, and what the merged
export writes. They differ only when training rounded the base (`base_rounding`, recorded in
the checkpoint); `export verify` measures by how much.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from agentrefine_jax.checkpoint.format import ITEM_PARAMS, compare_trees, leaves
from agentrefine_jax.checkpoint.integrity import file_digests, open_step
from agentrefine_jax.checkpoint.meta import CheckpointMeta, LoraBase, LoraMeta
from agentrefine_jax.config import Config
from agentrefine_jax.models import llama, lora, quant
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.paths import as_path, is_url
from agentrefine_jax.sharding import logical_to_spec, param_shardings


def weights_digest(hf_dir: str | os.PathLike[str]) -> str:
    """sha256 over the (name, size, sha256) of every *.safetensors file of an HF directory: the
    identity of a LoRA run's frozen base (other weights of the same shapes give another digest)."""
    d = as_path(hf_dir)
    names = sorted(p.name for p in d.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"{d} holds no *.safetensors weights")
    h = hashlib.sha256()
    for name, (size, digest) in zip(names, file_digests(d, names), strict=True):
        h.update(f"{name}\0{size}\0{digest}\n".encode())
    return h.hexdigest()


def shapes_digest(model_cfg: ModelConfig) -> str:
    """sha256 of a model's parameter paths and shapes (a random LoRA base: with its seed, its identity)."""
    _, params = llama.abstract_params(model_cfg)
    rows = sorted(f"{k}:{tuple(v.shape)}" for k, v in leaves(nnx.to_pure_dict(params)).items())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def lora_base_identity(base: LoraBase, model_cfg: ModelConfig) -> LoraBase:
    """`base` with what identifies it now: the sha256 of its HF directory's weights, or the
    shapes of a random base (whose `seed` the reference holds)."""
    if base.init_from_hf is not None:
        return dataclasses.replace(base, sha256=weights_digest(_hf_base_dir(base)), shapes=None)
    return dataclasses.replace(base, sha256=None, shapes=shapes_digest(model_cfg))


def check_lora_base(stored: LoraBase, now: LoraBase, *, what: str) -> None:
    """Refuse a LoRA base (identity `now`) that is not the one the adapters were trained on
    (`stored`, the checkpoint's reference); runs from before identities were recorded pass."""
    if stored.sha256 and now.sha256 and stored.sha256 != now.sha256:
        raise ValueError(
            f"{what}: the LoRA base {stored.init_from_hf} (train.init_from_hf) holds other "
            f"weights than the adapters were trained on (the sha256 of its safetensors files "
            f"differs); refusing to apply them to another base. Restore the original weights."
        )
    if stored.shapes and now.shapes and stored.shapes != now.shapes:
        raise ValueError(
            f"{what}: the LoRA run's random base (seed {stored.seed}) has other parameter "
            f"shapes than the adapters were trained on; refusing to apply them"
        )


def lora_reference(cfg: Config) -> LoraMeta:
    """What a LoRA checkpoint stores instead of the frozen base: how to rebuild it exactly, with
    the base's identity (checked on resume, merge, export and load: same-shape other weights put
    in the init_from_hf directory must not silently become the base), its dtype as held ("auto"
    resolved) and whether holding it so rounded the directory's weights."""
    lc = cfg.train.lora
    hf = cfg.train.init_from_hf
    base = LoraBase(init_from_hf=str(hf)) if hf else LoraBase(seed=cfg.train.seed)
    base_dtype = lora.resolve_base_dtype(lc.base_dtype, cfg.model.param_dtype)
    return LoraMeta(
        lc.rank,
        lc.alpha,
        lc.dropout,
        tuple(lc.targets),
        base_dtype,
        lora_base_identity(base, cfg.model),
        base_rounding(base, base_dtype),
    )


def base_rounding(base: LoraBase, base_dtype: str) -> tuple[str, str] | None:
    """(stored dtype, base_dtype) when holding the HF base in `base_dtype` rounds or quantises
    some of its tensors; None when it keeps them exactly, or when the base came from no
    directory (then the run's own base is the user's base)."""
    if base.init_from_hf is None:
        return None
    from agentrefine_jax.hf.io import hf_storage_dtypes, precision_rank

    stored = sorted(hf_storage_dtypes(_hf_base_dir(base)), key=precision_rank)
    if not stored:
        return None
    widest = stored[-1]
    if base_dtype == "int8" or precision_rank(widest) > precision_rank(base_dtype):
        return widest, base_dtype
    return None


def trained_base_rounding(meta: CheckpointMeta) -> tuple[str, str] | None:
    """The rounding a checkpoint's run applied to its base (`base_rounding`): recorded in its
    meta, or worked out from its base directory for a run from before it was recorded. None for
    a run that is no LoRA run or kept its base exactly: its trained model is its hand-off."""
    ref = meta.lora
    if ref is None:
        return None
    return ref.base_rounding or base_rounding(ref.base, ref.base_dtype)


def _hf_base_dir(base: LoraBase) -> str:
    hf_dir = str(base.init_from_hf)
    if not pathlib.Path(hf_dir).is_dir() and not is_url(hf_dir):
        raise FileNotFoundError(f"the LoRA run's base {hf_dir} (train.init_from_hf) is missing")
    return hf_dir


def base_config(model_cfg: ModelConfig, base_dtype: str) -> ModelConfig:
    """The frozen base's own config: stored in `base_dtype` (int8: built in bfloat16, quantised after)."""
    return dataclasses.replace(model_cfg, param_dtype=quant.storage_dtype(base_dtype))


def rebuild_base(base: LoraBase, base_cfg: ModelConfig, *, mesh: Mesh | None, rules: Any) -> dict[str, Any]:
    """The frozen base's parameters (pure dict, in `base_cfg.param_dtype`, not yet quantised)
    from its reference: the HF directory read afresh, or the random model drawn from its seed."""
    if base.init_from_hf is not None:
        from agentrefine_jax.hf.io import load_hf_model  # the base's own format

        _, model = load_hf_model(_hf_base_dir(base), mesh=mesh, rules=rules, param_dtype=base_cfg.param_dtype)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))
    _, abs_base = llama.abstract_params(base_cfg)
    seed = int(base.seed or 0)
    return jax.jit(
        lambda: nnx.to_pure_dict(nnx.state(llama.create(base_cfg, seed), nnx.Param)),
        out_shardings=param_shardings(abs_base, mesh, rules),
    )()


def load_lora(
    path: str | pathlib.Path | epath.Path,
    meta: CheckpointMeta | None = None,
    *,
    mesh: Mesh | None = None,
    rules: Any = None,
    **overrides: Any,
) -> tuple[ModelConfig, dict[str, Any], Any, dict[str, Any]]:
    """A LoRA run's (base config, frozen base params, LoraSpec, adapters), the base rebuilt
    bit for bit from the checkpoint's reference (the HF dir it started from, or its seed)."""
    if meta is None:
        root, step, meta = open_step(path)
        path = root / str(step)
    ref = meta.lora
    if ref is None:
        raise ValueError(f"checkpoint {path} is not a LoRA run (its meta has no 'lora' entry)")
    spec = lora.LoraSpec(ref.targets, ref.rank, ref.alpha, ref.dropout)
    overrides.pop("param_dtype", None)
    # The identity is of the layout the run used (overrides may change it).
    check_lora_base(ref.base, lora_base_identity(ref.base, meta.model), what=f"LoRA checkpoint {path}")
    base_cfg = dataclasses.replace(base_config(meta.model, ref.base_dtype), **overrides)
    base = rebuild_base(ref.base, base_cfg, mesh=mesh, rules=rules)
    if ref.base_dtype == "int8":  # re-quantised as the run did; handed out dequantised, float32
        base = jax.jit(lambda b: quant.dequantize_base(quant.quantize_base(b)))(base)
        base_cfg = dataclasses.replace(base_cfg, param_dtype="float32")
    return base_cfg, base, spec, _restore_adapters(path, spec, base_cfg, mesh, rules)


def _restore_adapters(
    path: str | pathlib.Path | epath.Path,
    spec: lora.LoraSpec,
    base_cfg: ModelConfig,
    mesh: Mesh | None,
    rules: Any,
) -> dict[str, Any]:
    """The step's adapters, checked against its lora settings before they are read."""
    target = _adapter_target(spec, base_cfg, mesh, rules)
    params_dir = epath.Path(path) / ITEM_PARAMS
    problems = compare_trees(
        target, ocp.StandardCheckpointHandler().metadata(params_dir).tree, what="adapter"
    )
    if problems:
        raise ValueError(
            f"LoRA checkpoint {params_dir} does not match its lora settings: " + "; ".join(problems)
        )
    return ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        params_dir, args=ocp.args.StandardRestore(target)
    )


def load_merged(
    path: str | pathlib.Path | epath.Path,
    meta: CheckpointMeta,
    model_cfg: ModelConfig,
    *,
    mesh: Mesh | None,
    rules: Any,
    **changes: Any,
) -> llama.Transformer:
    """A LoRA step as the model it describes: the base rebuilt, the adapters merged into it in
    float32 and cast to `model_cfg.param_dtype` (`load_model`: generate, serve, eval, export)."""
    _, base, spec, adapters = load_lora(path, meta, mesh=mesh, rules=rules, **changes)
    merged = lora.merge(base, adapters, spec, dtype=model_cfg.param_dtype)
    graphdef, abs_params = llama.abstract_params(model_cfg)
    nnx.replace_by_pure_dict(abs_params, merged)
    return nnx.merge(graphdef, abs_params)


def load_handoff(
    path: str | pathlib.Path | epath.Path,
    meta: CheckpointMeta,
    model_cfg: ModelConfig,
    *,
    mesh: Mesh | None,
    rules: Any,
    **changes: Any,
) -> llama.Transformer:
    """A LoRA step as it is handed off (merged export; PEFT on the adapter export computes the
    same): the adapters merged in float32 into the base as the user has it — the init_from_hf
    directory's tensors at their stored precision (read into float32, exactly), every tensor the
    adapters do not target left as stored — or, for a base from no directory, the run's own base
    (int8: dequantised, as the adapter export's `base/` holds it). Cast to `model_cfg.param_dtype`
    (float32 keeps every tensor exact)."""
    ref = meta.lora
    if ref is None:
        raise ValueError(f"checkpoint {path} is not a LoRA run (its meta has no 'lora' entry)")
    if ref.base.init_from_hf is None:
        _, base, spec, adapters = load_lora(path, meta, mesh=mesh, rules=rules, **changes)
    else:
        spec = lora.LoraSpec(ref.targets, ref.rank, ref.alpha, ref.dropout)
        check_lora_base(ref.base, lora_base_identity(ref.base, meta.model), what=f"LoRA checkpoint {path}")
        changes.pop("param_dtype", None)
        base_cfg = dataclasses.replace(meta.model, **changes, param_dtype="float32")
        base = rebuild_base(ref.base, base_cfg, mesh=mesh, rules=rules)
        adapters = _restore_adapters(path, spec, base_cfg, mesh, rules)
    merged = lora.merge(base, adapters, spec, dtype=model_cfg.param_dtype)
    graphdef, abs_params = llama.abstract_params(model_cfg)
    nnx.replace_by_pure_dict(abs_params, merged)
    return nnx.merge(graphdef, abs_params)


def _adapter_target(
    spec: lora.LoraSpec, base_cfg: ModelConfig, mesh: Mesh | None, rules: Any
) -> dict[str, Any]:
    """ShapeDtypeStructs of the adapters, sharded by the base's logical-axis rules (or on one device)."""
    shapes, axes = lora.shapes(spec, base_cfg), lora.logical_axes(spec)

    def sharding(n: str, f: str) -> Any:
        if mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return jax.sharding.NamedSharding(mesh, logical_to_spec(axes[n][f], rules or (), shapes[n][f], mesh))

    dtype = jnp.dtype(lora.ADAPTER_DTYPE)
    return {
        n: {f: jax.ShapeDtypeStruct(shapes[n][f], dtype, sharding=sharding(n, f)) for f in "ab"}
        for n in shapes
    }
