"""Success rate, progress rate, Best-of-N, the paper's held-out average and perturbation spread.

Rates are fractions in [0, 1]. Progress of an episode is its best-so-far progress (AgentBoard's
progress rate); success implies progress 1. With N samples per episode (Best-of-N) the episode
succeeds if any sample does and its progress is the max over samples.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The paper's weights live in the registry (TextWorld games stand in for the 20 Jericho games).
from agentrefine_jax.eval.registry import PAPER_WEIGHTS  # noqa: E402

HELD_OUT = "held_out_average"
SCHEMA = "agentrefine_jax.eval/1"  # the results JSON layout, docs/eval.md ("Results JSON")


def _get(r: Any, key: str) -> Any:
    return r[key] if isinstance(r, Mapping) else getattr(r, key)


def best_of_n(results: Iterable[Any]) -> dict[tuple[str, str, int], dict[str, float]]:
    """(task, variant, episode) -> {success, progress} over that episode's samples."""
    out: dict[tuple[str, str, int], dict[str, float]] = {}
    for r in results:
        key = (_get(r, "task"), _get(r, "variant"), int(_get(r, "episode")))
        s, p = float(bool(_get(r, "success"))), float(_get(r, "progress"))
        if key in out:
            out[key] = {"success": max(out[key]["success"], s), "progress": max(out[key]["progress"], p)}
        else:
            out[key] = {"success": s, "progress": p}
    return out


def task_metrics(results: Sequence[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """variant -> task -> metrics (Best-of-N rates, first-sample rates, counts)."""
    grouped: dict[tuple[str, str], list[Any]] = collections.defaultdict(list)
    for r in results:
        grouped[(_get(r, "variant"), _get(r, "task"))].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for (variant, task), rs in sorted(grouped.items()):
        best = best_of_n(rs)
        first = [r for r in rs if int(_get(r, "sample")) == 0]
        terminations = collections.Counter(_get(r, "termination") for r in rs)
        n = len(best)
        out[variant][task] = {
            "success_rate": sum(v["success"] for v in best.values()) / n,
            "progress_rate": sum(v["progress"] for v in best.values()) / n,
            "episodes": n,
            "samples": len(rs),
            "first_sample_success_rate": _mean(float(bool(_get(r, "success"))) for r in first),
            "first_sample_progress_rate": _mean(float(_get(r, "progress")) for r in first),
            "terminations": dict(sorted(terminations.items())),
            "errors": terminations.get("error", 0),
        }
    return dict(out)


def held_out_average(
    per_task: Mapping[str, Mapping[str, Any]], weights: Mapping[str, int] = PAPER_WEIGHTS
) -> dict[str, Any]:
    """The paper's weighted average, renormalised over the task families present."""
    present = {t: weights[t] for t in per_task if t in weights}
    if not present:
        return {"success_rate": math.nan, "progress_rate": math.nan, "weights": {}}
    total = sum(present.values())
    return {
        "success_rate": sum(w * per_task[t]["success_rate"] for t, w in present.items()) / total,
        "progress_rate": sum(w * per_task[t]["progress_rate"] for t, w in present.items()) / total,
        "weights": {t: w / total for t, w in present.items()},
    }


def perturbation_summary(variants: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per task (and the held-out average): original score, each perturbation, mean and population
    standard deviation across the perturbed variants (the original is reported beside them)."""
    perturbed = sorted(v for v in variants if v != "original")
    if "original" not in variants or not perturbed:
        return {}
    keys = list(variants["original"]["tasks"]) + [HELD_OUT]
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        entry: dict[str, Any] = {}
        for metric in ("success_rate", "progress_rate"):
            orig = _metric(variants["original"], key, metric)
            values = [_metric(variants[v], key, metric) for v in perturbed]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
            entry[metric] = {
                "original": orig,
                "perturbations": dict(zip(perturbed, values, strict=True)),
                "mean": mean,
                "std": std,
            }
        out[key] = entry
    return out


def _metric(variant: Mapping[str, Any], key: str, metric: str) -> float:
    if key == HELD_OUT:
        return float(variant[HELD_OUT][metric])
    return float(variant["tasks"][key][metric])


def summarize(results: Sequence[Any], weights: Mapping[str, int] = PAPER_WEIGHTS) -> dict[str, Any]:
    """Everything the report needs: per-variant task metrics, held-out averages, perturbation spread."""
    per_variant = task_metrics(results)
    variants = {
        v: {"tasks": tasks, HELD_OUT: held_out_average(tasks, weights)} for v, tasks in per_variant.items()
    }
    return {"variants": variants, "perturbation_summary": perturbation_summary(variants)}


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else math.nan
