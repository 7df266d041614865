"""Evaluation runs: tasks x perturbation variants x episodes x Best-of-N samples, then the report."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.core import EpisodeJob, job_seed, run_episodes
from agentrefine_jax.eval.envs.base import EvalTask
from agentrefine_jax.eval.journal import Journal
from agentrefine_jax.eval.loop import ChatProtocol, EpisodeResult
from agentrefine_jax.eval.metrics import best_of_metrics, task_metrics
from agentrefine_jax.eval.perturb import variant_name
from agentrefine_jax.eval.policies import Policy, is_privileged
from agentrefine_jax.eval.registry import (
    available_tasks,
    default_tasks,
    make_task,
    register_task,
    task_weights,
)
from agentrefine_jax.eval.results import results_document

TASK_NAMES = default_tasks("builtin")


def run_eval(
    policy: Policy, config: EvalConfig, log: Callable[[str], None] = print, journal: Journal | None = None
) -> dict[str, Any]:
    """Run every episode and return the results document (metrics, config, transcripts). With a `journal`,
    episodes an interrupted run finished are taken from it and every new one is appended as it ends."""
    if config.source != "builtin":
        raise ValueError("run_eval runs the built-in source (AgentBoard's: eval.agentboard.runner.run)")
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
    variants = task_metrics(results)
    # The headline is the greedy run where Best-of-N sampled the variants, else the original variant.
    headline = task_metrics([r for g in greedy.values() for r in g])["original"] if greedy else None
    return results_document(
        "builtin",
        policy.name,
        config,
        tasks=headline or variants.get("original", {}),
        variants=variants,
        episodes=[r.to_json() for r in results],
        best_of=_best_of(greedy, results, policy, config) if greedy else None,
        extra={"policy": policy.name, "seconds": round(time.perf_counter() - t0, 1)},
    )


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
    n_pert = min(config.perturbations, task.num_perturbations)
    if n_pert < config.perturbations:
        log(f"{name}: the task defines {task.num_perturbations} perturbations; running those")
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
    protocol = ChatProtocol(policy, config.batch_size)
    results = run_episodes(jobs, protocol, on_done=report, journal=journal, phase=["main"])
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
    return run_episodes(jobs, ChatProtocol(policy, config.batch_size), journal=journal, phase=["greedy"])


def _best_of(
    greedy: dict[str, list[EpisodeResult]], results: list[EpisodeResult], policy: Policy, config: EvalConfig
) -> dict[str, Any]:
    original = [r for r in results if r.variant == "original"]
    tasks = {t: best_of_metrics(g, [r for r in original if r.task == t]) for t, g in greedy.items()}
    sampling = getattr(policy, "sampling", None)
    return {
        "n": config.best_of,
        "temperature": sampling and sampling.temperature,
        "top_p": sampling and sampling.top_p,
        # a privileged policy's greedy row is its sample 0 (the same seeds), not a run of its own
        "greedy_run": "sample 0" if is_privileged(policy) else "temperature 0",
        "tasks": tasks,
        "greedy_episodes": [r.to_json() for g in greedy.values() for r in g],
    }


__all__ = [
    "TASK_NAMES",
    "EvalConfig",
    "available_tasks",
    "make_task",
    "register_task",
    "run_eval",
    "task_weights",
    "variant_name",
]
