"""Success rate, progress rate, Best-of-N, the paper's held-out average and perturbation spread.

Rates are fractions in [0, 1]. Progress of an episode is its best-so-far progress (AgentBoard's
progress rate); success implies progress 1. With N samples per episode (Best-of-N) the episode
succeeds if any sample does and its progress is the max over samples.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from agentrefine_jax.eval import registry
from agentrefine_jax.eval.perturb import summary

# The paper's weights live in the registry (TextWorld games stand in for the 20 Jericho games).
from agentrefine_jax.eval.registry import PAPER_WEIGHTS

HELD_OUT = "held_out_average"
AGENTBOARD_METRICS = ("success_rate", "progress_rate", "grounding_acc")
RATES = AGENTBOARD_METRICS[:2]
# How a model's replies fare, per task (`behaviour_rates`): where a small model shows training's effect.
BEHAVIOUR = ("valid_action_rate", "format_error_rate")
# How the agent fares right after a rejected turn, per task (`recovery_rates`; docs/eval.md, "Metrics").
RECOVERY = ("recovery_rate", "mean_steps_to_recover", "repeated_error_rate")
SCHEMA = "agentrefine_jax.eval/2"  # the results JSON layout of both sources, docs/eval.md ("Results JSON")


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


# The per-task metrics each source's results carry, in their order; one function (`group_metrics`) computes
# them all from the one episode record. AgentBoard's: its `evaluate` (grounding, the easy/hard splits).
BUILTIN_COLUMNS = (
    *RATES,
    "episodes",
    "samples",
    "first_sample_success_rate",
    "first_sample_progress_rate",
    "terminations",
    "errors",
    *BEHAVIOUR,
    *RECOVERY,
    "recovery_counts",
)
SPLITS = ("easy", "hard")  # AgentBoard's difficulty levels (test.jsonl)
AGENTBOARD_COLUMNS = (
    "episodes",
    *AGENTBOARD_METRICS,
    *(f"{m}_{split}" for split in SPLITS for m in RATES),
    *RECOVERY,
    "recovery_counts",
)


def task_metrics(
    results: Sequence[Any], columns: Sequence[str] = BUILTIN_COLUMNS
) -> dict[str, dict[str, dict[str, Any]]]:
    """variant -> task -> `group_metrics` of that variant's episodes of the task."""
    grouped: dict[tuple[str, str], list[Any]] = collections.defaultdict(list)
    for r in results:
        grouped[(_get(r, "variant"), _get(r, "task"))].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for (variant, task), rs in sorted(grouped.items()):
        out[variant][task] = group_metrics(rs, columns)
    return dict(out)


def group_metrics(results: Sequence[Any], columns: Sequence[str] = BUILTIN_COLUMNS) -> dict[str, Any]:
    """One task's metrics (`columns`, in that order) over its episode records, every sample of one variant:
    `success_rate`/`progress_rate` Best-of-N (per episode the best sample; with one sample the plain
    mean), also per difficulty split (`success_rate_easy`, ...: episodes whose spec has that difficulty);
    first-sample rates; counts; `grounding_acc` (the mean of the episodes' valid-step shares); the
    behaviour and recovery rates. A rate over no episode is None (strict JSON has no NaN)."""

    def rates(rs: Sequence[Any]) -> dict[str, float | None]:
        best = list(best_of_n(rs).values())
        return {
            "success_rate": _mean_or_none([b["success"] for b in best]),
            "progress_rate": _mean_or_none([b["progress"] for b in best]),
        }

    def split(level: str) -> list[Any]:
        return [r for r in results if getattr(_get(r, "spec"), "difficulty", None) == level]

    first = [r for r in results if int(_get(r, "sample")) == 0]

    def ends() -> collections.Counter[str]:
        return collections.Counter(_get(r, "termination") for r in results)

    value: dict[str, Callable[[], Any]] = {
        "episodes": lambda: len(best_of_n(results)),
        "samples": lambda: len(results),
        "first_sample_success_rate": lambda: _mean(float(bool(_get(r, "success"))) for r in first),
        "first_sample_progress_rate": lambda: _mean(float(_get(r, "progress")) for r in first),
        "terminations": lambda: dict(sorted(ends().items())),
        "errors": lambda: ends().get("error", 0),
        "grounding_acc": lambda: _mean_or_none([_get(r, "grounding") for r in results]),
    }
    for level in SPLITS:
        for m in RATES:
            value[f"{m}_{level}"] = lambda level=level, m=m: rates(split(level))[m]
    for m in RATES:
        value[m] = lambda m=m: rates(results)[m]
    for group, keys in ((behaviour_rates, BEHAVIOUR), (recovery_rates, (*RECOVERY, "recovery_counts"))):
        if any(k in columns for k in keys):
            computed = group(results)
            for k in keys:
                value[k] = lambda k=k, computed=computed: computed[k]
    return {c: value[c]() for c in columns}


