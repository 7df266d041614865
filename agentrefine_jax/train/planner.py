"""Memory / FLOP planner for a training config on a TPU mesh that need not exist here.

    python -m agentrefine_jax.plan --config llama3_8b --mesh fsdp=32 --chip v5p [--json]
    (the CLI is agentrefine_jax/plan/cli.py; this module is the model behind it)

Nothing here is a closed-form formula that could drift from the model:
- parameters, their dtypes and logical axes come from `jax.eval_shape` of the real model;
- each leaf's per-device shard shape comes from the real sharding rules
  (`sharding.logical_to_spec`) on a `jax.sharding.AbstractMesh` of the requested shape;
- saved activations are the residuals JAX's autodiff keeps for the real loss function
  (`train.step.loss_sums`, with the config's remat policy and attention blocking), traced
  on the *per-device* problem: micro batch / batch shards, heads / mlp / vocab / tensor.
Only the transient working set of the backward pass (one layer's recomputation, attention
score blocks, a loss chunk's logits, FSDP-gathered weights) is modelled by hand; every
term is listed in `activation_breakdown` and documented in docs/scale.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from agentrefine_jax.models.execution import attention_kernel, resolve
from agentrefine_jax.models.lora import resolve_base_dtype
from agentrefine_jax.sharding import MESH_AXES, parse_mesh_sizes, spec_size
from agentrefine_jax.train.topology import HBM_BYTES, PEAK_FLOPS, GiB


class PlanError(ValueError):
    """Bad planner input (mesh syntax, unknown chip, batch/mesh mismatch)."""


# ------------------------------------------------------------------------------ mesh


def parse_mesh(text: str | None, default: dict[str, int], devices: int | None = None) -> dict[str, int]:
    """`fsdp=64,tensor=4,data=2` -> {"data": 2, "fsdp": 64, "tensor": 4}.

    Axes not named keep the config's size; one axis may be -1 ("the rest") only when
    `devices` is given.
    """
    if devices is not None and devices < 1:
        raise PlanError(f"--devices must be >= 1, got {devices}")
    sizes = dict(default)
    if text:
        try:
            sizes.update(parse_mesh_sizes(text))
        except ValueError as e:
            raise PlanError(str(e)) from None
    bad = {k: v for k, v in sizes.items() if v == 0 or v < -1}
    if bad:
        raise PlanError(f"--mesh: sizes must be positive (or -1 for 'the rest'), got {bad}")
    unknown = [k for k, v in sizes.items() if v == -1]
    if len(unknown) > 1:
        raise PlanError(f"at most one mesh axis may be -1, got {sizes}")
    if unknown:
        if devices is None:
            raise PlanError(
                f"mesh axis {unknown[0]!r} is -1 (all remaining devices) in the config; give its size "
                f"with --mesh {unknown[0]}=N, or the device count with --devices N"
            )
        known = math.prod(v for v in sizes.values() if v != -1)
        if devices % known:
            raise PlanError(f"{devices} devices do not divide into mesh {sizes}")
        sizes[unknown[0]] = devices // known
    if devices is not None and math.prod(sizes.values()) != devices:
        raise PlanError(f"mesh {sizes} has {math.prod(sizes.values())} devices, --devices says {devices}")
    return {a: sizes[a] for a in MESH_AXES}


def abstract_mesh(sizes: dict[str, int]) -> Any:
    from jax.sharding import AbstractMesh

    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def shard_shape(shape: Sequence[int], spec: Any, mesh: Any) -> tuple[int, ...]:
    """Per-device shape of an array with PartitionSpec `spec` (logical_to_spec only emits
    axes that divide their dimension, so the division is exact)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    return tuple(d // spec_size(e, mesh) for d, e in zip(shape, entries, strict=True))


# -------------------------------------------------------------------------- parameters


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...] | None
    spec: tuple[Any, ...]
    shard_shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_size(self) -> int:
        return math.prod(self.shard_shape)


