"""This host's measured float32 matmul peak (the denominator of MFU on CPU): measured at every call, the
best figure per machine and software kept in the content-keyed cache (a new key or an unreadable entry
starts again); and the trainer's peak on a CPU backend is it, shared among the local devices."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest

from agentrefine_jax.train import cpu_peak, flops
from agentrefine_jax.train.hooks import MetricsLog
from agentrefine_jax.train.metrics import MetricsWriter
from agentrefine_jax.train.run_dir import RunPaths


def test_measured_then_the_best_measurement_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    t0 = time.perf_counter()
    first, path, cached = cpu_peak.peak()
    took = time.perf_counter() - t0
    assert not cached and path.parent == tmp_path / "agentrefine_jax" / "cpu_peak"
    assert took < 30, took  # ~1 s idle; generous for a loaded machine
    doc = json.loads(path.read_text())
    assert doc["flops"] == first and doc["cores"] >= 1 and "1024x1024" in doc["method"]
    # A real oracle of the order of magnitude: numpy's own float32 matmul of the same shape here.
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    best = min(_timed(lambda: a @ a) for _ in range(3))
    numpy_flops = 2 * 1024**3 / best
    assert numpy_flops / 20 < first < numpy_flops * 20, (first, numpy_flops)
    again, path2, cached2 = cpu_peak.peak()
    assert again >= first and path2 == path and json.loads(path.read_text())["flops"] == again
    assert cached2 == (again == first)
    # A lower measurement (a busy machine) never lowers the kept best: a planted higher entry is used.
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "flops": again * 1000}))
    best, _, cached3 = cpu_peak.peak()
    assert cached3 and best == again * 1000
    # A low entry (measured on a busy machine) is replaced by the next, better measurement.
    path.write_text(json.dumps({**doc, "flops": 1.0}))
    raised, _, cached4 = cpu_peak.peak()
    assert not cached4 and raised > 1.0 and json.loads(path.read_text())["flops"] == raised
    # The trainer's per-device peak on this CPU backend is the host's, shared among local devices.
    per_device = flops.device_peak_flops()
    assert per_device == json.loads(path.read_text())["flops"] / jax.local_device_count()
    assert flops.device_peak_flops(123.0) == 123.0  # train.peak_flops_per_device still overrides


def test_a_changed_machine_key_or_a_broken_entry_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = cpu_peak.machine_key()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert cpu_peak.machine_key() != key  # other XLA flags: another entry
    _, path, _ = cpu_peak.peak()
    path.write_text("{not json")
    value, path2, cached = cpu_peak.peak()
    assert not cached and path2 == path and json.loads(path.read_text())["flops"] == value > 0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_a_step_faster_than_the_measured_peak_raises_it_and_mfu_stays_at_most_one(tmp_path, monkeypatch):
    """A peak measured on a busy machine was beaten by a later step (MFU printed 117%): the step's rate
    is kept as the peak, MFU reads 100% for it and below for slower steps; a datasheet/override peak
    is never moved."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, path, _ = cpu_peak.peak()
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "flops": 1e6}))  # as if measured while the cores were taken
    assert cpu_peak.raise_to(5e5) is False and json.loads(path.read_text())["flops"] == 1e6
    assert cpu_peak.raise_to(2e6) is True
    raised = json.loads(path.read_text())
    assert raised["flops"] == 2e6 and "training step" in raised["method"]
    assert flops.measured_peak_raiser() is cpu_peak.raise_to  # this CPU backend, no override
    assert flops.measured_peak_raiser(123.0) is None

    path.write_text(json.dumps({**doc, "flops": 1e6}))
    per_device = 1e6 / jax.local_device_count()
    writer = MetricsWriter(RunPaths(tmp_path / "run"), 0)
    hook = MetricsLog(
        writer,
        lambda step: 1e-3,
        log_every=1,
        total_steps=2,
        step_flops=lambda m: 1e9,  # 1 GFLOP a step: far above a 1 MFLOP/s "peak" at any real step time
        peak_flops=per_device,
        last_good=lambda: "",
        raise_peak=flops.measured_peak_raiser(),
    )
    m = {"loss": 1.0, "grad_norm": 1.0, "tokens": 8.0, "loss_tokens": 8.0}
    t0 = hook.t_last
    hook.on_metrics(1, m, t0 + 0.5)  # 2 GFLOP/s on the whole host
    achieved = 1e9 / 0.5 / jax.device_count() * jax.local_device_count()
    assert json.loads(path.read_text())["flops"] == pytest.approx(achieved)
    hook.on_metrics(2, m, t0 + 1.5)  # half as fast: MFU 50% against the raised peak
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in rows] == [1.0, pytest.approx(0.5)]

    # An overridden peak is not a measurement: a step above it is not kept as the host's peak.
    path.write_text(json.dumps({**doc, "flops": 1e6}))
    hook = MetricsLog(
        MetricsWriter(RunPaths(tmp_path / "run2"), 0),
        lambda step: 1e-3,
        log_every=1,
        total_steps=1,
        step_flops=lambda m: 1e9,
        peak_flops=1e6,
        last_good=lambda: "",
        raise_peak=flops.measured_peak_raiser(1e6),
    )
    hook.on_metrics(1, m, hook.t_last + 0.5)
    assert json.loads(path.read_text())["flops"] == 1e6
