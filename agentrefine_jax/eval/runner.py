"""Evaluation runs: tasks x perturbation variants x episodes x Best-of-N samples, then the report."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentrefine_jax.eval.envs.base import EvalTask
from agentrefine_jax.eval.journal import Journal
from agentrefine_jax.eval.loop import EpisodeJob, EpisodeResult, job_seed, run_episodes
from agentrefine_jax.eval.metrics import (
    BEHAVIOUR,
    HELD_OUT,
    SCHEMA,
    best_of_metrics,
    best_of_table,
    summarize,
)
from agentrefine_jax.eval.perturb import variant_name
from agentrefine_jax.eval.policies import Policy, is_privileged
from agentrefine_jax.eval.registry import (
    available_tasks,
    default_tasks,
    display_name,
    lookup,
    make_task,
    register_task,
    task_weights,
    weights_label,
)
from agentrefine_jax.layout import check_style

TASK_NAMES = default_tasks("builtin")


@dataclasses.dataclass
class EvalConfig:
    tasks: tuple[str, ...] = TASK_NAMES
    episodes: int = 10
    best_of: int = 1
    perturb: bool = False
    num_perturbations: int = 3
    seed: int = 0
    # None: each task's default (40).
    max_steps: int | None = None
    batch_size: int = 8
    workdir: str = ""
    task_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # agentrefine_jax.layout style: "chat" (multi-turn) or "agentboard" (AgentBoard's single user message).
    prompt_style: str = "chat"
    name: str | None = None  # a label for the run, stored in the results

    def validate(self) -> None:
        # registered names or aliases -> the names the results carry (built-in jericho: textworld)
        self.tasks = tuple(lookup(n, "builtin").result_name("builtin") for n in self.tasks)
        if not self.tasks:
            raise ValueError("no tasks selected")
        for field in ("episodes", "best_of", "batch_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.perturb and self.num_perturbations < 1:
            raise ValueError("num_perturbations must be >= 1 with perturb")
        if not self.workdir:
            raise ValueError("workdir is required (tool caches and generated games go there)")
        check_style(self.prompt_style)


def run_eval(
    policy: Policy, config: EvalConfig, log: Callable[[str], None] = print, journal: Journal | None = None
) -> dict[str, Any]:
    """Run every episode and return the results document (metrics, config, transcripts). With a `journal`,
    episodes an interrupted run finished are taken from it and every new one is appended as it ends."""
    config.validate()
    os.makedirs(config.workdir, exist_ok=True)
    # matplotlib (imported by pddlgym) would otherwise build its font cache under $HOME.
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(config.workdir, "matplotlib"))
    results: list[EpisodeResult] = []
    greedy: dict[str, list[EpisodeResult]] = {}
    t0 = time.perf_counter()
    for name in config.tasks:
        task = make_task(name, config.workdir, **config.task_options.get(name, {}))
        try:
            results.extend(_run_task(name, task, policy, config, log, journal))
            if config.best_of > 1:
                greedy[name] = _greedy(name, task, policy, config, results, log, journal)
        finally:
            task.close()
    summary = summarize(results, task_weights())
    if greedy:
        summary["best_of"] = _best_of(greedy, results, policy, config)
    return {
        "schema": SCHEMA,
        "source": "builtin",
        "agent": policy.name,
        "policy": policy.name,
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "workdir"},
        "seconds": round(time.perf_counter() - t0, 1),
        **summary,
        "episodes": [r.to_json() for r in results],
    }


def _run_task(
    name: str,
    task: EvalTask,
    policy: Policy,
    config: EvalConfig,
    log: Callable[[str], None],
    journal: Journal | None = None,
) -> list[EpisodeResult]:
    max_steps = config.max_steps or task.default_max_steps
    specs = task.episode_specs(config.episodes, config.seed)
    task.prepare(specs)
    n_pert = min(config.num_perturbations, task.num_perturbations) if config.perturb else 0
    if config.perturb and n_pert < config.num_perturbations:
        log(f"{name}: only {task.num_perturbations} perturbations defined; running {n_pert}")
    jobs = _jobs(name, task, specs, config, n_pert + 1, config.best_of)
    log(
        f"{name}: {len(specs)} episodes x {n_pert + 1} variant(s) x {config.best_of} sample(s), "
        f"max {max_steps} steps, policy {policy.name}"
    )

    def report(r: EpisodeResult) -> None:
        extra = f" ({r.error})" if r.error else ""
        log(
            f"{r.task} {r.variant} episode {r.episode} sample {r.sample}: "
            f"success={int(r.success)} progress={r.progress:.2f} steps={r.steps} end={r.termination}{extra}"
        )

    t0 = time.perf_counter()
    results = run_episodes(jobs, policy, batch_size=config.batch_size, on_result=report, journal=journal)
    log(f"{name}: {len(results)} runs in {time.perf_counter() - t0:.1f}s")
    return results


def _jobs(
    name: str, task: EvalTask, specs: list, cfg: EvalConfig, variants: int, samples: int, sampling: Any = None
) -> list[EpisodeJob]:
    """Every (variant, episode, sample) of `specs`, in that order, each with its own seed."""
    steps = cfg.max_steps or task.default_max_steps
    return [
        EpisodeJob(
            name, task, s, i, p, k, steps, job_seed(cfg.seed, name, p, i, k), cfg.prompt_style, sampling
        )
        for p in range(variants)
        for i, s in enumerate(specs)
        for k in range(samples)
    ]


def _greedy(
    name: str,
    task: EvalTask,
    policy: Policy,
    config: EvalConfig,
    results: list[EpisodeResult],
    log: Any,
    journal: Journal | None = None,
) -> list[EpisodeResult]:
    """The greedy run beside Best-of-N (Table 4): a model decodes at temperature 0; a privileged policy's
    sample 0 is its greedy run (the same seeds)."""
    original = [r for r in results if r.task == name and r.variant == "original"]
    if is_privileged(policy):
        return [r for r in original if r.sample == 0]
    greedy = dataclasses.replace(policy.sampling, temperature=0.0)
    jobs = _jobs(name, task, [r.spec for r in original if r.sample == 0], config, 1, 1, greedy)
    log(f"{name}: greedy run of {len(jobs)} episodes beside Best-of-{config.best_of}")
    return run_episodes(jobs, policy, batch_size=config.batch_size, journal=journal, phase="greedy")


def _best_of(
    greedy: dict[str, list[EpisodeResult]], results: list[EpisodeResult], policy: Policy, config: EvalConfig
) -> dict[str, Any]:
    original = [r for r in results if r.variant == "original"]
    tasks = {t: best_of_metrics(g, [r for r in original if r.task == t]) for t, g in greedy.items()}
    return {
        "n": config.best_of,
        "temperature": getattr(policy, "sampling", None) and policy.sampling.temperature,
        "tasks": tasks,
        "greedy_episodes": [r.to_json() for g in greedy.values() for r in g],
    }


def _pct(x: float) -> str:
    return "  n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:5.1f}"


def _metric_label(task: str) -> str:
    """A column's sub-header: the task's registered metric names (HotpotQA: EM / F1), else succ / prog."""
    try:
        names = lookup(task).metric_names
    except ValueError:  # the held-out average, or a task registered by a plug-in no longer loaded
        names = ("success", "progress")
    return "succ / prog" if names == ("success", "progress") else " / ".join(names)


def format_table(doc: dict[str, Any]) -> str:
    """A table like the paper's: success / progress (%) per task and the weighted held-out average."""
    variants = doc["variants"]
    tasks = [t for t in doc["config"]["tasks"] if any(t in v["tasks"] for v in variants.values())]
    names = {t: display_name(t) for t in tasks}
    cols = [names[t] for t in tasks] + ["Held-out avg"]
    width = 15
    head = f"{'':<18}" + "".join(f"{c:^{width}}" for c in cols)
    sub = f"{'':<18}" + "".join(f"{_metric_label(t):^{width}}" for t in [*tasks, HELD_OUT])
    lines = [
        f"policy: {doc['policy']}   (success % / progress %; below each: valid-action % / format-error %)",
        head,
        sub,
    ]

    def row(label: str, values: Sequence[tuple[float, float]]) -> str:
        return f"{label:<18}" + "".join(f"{_pct(s) + ' / ' + _pct(p):^{width}}" for s, p in values)

    for vname in sorted(variants, key=lambda v: (v != "original", v)):
        v = variants[vname]
        vals = [
            (v["tasks"][t]["success_rate"], v["tasks"][t]["progress_rate"])
            if t in v["tasks"]
            else (math.nan, math.nan)
            for t in tasks
        ]
        vals.append((v[HELD_OUT]["success_rate"], v[HELD_OUT]["progress_rate"]))
        lines.append(row(vname, vals))
        # How the replies fared (valid-action % / format-error %): no held-out average of these.
        rates = [
            tuple(v["tasks"][t].get(k) for k in BEHAVIOUR) if t in v["tasks"] else (math.nan, math.nan)
            for t in tasks
        ]
        lines.append(row("  valid / fmt err", [*rates, (None, None)]))
    summary = doc.get("perturbation_summary") or {}
    if summary:
        keys = tasks + [HELD_OUT]
        mean = [(summary[k]["success_rate"]["mean"], summary[k]["progress_rate"]["mean"]) for k in keys]
        std = [(summary[k]["success_rate"]["std"], summary[k]["progress_rate"]["std"]) for k in keys]
        lines.append(row("perturbed mean", mean))
        lines.append(row("perturbed std", std))
    weights = variants.get("original", next(iter(variants.values())))[HELD_OUT]["weights"]
    lines.append(
        f"held-out weights (paper: {weights_label()}; TextWorld takes Jericho's): "
        + ", ".join(f"{names[t]} {weights[t]:.3f}" for t in tasks if t in weights)
    )
    counts = []
    for vname, v in variants.items():
        for t, m in v["tasks"].items():
            bad = {k: c for k, c in m["terminations"].items() if k in ("error", "context_overflow")}
            if bad:
                counts.append(f"{vname}/{t}: {bad}")
    if counts:
        lines.append("episodes ended by errors (counted as failures): " + "; ".join(counts))
    best_of = doc["config"]["best_of"]
    if best_of > 1:
        lines.append(f"Best-of-{best_of}: an episode succeeds if any sample succeeds; progress is the max.")
        lines += best_of_table(doc["best_of"]) if "best_of" in doc else []
    return "\n".join(lines)


__all__ = [
    "TASK_NAMES",
    "EvalConfig",
    "available_tasks",
    "format_table",
    "make_task",
    "register_task",
    "run_eval",
    "task_weights",
    "variant_name",
]