def param_layout(model_cfg: Any, mesh: Any, rules: Sequence[tuple[str, Any]]) -> list[LeafLayout]:
    """Every parameter of the real model (abstract, no memory) with its per-device shard."""
    from flax import nnx

    from agentrefine_jax.models import abstract

    state = nnx.state(abstract(model_cfg), nnx.Param)
    out = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        path_str = ".".join(str(p) for p in path)
        out.append(
            _leaf_layout(path_str, value.shape, value.dtype, var.get_metadata().get("axes"), mesh, rules)
        )
    return out


def _leaf_layout(
    path: str, shape: Sequence[int], dtype: Any, names: Sequence[str] | None, mesh: Any,
    rules: Sequence[tuple[str, Any]],
) -> LeafLayout:  # fmt: skip
    """One array with logical axes `names`, sharded by `rules` on `mesh`."""
    from jax.sharding import PartitionSpec

    from agentrefine_jax.sharding import logical_to_spec

    spec = logical_to_spec(names, rules, tuple(shape), mesh) if names else PartitionSpec()
    return LeafLayout(
        path=path,
        shape=tuple(shape),
        dtype=str(dtype),
        axes=tuple(names) if names else None,
        spec=tuple(spec),
        shard_shape=shard_shape(tuple(shape), spec, mesh),
    )


def matmul_params(layout: list[LeafLayout], tie_embeddings: bool, active_experts: float = 1.0) -> int:
    """Weights that enter a matmul (flops.py convention): every >= 2-D leaf except the
    embedding table, which is a lookup -- unless tied, when it is also the output projection.
    Routed experts' leaves count `active_experts` (k / E) of their size: what one token runs."""
    from agentrefine_jax.models import params

    def per_expert(path: str) -> bool:
        row = params.BY_PATH.get(tuple(path.split(".")))
        return row is not None and row.per_expert

    return int(
        sum(
            leaf.size * (active_experts if per_expert(leaf.path) else 1.0)
            for leaf in layout
            if len(leaf.shape) >= 2 + leaf.path.startswith("layers.")
            and (leaf.path != "embed" or tie_embeddings)
        )
    )


# ------------------------------------------------------------------------- activations


def _itemsize(dtype: Any) -> int:
    import numpy as np

    return int(np.dtype(dtype).itemsize)


def _local_dim(name: str, size: int, rules: Sequence[tuple[str, Any]], mesh: Any) -> int:
    """Per-device size of an activation dimension with logical name `name`."""
    from agentrefine_jax.sharding import logical_to_spec

    spec = logical_to_spec((name,), rules, (size,), mesh)
    return size // spec_size(tuple(spec)[0], mesh)


def local_model_config(model_cfg: Any, mesh: Any, rules: Sequence[tuple[str, Any]]) -> tuple[Any, list[str]]:
    """The model one device effectively runs: heads / kv heads / mlp / vocab divided by
    their activation shardings (tensor parallelism). Layers, hidden and head_dim are kept."""
    notes = []
    heads = _local_dim("activation_heads", model_cfg.num_heads, rules, mesh)
    kv = _local_dim("activation_kv_heads", model_cfg.num_kv_heads, rules, mesh)
    if heads % kv:
        notes.append(
            f"heads shard to {heads} but kv heads to {kv} per device (not a multiple); "
            "attention activations counted unsharded"
        )
        heads, kv = model_cfg.num_heads, model_cfg.num_kv_heads
    for name in ("activation_seq", "activation_embed"):
        target = dict(rules).get(name)
        if target and any(mesh.shape[a] > 1 for a in ((target,) if isinstance(target, str) else target)):
            notes.append(f"{name} is sharded by the rules; the planner counts it unsharded (over-estimate)")
    local = dataclasses.replace(
        model_cfg,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=_local_dim("activation_mlp", model_cfg.intermediate_size, rules, mesh),
        vocab_size=_local_dim("activation_vocab", model_cfg.vocab_size, rules, mesh),
    )
    return local, notes


@dataclasses.dataclass(frozen=True)
class Residual:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