def episode_rates(r: Any) -> dict[str, float | None]:
    """One episode's reply behaviour: the valid-action rate (of the actions the parser read and sent
    to the environment, the share it accepted as valid) and the format-error rate (of all replies, the
    share the parser could not read as an action). None where the episode has nothing to divide by."""
    steps = int(_get(r, "steps"))
    bad_format = int(_get(r, "format_errors"))
    actions = steps - bad_format
    return {
        "valid_action_rate": (actions - int(_get(r, "invalid_actions"))) / actions if actions > 0 else None,
        "format_error_rate": bad_format / steps if steps > 0 else None,
    }


def behaviour_rates(results: Sequence[Any]) -> dict[str, float | None]:
    """A task's valid-action and format-error rates: the mean of its episodes' rates (every sample
    counts; an episode without an action, or without a reply, is left out of that mean; None when
    none is left). Episode records without the counts (older files) give None."""
    counted = [r for r in results if all(_has(r, k) for k in ("steps", "format_errors", "invalid_actions"))]
    per = [episode_rates(r) for r in counted]
    return {k: _mean_or_none([e[k] for e in per if e[k] is not None]) for k in BEHAVIOUR}


def episode_turns(r: Any) -> list[tuple[str | None, bool]] | None:
    """One episode's turns as (action, valid), from the record (`core.EpisodeResult`, or its JSON) of
    either source: its `trace` (`turns` in AgentBoard's words; under the chat protocol a reply the parser
    could not read has action None and is invalid). None when the record keeps no turns (AgentBoard's
    summary records in a results file)."""
    for key in ("trace", "turns"):
        if _has(r, key):
            steps = _get(r, key)
            return [(s.get("action"), bool(s.get("valid", False))) for s in steps]
    return None


def _same_action(a: str | None, b: str | None) -> bool:
    """Two rejected turns repeat each other: the same action (trimmed, case-folded), or two unparseable
    replies in a row."""
    if a is None or b is None:
        return a is None and b is None
    return a.strip().casefold() == b.strip().casefold()


def recovery_counts(turns: Sequence[tuple[str | None, bool]]) -> dict[str, int]:
    """The counts behind the recovery metrics of one episode's (action, valid) turns: `after_error` (turns
    right after a rejected one), `recovered_next` (of those, valid), `repeated` (of those, the same rejected
    action again), `streaks` (runs of consecutive rejected turns), `recovered_streaks` (runs a valid turn
    ends) and `steps_to_recover` (summed over those: from the run's first rejected turn to the valid one)."""
    out = dict.fromkeys(
        ("after_error", "recovered_next", "repeated", "streaks", "recovered_streaks", "steps_to_recover"), 0
    )
    start: int | None = None  # the first rejected turn of the run in progress
    for i, (action, valid) in enumerate(turns):
        if i > 0 and not turns[i - 1][1]:
            out["after_error"] += 1
            out["recovered_next"] += int(valid)
            out["repeated"] += int(not valid and _same_action(turns[i - 1][0], action))
        if not valid and start is None:
            start = i
            out["streaks"] += 1
        elif valid and start is not None:
            out["recovered_streaks"] += 1
            out["steps_to_recover"] += i - start
            start = None
    return out


def recovery_rates(results: Sequence[Any]) -> dict[str, Any]:
    """A task's recovery metrics, pooled over its episodes (every sample): `recovery_rate` (of the turns
    right after a rejected turn, the share valid), `mean_steps_to_recover` (per run of rejected turns that a
    valid turn ends, the turns from its first rejection to that valid one; a run the episode ends inside is
    not counted) and `repeated_error_rate` (of the turns right after a rejected turn, the share repeating
    it); each None when nothing is counted, and `recovery_counts` with the pooled counts (Wilson intervals,
    merges). Records without turns give no counts."""
    total = dict.fromkeys(recovery_counts([]), 0)
    for r in results:
        turns = episode_turns(r)
        for k, v in recovery_counts(turns or []).items():
            total[k] += v
    after = total["after_error"]
    return {
        "recovery_rate": total["recovered_next"] / after if after else None,
        "mean_steps_to_recover": (
            total["steps_to_recover"] / total["recovered_streaks"] if total["recovered_streaks"] else None
        ),
        "repeated_error_rate": total["repeated"] / after if after else None,
        "recovery_counts": total,
    }


def _has(r: Any, key: str) -> bool:
    return key in r if isinstance(r, Mapping) else hasattr(r, key)


def held_out_average(
    per_task: Mapping[str, Mapping[str, Any]], weights: Mapping[str, int] = PAPER_WEIGHTS
) -> dict[str, Any]:
    """The paper's weighted average, renormalised over the task families present."""
    present = {t: weights[t] for t in per_task if t in weights}
    if not present:  # null and the reason: strict JSON has no NaN
        why = "no task with a held-out weight ran"
        return {"success_rate": None, "progress_rate": None, "weights": {}, "missing": why}
    total = sum(present.values())
    return {
        "success_rate": sum(w * per_task[t]["success_rate"] for t, w in present.items()) / total,
        "progress_rate": sum(w * per_task[t]["progress_rate"] for t, w in present.items()) / total,
        "weights": {t: w / total for t, w in present.items()},
    }


