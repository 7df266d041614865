"""Training FLOPs and MFU.

Convention (stated because MaxText changed its own in 2025): 6 FLOPs per matmul
parameter per token (forward + backward), plus full (not halved) causal attention,
12 * layers * heads * head_dim * seq per token. Embedding lookups count zero; a tied
output projection counts once as a matmul. Remat recomputation is NOT counted, so
MFU is "model FLOPs utilisation" in the PaLM sense.
"""

from __future__ import annotations

import jax

from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.train.topology import PEAK_FLOPS, chip_of_device_kind

__all__ = ["PEAK_FLOPS", "device_peak_flops", "flops_per_token", "matmul_params"]


def matmul_params(cfg: ModelConfig) -> int:
    d, f, h, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * (h * hd) * 2 + d * (kv * hd) * 2 + 3 * d * f
    return cfg.num_layers * per_layer + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params(cfg) + attention


def device_peak_flops(override: float = 0.0) -> float | None:
    """Peak FLOP/s of one local device, or None when unknown (e.g. CPU)."""
    if override > 0:
        return override
    chip = chip_of_device_kind(jax.devices()[0].device_kind)
    return chip.peak_flops if chip else None