def saved_residuals(model_cfg: Any, batch: int, seq_len: int, loss_chunk: int) -> list[Residual]:
    """What autodiff of the real loss keeps for the backward pass (arguments excluded:
    the params and batch are held anyway). Traced only: shapes, no compute or memory."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from agentrefine_jax.data.packing import BATCH_KEYS
    from agentrefine_jax.models import abstract
    from agentrefine_jax.train.step import loss_sums

    # Plans are for accelerator chips: trace the TPU layout even on this CPU host, where
    # model.cpu_layout="auto" would pick the CPU layout (unrolled layers, flat attention).
    model_cfg = dataclasses.replace(model_cfg, cpu_layout=False)
    graphdef, state = nnx.split(abstract(model_cfg), nnx.Param)
    params = nnx.to_pure_dict(state)
    data = {k: jax.ShapeDtypeStruct((batch, seq_len), jnp.int32) for k in BATCH_KEYS}

    def loss(p: Any, b: Any) -> Any:
        return loss_sums(graphdef, p, b, loss_chunk)[0]

    closed = jax.make_jaxpr(lambda p, b: jax.vjp(loss, p, b)[1])(params, data)
    jaxpr = closed.jaxpr
    inputs = {id(v) for v in jaxpr.invars}
    out = []
    for v in jaxpr.outvars:
        if id(v) in inputs or not hasattr(v.aval, "shape"):
            continue
        shape = tuple(int(d) for d in v.aval.shape)
        out.append(Residual(shape, str(v.aval.dtype), math.prod(shape) * _itemsize(v.aval.dtype)))
    return out


# Transient working sets that are never live together, so the peak holds only the larger:
# the loss chunks run, and free their logits, before the layers' backward pass starts.
# (Calibrated against the XLA TPU compiler: summing them over-estimated the 8B step by 3 GiB,
# while Llama-3-8B and Mistral-7B, whose loss working sets differ 4x, need the same temp.)
PHASES = {
    "layer_backward": (
        "layer_recompute",
        "attention_blocks",
        "fsdp_gathered_layer_weights",
        "fsdp_gathered_layer_grads",
    ),
    "loss": ("logits_chunk", "fsdp_gathered_lm_head"),
}


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """Per-device activation bytes of each component = fixed + per_sample * micro_batch_per_device.

    The peak is every held component plus the larger of the `PHASES` working sets.
    """

    fixed: dict[str, int]
    per_sample: dict[str, int]

    def breakdown(self, batch: int) -> dict[str, int]:
        keys = list(dict.fromkeys([*self.fixed, *self.per_sample]))
        return {k: self.fixed.get(k, 0) + self.per_sample.get(k, 0) * batch for k in keys}

    def phases(self, batch: int) -> dict[str, int]:
        b = self.breakdown(batch)
        return {name: sum(b.get(k, 0) for k in keys) for name, keys in PHASES.items()}

    def peak_phase(self, batch: int) -> str:
        phases = self.phases(batch)
        return max(phases, key=lambda k: phases[k])

    def total(self, batch: int) -> int:
        phased = {k for keys in PHASES.values() for k in keys}
        held = sum(v for k, v in self.breakdown(batch).items() if k not in phased)
        return held + max(self.phases(batch).values())

    def max_batch(self, room: int) -> int:
        """Largest micro batch per device whose activations fit `room` bytes (0 if none)."""
        if self.total(1) > room:
            return 0
        lo, hi = 1, 2
        while self.total(hi) <= room and hi < 1 << 24:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # total() is non-decreasing in the batch
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.total(mid) <= room else (lo, mid)
        return lo


def activation_model(
    model_cfg: Any,
    mesh: Any,
    rules: Sequence[tuple[str, Any]],
    seq_len: int,
    loss_chunk: int,
) -> tuple[ActivationModel, list[str]]:
    local, notes = local_model_config(model_cfg, mesh, rules)
    c = _itemsize(model_cfg.dtype)
    # Residuals at micro batch 1 and 2: those that grow are activations (exactly linear in
    # the batch); those that don't are derived from weights (e.g. compute-dtype copies) and
    # are sharded like the weights over fsdp.
    r1 = saved_residuals(local, 1, seq_len, loss_chunk)
    r2 = saved_residuals(local, 2, seq_len, loss_chunk)
    if [r.dtype for r in r1] != [r.dtype for r in r2]:
        raise RuntimeError("residual structure changed with the batch size; cannot classify")
    per_sample_saved = sum(a.nbytes for a, b in zip(r1, r2, strict=True) if b.nbytes != a.nbytes)
    weight_derived = sum(a.nbytes for a, b in zip(r1, r2, strict=True) if b.nbytes == a.nbytes)
    fsdp_factor = model_cfg.hidden_size // _local_dim("embed", model_cfg.hidden_size, rules, mesh)

    # One layer's full set of intermediates (remat "none", one vs two layers): what the
    # backward pass rebuilds for the layer it is differentiating, whatever the policy.
    def one_layer(cfg: Any) -> int:
        cfg = dataclasses.replace(cfg, remat_policy="none")
        l1 = saved_residuals(dataclasses.replace(cfg, num_layers=1), 1, seq_len, loss_chunk)
        l2 = saved_residuals(dataclasses.replace(cfg, num_layers=2), 1, seq_len, loss_chunk)
        return sum(r.nbytes for r in l2) - sum(r.nbytes for r in l1)

    layer_recompute = one_layer(local)
    mlp_chunk = model_cfg.mlp_chunk_size
    if 0 < mlp_chunk < seq_len and seq_len % mlp_chunk == 0:
        # Chunked MLP (models/llama.mlp_in_chunks): each chunk is rematerialised on its own, so
        # the trace above saw only the chunks' inputs; one chunk's share of the MLP's
        # intermediates (the difference to the unchunked layer) is rebuilt at a time.
        whole = one_layer(dataclasses.replace(local, mlp_chunk_size=0))
        layer_recompute += (whole - layer_recompute) * mlp_chunk // seq_len

    blk = model_cfg.attention_block_size
    blocked = 0 < blk < seq_len and seq_len % blk == 0
    attention_blocks = 0
    mask = 0
    # The splash kernel (TPU default) tiles scores in VMEM and builds its mask per tile from the
    # segment ids: no score block or [S, S] mask in HBM (8B v5p-64, libtpu 0.0.42.1: temp 17.41 -> 13.37 GiB).
    if attention_kernel(model_cfg, "tpu") != "splash":
        if blocked:
            # Scores (f32), probabilities (compute dtype) and score cotangents (f32) of one
            # query block, rebuilt inside the block's checkpoint.
            attention_blocks = local.num_heads * blk * seq_len * (4 + c + 4)
        # The [S, S] boolean document/causal mask is built whole, even with query blocks.
        mask = seq_len * seq_len
    chunk = max(1, min(loss_chunk, seq_len))
    # Logits, softmax and logit cotangents (all f32) of one loss chunk. The loss joins a device's
    # rows into one before chunking (train/loss.py), so a chunk is `chunk` tokens whatever the
    # micro batch: a fixed working set, not one per sample.
    logits_chunk = chunk * local.vocab_size * 4 * 3

    fixed = {"weight_derived_saved": weight_derived // fsdp_factor, "logits_chunk": logits_chunk}
    if _itemsize(model_cfg.param_dtype) != c:
        # The XLA TPU compiler hoists the cast of the stacked (scanned) layer weights out of the
        # layer loop: a compute-dtype copy of this device's shard of every layer lives for the
        # whole step (seen in its memory-usage report; 1.03 GiB per device for the 70B).
        fixed["compute_dtype_layer_weights"] = sum(
            leaf.shard_size * c
            for leaf in param_layout(model_cfg, mesh, rules)
            if leaf.path.startswith("layers.")
        )
    if fsdp_factor > 1:
        # FSDP all-gathers one layer's weights (compute dtype) ahead of use (two in flight)
        # and holds one layer's gradient (param dtype) before the reduce-scatter; the output
        # projection is gathered whole for the loss. "Gathered" = sharded by tensor only.
        unsharded = abstract_mesh({**{a: mesh.shape[a] for a in MESH_AXES}, "data": 1, "fsdp": 1})
        gathered_layout = param_layout(model_cfg, unsharded, rules)
        per_layer = sum(
            leaf.shard_size // leaf.shape[0] for leaf in gathered_layout if leaf.path.startswith("layers.")
        )
        fixed["fsdp_gathered_layer_weights"] = 2 * per_layer * c
        fixed["fsdp_gathered_layer_grads"] = per_layer * _itemsize(model_cfg.param_dtype)
        fixed["fsdp_gathered_lm_head"] = model_cfg.hidden_size * local.vocab_size * c
    per_sample = {
        "saved_residuals": per_sample_saved,
        "layer_recompute": layer_recompute,
        "attention_blocks": attention_blocks,
        "attention_mask": mask,
    }
    return ActivationModel(fixed, per_sample), notes


# -------------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """What the step holds as parameters, per device, by the run's parameter mode
    (train/param_mode.py): all of them trained, or a frozen LoRA base (in `train.lora.base_dtype`;
    int8 = int8 values + float32 scales) beside the float32 adapters that are trained."""

    layout: list[LeafLayout]  # the model's (a LoRA run's base, in its stored dtype)
    held: int  # every parameter the step holds
    trained: int  # what is differentiated and optimised: all of it, or the adapters
    trained_count: int  # parameters, global
    mode: str  # full | lora | int8-lora
    # DPO on full fine-tuning also holds a frozen copy of the starting weights (LoRA: its base,
    # adapters off, is the reference: nothing more); docs/preference.md.
    reference: bool


def param_bytes(cfg: Any, mesh: Any, rules: Sequence[tuple[str, Any]]) -> ParamBytes:
    from agentrefine_jax.models import lora, quant
    from agentrefine_jax.train.param_mode import ParamMode

    mode = ParamMode.of(cfg)
    layout = param_layout(mode.model_cfg, mesh, rules)
    held = 0
    for leaf in layout:
        name = leaf.path.removeprefix("layers.")
        if mode.int8 and leaf.path.startswith("layers.") and name in quant.QUANTIZED:
            held += leaf.shard_size + math.prod(quant.scale_shape(name, leaf.shard_shape)) * 4
        else:
            held += leaf.shard_size * _itemsize(leaf.dtype)
    if mode.lora_spec is None:
        count = sum(leaf.size for leaf in layout)
        return ParamBytes(layout, held, held, count, mode.name, mode.reference)
    axes, shapes = lora.logical_axes(mode.lora_spec), lora.shapes(mode.lora_spec, mode.model_cfg)
    adapters = [
        _leaf_layout(f"lora.{name}.{part}", shape, lora.ADAPTER_DTYPE, axes[name][part], mesh, rules)
        for name, pair in shapes.items()
        for part, shape in pair.items()
    ]
    trained = sum(leaf.shard_size * _itemsize(leaf.dtype) for leaf in adapters)
    count = sum(leaf.size for leaf in adapters)
    return ParamBytes(layout, held + trained, trained, count, mode.name, mode.reference)


def _state_bytes(held: ParamBytes, n_micro: int) -> tuple[int, int, int]:
    """Per-device bytes of (gradients, optimizer state, DPO reference copy) beside the params."""
    # jax.grad returns gradients in the trained parameters' dtype and the step accumulates them
    # in a zeros_like buffer; with gradient accumulation a micro-batch's fresh gradient coexists
    # with the accumulator.
    grad_bytes = held.trained * (2 if n_micro > 1 else 1)
    # optax.adamw keeps mu and nu in the trained parameters' dtype, sharded like them.
    opt_bytes = 2 * held.trained
    return grad_bytes, opt_bytes, held.trained if held.reference else 0


def plan(
    cfg: Any,
    mesh_sizes: dict[str, int],
    chip: str = "v5p",
    *,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    mfu: float = 0.4,
    headroom: float = 0.1,
    name: str = "",
) -> dict[str, Any]:
    """The full plan as a JSON-ready dict (see `format_plan` for the text view)."""
    _check_plan_args(chip, mfu, headroom, global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len)
    model_cfg = cfg.model
    rules = cfg.mesh.rules
    mesh = abstract_mesh(mesh_sizes)
    devices = math.prod(mesh_sizes.values())
    gb = cfg.train.global_batch_size if global_batch is None else global_batch
    micro = micro_batch or cfg.train.micro_batch_size or gb
    seq = cfg.data.max_length if seq_len is None else seq_len
    if gb % micro:
        raise PlanError(f"global batch {gb} is not divisible by micro batch {micro}")
    n_micro = gb // micro
    notes: list[str] = []

    held = param_bytes(cfg, mesh, rules)
    layout = held.layout
    n_params = sum(leaf.size for leaf in layout)
    grad_bytes, opt_bytes, ref_bytes = _state_bytes(held, n_micro)

    batch_shards, max_batch_shards = _batch_shards(micro, rules, mesh)
    # The trainer refuses a (micro) batch that does not split over the batch shards; memory
    # is still shown for the replicated batch the sharding rules would otherwise produce.
    splits = micro % max_batch_shards == 0
    if not splits:
        notes.append(
            f"the trainer refuses this: micro batch {micro} does not divide over the {max_batch_shards} "
            f"batch shards (data x fsdp); use a multiple of {max_batch_shards}, or fewer batch shards "
            "(e.g. more tensor); the memory shown is for a replicated batch"
        )
    per_device_batch = micro // batch_shards

    act_model, act_notes = activation_model(model_cfg, mesh, rules, seq, cfg.train.loss_chunk_size)
    notes += act_notes
    act = act_model.breakdown(per_device_batch)
    act_bytes = act_model.total(per_device_batch)
    static = held.held + grad_bytes + opt_bytes + ref_bytes
    total = static + act_bytes
    hbm = HBM_BYTES[chip]
    usable = int(hbm * (1 - headroom))

    # Largest micro batch per device that fits without accumulation (gradients counted once).
    # Batch-size answers (largest batch, accumulation) are sized with the blocked-attention working
    # set even where splash runs: the compiler shows splash saving only about half of it per
    # sample at large batches (8B v5p-64, 17 per chip: 105.1 GiB compiled vs 84.6 planned), so the
    # conservative model keeps every answer one the compiler confirms fits.
    sizing = act_model
    if attention_kernel(model_cfg, "tpu") == "splash":
        blocked_cfg = dataclasses.replace(model_cfg, attention="xla")
        sizing, _ = activation_model(blocked_cfg, mesh, rules, seq, cfg.train.loss_chunk_size)
    max_pdb = sizing.max_batch(usable - (held.held + held.trained + opt_bytes))
    max_global = max_pdb * max_batch_shards
    if splits:
        notes += _batch_notes(micro, gb, max_global, max_batch_shards, total, usable,
                              held.held + 3 * held.trained + opt_bytes, sizing)  # fmt: skip
    counted = matmul_params(layout, model_cfg.tie_embeddings, model_cfg.active_experts_fraction)
    fpt = _flops_per_token(model_cfg, counted, seq, notes)
    flops_step = fpt * gb * seq
    peak = PEAK_FLOPS[chip]
    step_time = flops_step / (devices * peak * mfu)
    return {
        "config": name,
        "chip": chip,
        "attention": attention_kernel(cfg.model, "tpu"),
        "mesh": mesh_sizes,
        "devices": devices,
        "params": n_params,
        "param_dtype": model_cfg.param_dtype,
        "param_mode": held.mode,  # full | lora | int8-lora: what is held and what is trained
        "trained_params": held.trained_count,
        # As the trainer holds it: "auto" is the model's param_dtype (a float32 model: float32 base).
        "base_dtype": resolve_base_dtype(cfg.train.lora.base_dtype, cfg.model.param_dtype)
        if held.mode != "full"
        else None,
        "compute_dtype": model_cfg.dtype,
        "remat_policy": resolve(model_cfg, "tpu").remat_policy,  # "auto" as the TPU step has it
        "attention_block_size": model_cfg.attention_block_size,
        "seq_len": seq,
        "global_batch": gb,
        "micro_batch": micro,
        "grad_accum_steps": n_micro,
        "micro_batch_per_device": per_device_batch,
        "bytes_per_device": {
            "params": held.held,
            "grads": grad_bytes,
            "optimizer": opt_bytes,
            **({"reference": ref_bytes} if ref_bytes else {}),  # only a run that holds one
            "activations": act_bytes,
            "total": total,
        },
        "activation_breakdown": act,
        "activation_peak_phase": act_model.peak_phase(per_device_batch),
        "hbm_bytes": hbm,
        "headroom": headroom,
        "usable_hbm_bytes": usable,
        "trainer_accepts": splits,
        "fits": splits and total <= usable,
        "max_micro_batch_per_device": int(max_pdb),
        "max_global_batch_without_accumulation": int(max_global),
        "matmul_params": counted,
        "flops_per_token": fpt,
        "flops_per_step": flops_step,
        "peak_flops_per_device": peak,
        "mfu": mfu,
        "step_time_s": step_time,
        "tokens_per_sec": gb * seq / step_time,
        "param_leaves": [_leaf_row(leaf) for leaf in layout],
        "notes": notes,
    }


def _batch_shards(micro: int, rules: Any, mesh: Any) -> tuple[int, int]:
    """(shards this micro batch is split over, shards a batch can be split over at most)."""
    from agentrefine_jax.sharding import logical_to_spec

    batch_spec = tuple(logical_to_spec(("batch",), rules, (micro,), mesh))[0]
    whole = tuple(logical_to_spec(("batch",), rules, None, mesh))[0]
    return spec_size(batch_spec, mesh), spec_size(whole, mesh)


def _check_plan_args(
    chip: str, mfu: float, headroom: float, *, global_batch: int | None, micro_batch: int | None,
    seq_len: int | None,
) -> None:  # fmt: skip
    if chip not in HBM_BYTES:
        raise PlanError(f"unknown chip {chip!r}; choose from {sorted(HBM_BYTES)}")
    if not 0 < mfu <= 1:
        raise PlanError(f"--mfu must be in (0, 1], got {mfu}")
    if not 0 <= headroom < 1:
        raise PlanError(f"--headroom must be in [0, 1), got {headroom}")
    for flag, given in (("global batch", global_batch), ("micro batch", micro_batch), ("seq len", seq_len)):
        if given is not None and given < 1:  # 0 is a value to refuse, not "use the default"
            raise PlanError(f"{flag} must be >= 1, got {given}")


def _batch_notes(
    micro: int, gb: int, max_global: int, max_batch_shards: int, total: int, usable: int,
    accum_static: int, sizing: ActivationModel,
) -> list[str]:  # fmt: skip
    """What to do about the batch: above the largest answered batch, or accumulate to fit
    (`accum_static`: params, accumulator + micro-batch gradient, optimizer state)."""
    if total <= usable:
        if micro > max_global:
            return [
                f"micro batch {micro} is above the largest batch this plan answers ({max_global}): the "
                "splash estimate is optimistic at large batches, so confirm it with --compile"
            ]
        return []
    # Largest micro batch (a multiple of the batch shards dividing the global batch) that fits.
    fitting = [
        m
        for m in range(max_batch_shards, gb, max_batch_shards)
        if gb % m == 0 and accum_static + sizing.total(m // max_batch_shards) <= usable
    ]
    if fitting:
        return [
            f"fits with --set train.micro_batch_size={fitting[-1]} ({gb // fitting[-1]} gradient "
            "accumulation steps), or on more chips"
        ]
    return [
        "no micro batch fits: shard further (more fsdp/tensor), use a stronger remat policy, a "
        "smaller attention_block_size / loss_chunk_size, or shorter sequences"
    ]


def _flops_per_token(model_cfg: Any, counted: int, seq: int, notes: list[str]) -> float:
    """flops.py counts matmul weights by formula; checked against the real model's leaves. (Also
    where a routed-experts model is noted: its FLOPs count only the active experts.)"""
    from agentrefine_jax.train import flops

    formula = flops.matmul_params(model_cfg)
    if model_cfg.num_experts:
        # Calibrated on dense models; the routed experts' backward working set is modelled only as
        # far as the traced residuals go (Qwen3-30B-A3B, v5p-32, libtpu 0.0.42.1: 46.78 planned vs
        # 52.62 GiB compiled).
        notes.append(
            "routed experts: not yet calibrated for MoE, the XLA TPU compiler needed 12% more than "
            "this plan for Qwen3-30B-A3B on v5p-32 (docs/scale.md); check with --topology T --compile"
        )
    if counted != formula:
        notes.append(
            f"flops.matmul_params={formula:,} disagrees with the model's "
            f"{counted:,} matmul weights; FLOPs use the model's count"
        )
    return flops.flops_per_token(model_cfg, seq) + 6.0 * (counted - formula)


def _params_line(p: dict[str, Any]) -> str:
    head = f"  parameters          {p['params']:,}"
    if p.get("param_mode", "full") == "full":
        return f"{head} ({p['param_dtype']} master, {p['compute_dtype']} compute)"
    return (
        f"{head} frozen ({p['base_dtype']} base, {p['param_mode']}) + "
        f"{p['trained_params']:,} trained (float32 adapters), {p['compute_dtype']} compute"
    )


def _leaf_row(leaf: LeafLayout) -> dict[str, Any]:
    return {
        "path": leaf.path,
        "shape": list(leaf.shape),
        "dtype": leaf.dtype,
        "spec": [list(e) if isinstance(e, tuple) else e for e in leaf.spec],
        "shard_shape": list(leaf.shard_shape),
    }


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_plan(p: dict[str, Any], name: str = "") -> str:
    b = p["bytes_per_device"]
    mesh = ",".join(f"{k}={v}" for k, v in p["mesh"].items())
    n = p["grad_accum_steps"]
    accum = "no gradient accumulation" if n == 1 else f"{n} gradient accumulation steps"
    lines = [
        f"plan: {name or p['config']} on {p['devices']} x {p['chip']} (mesh {mesh})",
        _params_line(p),
        f"  batch               global {p['global_batch']} x {p['seq_len']} tokens; micro {p['micro_batch']} "
        f"({accum}), {p['micro_batch_per_device']} per device",
        f"  remat               {p['remat_policy']}; attention {p['attention']}"
        + ("" if p["attention"] == "splash" else f", block {p['attention_block_size'] or 'none'}"),
        "  bytes per device",
        f"    params            {_gib(b['params'])}",
        f"    grads             {_gib(b['grads'])}",
        *([f"    DPO reference     {_gib(b['reference'])} (frozen copy)"] if b.get("reference") else []),
        f"    optimizer (AdamW) {_gib(b['optimizer'])}",
        f"    activations       {_gib(b['activations'])}",
    ]
    peak = p["activation_peak_phase"]
    off_peak = {k for name, keys in PHASES.items() if name != peak for k in keys}
    for k, v in p["activation_breakdown"].items():
        if v:
            lines.append(f"      {k:<28}{_gib(v)}" + ("  (not live at the peak)" if k in off_peak else ""))
    usable = p["usable_hbm_bytes"]
    verdict = "FITS" if p["fits"] else "DOES NOT FIT" if p["trainer_accepts"] else "REFUSED (see note)"
    lines += [
        f"    total             {_gib(b['total'])} of {_gib(usable)} usable "
        f"({_gib(p['hbm_bytes'])} HBM, {100 * p['headroom']:.0f}% headroom) -> "
        f"{verdict} ({100 * b['total'] / p['hbm_bytes']:.0f}% of HBM)",
        f"  largest batch       {p['max_micro_batch_per_device']} sequences per device -> global batch "
        f"{p['max_global_batch_without_accumulation']} without gradient accumulation",
        f"  FLOPs per step      {p['flops_per_step']:.3e} ({p['flops_per_token']:.3e} per token)",
        f"  step time           {p['step_time_s']:.2f} s at {100 * p['mfu']:.0f}% MFU "
        f"({p['tokens_per_sec']:,.0f} tokens/s, {p['tokens_per_sec'] / p['devices']:,.0f} per chip)",
    ]
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)
