"""Training FLOPs and MFU.

Convention (stated because MaxText changed its own in 2025): 6 FLOPs per matmul
parameter per token (forward + backward), plus full (not halved) causal attention,
12 * layers * heads * head_dim * seq per token. Embedding lookups count zero; a tied
output projection counts once as a matmul. Remat recomputation is NOT counted, so
MFU is "model FLOPs utilisation" in the PaLM sense.
"""

from __future__ import annotations

import math

import jax

from agentrefine_jax.models import params
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.train.topology import chip_of_device_kind


def matmul_params(cfg: ModelConfig) -> int:
    """Every linear row of the parameter table; the output projection counts even when tied."""
    return sum(math.prod(params.shape(row, cfg)) for row in params.TABLE if row.kind == "linear")


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params(cfg) + attention


def device_peak_flops(override: float = 0.0) -> float | None:
    """Peak FLOP/s of one local device, or None when unknown (e.g. CPU)."""
    if override > 0:
        return override
    chip = chip_of_device_kind(jax.devices()[0].device_kind)
    return chip.peak_flops if chip else None
