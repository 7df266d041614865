"""Training FLOPs and MFU.

Convention (stated because MaxText changed its own in 2025): 6 FLOPs per matmul
parameter per token (forward + backward), plus full (not halved) causal attention,
12 * layers * heads * head_dim * seq per token. Embedding lookups count zero; a tied
output projection counts once as a matmul. Remat recomputation is NOT counted, so
MFU is "model FLOPs utilisation" in the PaLM sense.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax

from agentrefine_jax.models import params
from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.train.topology import chip_of_device_kind


def matmul_params(cfg: ModelConfig) -> int:
    """Every linear row the model holds; the output projection counts even when tied. Routed
    experts count the k of E experts a token runs through (the active parameters)."""
    total = 0.0
    for row in params.TABLE:
        if row.kind != "linear" or not (row.when == "untied" or params.holds(row, cfg)):
            continue
        n = math.prod(params.shape(row, cfg))
        total += n * cfg.active_experts_fraction if row.per_expert else n
    return int(total)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params(cfg) + attention


def flops_per_step(cfg: ModelConfig, seq_len: int, tokens: float, projected_tokens: float) -> float:
    """A step's model FLOPs over `tokens` positions, the output projection's over the
    `projected_tokens` that reach it: a loss projects only the targets it reads (train/loss.py),
    so counting every position would put MFU above what the machine did, or above 100%."""
    head = 6.0 * cfg.hidden_size * cfg.vocab_size
    return (flops_per_token(cfg, seq_len) - head) * tokens + head * projected_tokens


def device_peak_flops(override: float = 0.0, log: Callable[[str], None] | None = None) -> float | None:
    """Peak FLOP/s of one local device: `override` when > 0, a known TPU chip's datasheet figure,
    on a CPU backend this host's measured float32 matmul peak (`cpu_peak.py`, shared among the
    local CPU devices), else None (an unknown accelerator: MFU n/a)."""
    if override > 0:
        return override
    device = jax.devices()[0]
    chip = chip_of_device_kind(device.device_kind)
    if chip:
        return chip.peak_flops
    if device.platform == "cpu":
        from agentrefine_jax.train import cpu_peak

        host, path, cached = cpu_peak.peak()
        if log:
            how = "the best measured here so far" if cached else "measured now, a new best"
            log(
                f"MFU against this host's float32 matmul peak: {host / 1e9:,.1f} GFLOP/s ({how}, {path}; "
                f"train.peak_flops_per_device overrides)"
            )
        return host / max(1, jax.local_device_count())
    return None


def measured_peak_raiser(override: float = 0.0) -> Callable[[float], bool] | None:
    """`cpu_peak.raise_to` where `device_peak_flops` is this host's measurement (a CPU backend, no
    override): steps faster than a measured peak, on average, prove the peak higher. None for a datasheet or
    overridden peak, which a step must not move (above it, MFU > 100% says the FLOP count is wrong)."""
    if override > 0 or jax.devices()[0].platform != "cpu":
        return None
    from agentrefine_jax.train import cpu_peak

    return cpu_peak.raise_to
