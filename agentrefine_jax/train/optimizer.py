"""AdamW with a cosine schedule and global-norm clipping (paper: lr 5e-6, cosine, no warm-up)."""

from __future__ import annotations

import optax

from agentrefine_jax.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    if cfg.schedule == "constant":
        return (
            optax.constant_schedule(cfg.learning_rate)
            if cfg.warmup_steps == 0
            else optax.join_schedules(
                [
                    optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
                    optax.constant_schedule(cfg.learning_rate),
                ],
                [cfg.warmup_steps],
            )
        )
    if cfg.schedule != "cosine":
        raise ValueError(f"optim.schedule must be 'cosine' or 'constant', got {cfg.schedule!r}")
    total_steps = max(1, total_steps)
    if cfg.warmup_steps >= total_steps:
        raise ValueError(f"optim.warmup_steps={cfg.warmup_steps} must be < total steps {total_steps}")
    # With warmup_steps == 0 this is exactly lr * 0.5 * (1 + cos(pi * step / total)).
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.learning_rate,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=total_steps,
        end_value=cfg.learning_rate * cfg.final_lr_fraction,
    )


def horizon_matters(cfg: OptimConfig) -> bool:
    """Whether the learning rate at a step depends on the run's total number of steps."""
    return cfg.schedule == "cosine"


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(cfg, total_steps)
    chain = []
    if cfg.grad_clip_norm and cfg.grad_clip_norm > 0:
        chain.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    chain.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*chain), schedule