def perturbation_summary(variants: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per task (and the held-out average): original score, each perturbation, mean and population
    standard deviation across the perturbed variants (the original is reported beside them). A task is
    summarised when every perturbed variant ran it (AgentBoard's source perturbs ALFWorld only)."""
    perturbed = sorted(v for v in variants if v != "original")
    if "original" not in variants or not perturbed:
        return {}
    tasks = [t for t in variants["original"]["tasks"] if all(t in variants[v]["tasks"] for v in perturbed)]
    out: dict[str, dict[str, Any]] = {}
    for key in [*tasks, HELD_OUT]:
        entry: dict[str, Any] = {}
        for metric in ("success_rate", "progress_rate"):
            values = [_metric(variants[v], key, metric) for v in perturbed]
            entry[metric] = summary(_metric(variants["original"], key, metric), values) | {
                "perturbations": dict(zip(perturbed, values, strict=True))
            }
        out[key] = entry
    return out


def _metric(variant: Mapping[str, Any], key: str, metric: str) -> float | None:
    value = variant[HELD_OUT][metric] if key == HELD_OUT else variant["tasks"][key][metric]
    return None if value is None else float(value)


def summarize(results: Sequence[Any], weights: Mapping[str, int] = PAPER_WEIGHTS) -> dict[str, Any]:
    """Everything the report needs: per-variant task metrics, held-out averages, perturbation spread."""
    return variants_section(task_metrics(results), weights)


def variants_section(
    per_variant: Mapping[str, Mapping[str, Any]], weights: Mapping[str, int]
) -> dict[str, Any]:
    """`variants` (each variant's task metrics and weighted held-out average) and `perturbation_summary`."""
    variants = {
        v: {"tasks": dict(tasks), HELD_OUT: held_out_average(tasks, weights)}
        for v, tasks in per_variant.items()
    }
    return {"variants": variants, "perturbation_summary": perturbation_summary(variants)}


def held_out_summary(
    per_task: Mapping[str, Mapping[str, Any]], weights: Mapping[str, int], complete_only: bool = False
) -> dict[str, Any]:
    """The held-out summary of a run's headline scores, the same for both sources: the paper's weighted
    average renormalised over the held-out tasks that ran (`held_out_average`), the held-out tasks that
    did not (`missing`, in the paper's order) and, when all four ran, AgentBoard's unweighted mean.
    `complete_only` (AgentBoard's source): no average unless all four ran, as AgentBoard's summaries."""
    missing = [t for t in weights if t not in per_task]
    if complete_only and missing:
        out = held_out_average({}, weights) | {"note": "AgentBoard's held-out means need all four tasks"}
    else:
        out = held_out_average(per_task, weights)
        if out["success_rate"] is None:
            out["note"] = out["missing"]
    out["tasks"] = [t for t in weights if t in per_task]
    out["missing"] = missing
    stand_in = "; TextWorld takes Jericho's" if registry.JERICHO_STAND_IN in weights else ""
    out["label"] = f"paper weights ({registry.weights_label()}{stand_in}), renormalised over the tasks run"
    if not missing:
        out["unweighted_mean"] = {m: _mean_or_none([per_task[t][m] for t in weights]) for m in RATES}
    return out


def _mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None


def _mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def best_of_metrics(greedy: Sequence[Any], samples: Sequence[Any]) -> dict[str, Any]:
    """Table 4 for one task, from episode records (`core.EpisodeResult` of either source, or their JSON):
    greedy, Best-of-N over the samples of the original variant (success if any sample succeeds, progress
    the max), their difference, and each sample's rates and their mean."""

    def rates(rs: Sequence[Any]) -> dict[str, float]:
        return {
            "success_rate": _mean(float(bool(_get(r, "success"))) for r in rs),
            "progress_rate": _mean(float(_get(r, "progress")) for r in rs),
        }

    best = list(best_of_n(samples).values())
    best_rates = {
        "success_rate": _mean(b["success"] for b in best),
        "progress_rate": _mean(b["progress"] for b in best),
    }
    per_sample = [
        rates([r for r in samples if _get(r, "sample") == k])
        for k in range(1 + max(_get(r, "sample") for r in samples))
    ]
    g = rates(greedy)
    return {
        "greedy": g,
        "best_of": best_rates,
        "delta": {m: best_rates[m] - g[m] for m in RATES},
        "sample_mean": {m: _mean(p[m] for p in per_sample) for m in RATES},
        "per_sample": per_sample,
        "episodes": len(best),
    }


def best_of_held_out(per_task: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The held-out unweighted mean of each Table 4 row, when the four held-out tasks (`names`, this
    source's result names) ran."""
    if any(t not in per_task for t in names):
        return {}
    return {
        row: {m: _mean_or_none([per_task[t][row][m] for t in names]) for m in RATES}
        for row in ("greedy", "best_of", "delta")
    }
