"""How a model runs on given devices, decided once: the `ExecutionPlan`.

A `ModelConfig`'s `Execution` settings are what the user wrote ("auto" included). Which attention
kernel, whether the CPU layout applies, whether the layers are scanned depend on the devices the
step is compiled for — the mesh's, not the host's: an ahead-of-time compile for a TPU slice on a
CPU host must get the TPU choices. `resolve` makes every such choice once and the model carries
the result (`Transformer.plan`); nothing in the forward pass asks the devices again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.sharding import current, mesh_platform


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """Every run-time choice of the forward pass, already decided (hashable: part of the model's
    static structure, so a different plan is a different compiled program)."""

    platform: str  # the devices' platform: "cpu", "tpu", "gpu"
    dtype: str  # the compute dtype matmuls run in
    # "xla" | "splash" | "cudnn" for full-sequence passes; decoding with a KV cache is always "xla".
    attention: str
    # The CPU layout in full-sequence passes (models/cpu_layout.py): 2-D projections, flat
    # attention dots, layers unrolled unless remat is on (by default it is: `remat_policy`), MLP
    # unchunked; decode loops carry one cache array per layer.
    cpu_layout: bool
    scan_layers: bool  # lax.scan over the layers (full-sequence passes: unless cpu_layout)
    remat_policy: str
    attention_block_size: int
    mlp_chunk_size: int
    splash_blocks: tuple[int, int, int]  # (q, kv, kv_compute) tiles of the splash kernel
    # The mesh axis the routed experts' compute is split over (expert parallelism: each rank runs
    # only its E/n experts, models/moe.py), or None (every device runs every expert on its rows).
    expert_axis: str | None = None

    @property
    def scan_full_sequence(self) -> bool:
        """Whether a pass without a KV cache scans the layers. The CPU layout unrolls them unless a
        remat policy is set: XLA:CPU schedules an unrolled stack's recomputation early, so remat
        there saved nothing (SmolLM2-135M, 4 x 512: 6.79 vs 7.13 GiB of temporaries) while the
        scanned stack keeps only each layer's input (1.38 GiB; docs/scale.md, "CPU memory")."""
        return self.scan_layers and (not self.cpu_layout or self.remat_policy != "none")


def attention_kernel(cfg: ModelConfig, platform: str) -> str:
    """The implementation `cfg.attention` means on `platform` ("auto" decided here)."""
    if cfg.attention != "auto":
        return cfg.attention
    if platform == "tpu":
        return "splash"
    # cuDNN flash attention only takes 16-bit inputs; float32 models keep the XLA path.
    if platform in ("gpu", "cuda") and cfg.dtype in ("bfloat16", "float16"):
        return "cudnn"
    return "xla"


def expert_axis(cfg: ModelConfig, mesh_shape: Mapping[str, int] | None) -> str | None:
    """Expert parallelism over `tensor` for a routed-experts model whose experts that axis divides.
    Tokens are replicated over `tensor` (the batch is split over data x fsdp only), so each tensor
    rank can run its own E/tp experts on the tokens it already holds and a psum combines them: no
    token moves. Attention keeps its heads on `tensor` as before. Without EP the tensor ranks
    would all run every expert on the same tokens (tp times the expert FLOPs)."""
    tp = (mesh_shape or {}).get("tensor", 1)
    if cfg.num_experts and tp > 1 and cfg.num_experts % tp == 0:
        return "tensor"
    return None


def remat_policy(cfg: ModelConfig, cpu_layout: bool) -> str:
    """The remat policy `cfg.remat_policy` means ("auto" decided here): in the CPU layout
    "dots_no_batch" (the layers scanned, the projections' outputs saved; the elementwise work and the
    attention dots recomputed in the backward pass), elsewhere "none". Measured on the SmolLM2-135M
    train step (AMD EPYC, 2 cores, batch 2 x 256, float32, one process alternating the policies;
    docs/scale.md "CPU memory of a real model"): step temporaries 1.08 GB vs 1.97 GB for the
    unrolled stack without remat, 1.26 GB for "dots", 1.08 GB for "full"; CPU time per step 5% below
    the unrolled stack's, 3% below "dots", 9% below "full". The unrolled stack kept every layer's
    weight copy and elementwise intermediates alive until the backward pass; recomputing the
    attention dots costs less than writing and reading back their [S, S] probabilities."""
    if cfg.remat_policy != "auto":
        return cfg.remat_policy
    return "dots_no_batch" if cpu_layout else "none"


def resolve(cfg: ModelConfig, platform: str, mesh_shape: Mapping[str, int] | None = None) -> ExecutionPlan:
    """`cfg`'s execution settings decided for devices of `platform` on a mesh of `mesh_shape`
    (axis -> size; None: one device)."""
    cpu = platform == "cpu" if cfg.cpu_layout == "auto" else bool(cfg.cpu_layout)
    return ExecutionPlan(
        platform=platform,
        dtype=cfg.dtype,
        attention=attention_kernel(cfg, platform),
        cpu_layout=cpu,
        scan_layers=cfg.scan_layers,
        remat_policy=remat_policy(cfg, cpu),
        attention_block_size=cfg.attention_block_size,
        mlp_chunk_size=cfg.mlp_chunk_size,
        splash_blocks=(cfg.splash_block_q, cfg.splash_block_kv, cfg.splash_block_kv_compute),
        expert_axis=expert_axis(cfg, mesh_shape),
    )


def for_devices(cfg: ModelConfig, mesh: Any = None) -> ExecutionPlan:
    """The plan for `mesh`'s devices; without one, for the active mesh's (sharding.use_sharding),
    else the default devices'."""
    if mesh is None and (ctx := current()) is not None:
        mesh = ctx.mesh
    devices = getattr(mesh, "devices", None)
    platform = devices.flat[0].platform if devices is not None else mesh_platform()
    return resolve(cfg, platform, dict(getattr(mesh, "shape", None) or {}))
