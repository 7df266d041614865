"""Metrics: Best-of-N, per-task rates, the paper's weighted held-out average, perturbation spread."""

from __future__ import annotations

import math

import pytest

from agentrefine_jax.eval.metrics import (
    HELD_OUT,
    PAPER_WEIGHTS,
    best_of_n,
    held_out_average,
    perturbation_summary,
    summarize,
)


def ep(task, episode, sample, success, progress, variant="original", termination=None):
    return {
        "task": task,
        "variant": variant,
        "episode": episode,
        "sample": sample,
        "success": success,
        "progress": progress,
        "termination": termination or ("success" if success else "max_steps"),
    }


def test_paper_weights_sum_to_282():
    assert sum(PAPER_WEIGHTS.values()) == 282
    assert PAPER_WEIGHTS == {"babyai": 112, "sciworld": 90, "pddl": 60, "textworld": 20}


def test_best_of_n_is_any_success_and_max_progress():
    rs = [
        ep("pddl", 0, 0, False, 0.5),
        ep("pddl", 0, 1, True, 1.0),
        ep("pddl", 0, 2, False, 0.25),
        ep("pddl", 1, 0, False, 0.2),
        ep("pddl", 1, 1, False, 0.6),
    ]
    best = best_of_n(rs)
    assert best[("pddl", "original", 0)] == {"success": 1.0, "progress": 1.0}
    assert best[("pddl", "original", 1)] == {"success": 0.0, "progress": 0.6}
    m = summarize(rs)["variants"]["original"]["tasks"]["pddl"]
    assert m["success_rate"] == 0.5 and m["progress_rate"] == pytest.approx(0.8)
    assert m["episodes"] == 2 and m["samples"] == 5
    # First-sample (pass@1-style) rates beside Best-of-N.
    assert m["first_sample_success_rate"] == 0.0 and m["first_sample_progress_rate"] == pytest.approx(0.35)


def test_held_out_average_is_weighted_and_renormalised():
    per_task = {
        "babyai": {"success_rate": 0.5, "progress_rate": 0.8},
        "pddl": {"success_rate": 0.2, "progress_rate": 0.4},
    }
    avg = held_out_average(per_task)
    assert avg["success_rate"] == pytest.approx((112 * 0.5 + 60 * 0.2) / 172)
    assert avg["progress_rate"] == pytest.approx((112 * 0.8 + 60 * 0.4) / 172)
    assert avg["weights"] == pytest.approx({"babyai": 112 / 172, "pddl": 60 / 172})
    full = {
        t: {"success_rate": 1.0 if t == "textworld" else 0.0, "progress_rate": 0.0} for t in PAPER_WEIGHTS
    }
    assert held_out_average(full)["success_rate"] == pytest.approx(20 / 282)
    # Strict JSON (issue 31): no held-out task -> null with the reason, not NaN.
    assert held_out_average({})["success_rate"] is None and held_out_average({})["missing"]


def test_perturbation_summary_reports_mean_and_population_std():
    rs = []
    for variant, succ in (
        ("original", [1, 1]),
        ("perturbation_1", [1, 0]),
        ("perturbation_2", [0, 0]),
        ("perturbation_3", [1, 1]),
    ):
        rs += [ep("babyai", i, 0, bool(s), 1.0 if s else 0.5, variant) for i, s in enumerate(succ)]
    doc = summarize(rs)
    s = doc["perturbation_summary"]["babyai"]["success_rate"]
    assert s["original"] == 1.0
    assert s["perturbations"] == {"perturbation_1": 0.5, "perturbation_2": 0.0, "perturbation_3": 1.0}
    assert s["mean"] == pytest.approx(0.5)
    assert s["std"] == pytest.approx(math.sqrt(((0.0) ** 2 + 0.5**2 + 0.5**2) / 3))
    assert doc["perturbation_summary"][HELD_OUT]["success_rate"]["std"] == pytest.approx(s["std"])
    assert perturbation_summary({"original": doc["variants"]["original"]}) == {}


def test_errors_are_counted_and_scored_as_failures():
    rs = [ep("sciworld", 0, 0, False, 0.3, termination="error"), ep("sciworld", 1, 0, True, 1.0)]
    m = summarize(rs)["variants"]["original"]["tasks"]["sciworld"]
    assert m["errors"] == 1 and m["terminations"] == {"error": 1, "success": 1}
    assert m["success_rate"] == 0.5
