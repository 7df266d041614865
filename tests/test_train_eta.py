"""The trainer's printed ETA: the mean time of this process's steps after its first, times the steps
left. The first step of a process holds the compile (and, after a resume, the restore); averaged in, a
resumed SmolLM2 run whose steps took ~2 minutes printed "eta 73:34:12" with 58 steps to go."""

from __future__ import annotations

import logging
import re

from agentrefine_jax.train.hooks import MetricsLog
from agentrefine_jax.train.metrics import MetricsWriter
from agentrefine_jax.train.run_dir import RunPaths

STEP = {"loss": 1.0, "grad_norm": 1.0, "tokens": 8.0, "loss_tokens": 8.0}


def _hook(tmp_path, *, total_steps: int, log_every: int = 1) -> MetricsLog:
    return MetricsLog(
        MetricsWriter(RunPaths(tmp_path / "run"), 0),
        lambda step: 1e-3,
        log_every=log_every,
        total_steps=total_steps,
        step_flops=lambda m: 1.0,
        peak_flops=None,
        last_good=lambda: "",
    )


def _etas(caplog) -> dict[int, str]:
    found = (re.search(r"step (\d+)/\d+ .* eta (\S+)$", r.getMessage()) for r in caplog.records)
    return {int(m[1]): m[2] for m in found if m}


def test_a_resumed_runs_eta_leaves_out_its_first_step(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agentrefine_jax")
    hook = _hook(tmp_path, total_steps=80)
    t0 = hook.t_last
    # Resumed at step 21: step 22 finishes after 1 hour of compile and restore, then a step every 120 s.
    done = {22: t0 + 3600.0, 23: t0 + 3720.0, 24: t0 + 3840.0, 25: t0 + 3960.0}
    for step, at in done.items():
        hook.on_metrics(step, STEP, at)
    etas = _etas(caplog)
    assert etas[22] == "?"  # nothing but the first step to go by
    assert etas[23] == "1:54:00"  # 57 steps x 120 s
    assert etas[25] == "1:50:00"  # 55 steps x 120 s
    # The old estimate, the mean over every step since the process started: (3960 s / 4) x 55 steps.
    assert etas[25] != "15:07:30"


def test_eta_between_logged_rows_counts_the_unlogged_steps(tmp_path, caplog):
    """With log_every > 1 the first logged row comes many steps after the first: the ETA still runs on
    the steps after the first (each step's metrics reach the hook, logged or not)."""
    caplog.set_level(logging.INFO, logger="agentrefine_jax")
    hook = _hook(tmp_path, total_steps=30, log_every=10)
    t0 = hook.t_last
    hook.on_metrics(1, STEP, t0 + 500.0)  # the compile
    for step in range(2, 31):
        hook.on_metrics(step, STEP, t0 + 500.0 + 2.0 * (step - 1))
    etas = _etas(caplog)
    assert set(etas) == {10, 20, 30}
    assert etas[10] == "0:40" and etas[20] == "0:20" and etas[30] == "0:00"


def test_a_one_step_run_ends_with_no_time_left(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="agentrefine_jax")
    hook = _hook(tmp_path, total_steps=1)
    hook.on_metrics(1, STEP, hook.t_last + 5.0)
    assert _etas(caplog) == {1: "0:00"}
