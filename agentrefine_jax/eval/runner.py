"""The one evaluation runner: a run's tasks x perturbation variants x episodes x Best-of-N samples on the one
engine (`core.run_episodes`), for either episode source; the source is data (`Source`: its tasks, jobs and
protocol, and the results document it writes). The built-in source (`BuiltinSource`, `run_eval`) lives
here; AgentBoard's is `agentboard.runner.AgentBoardSource`.

A task's run is a list of passes (`task_passes`), each one engine call under one journal phase. Where
Best-of-N samples stand is the source's data (`Source.sampled_variants`): the built-in source samples
every variant N times in its main pass and runs the greedy original beside them; AgentBoard's runs every
variant greedily and samples the original N times in a pass of its own. A privileged policy answers from
the env and its seed alone, so a later pass's job that an earlier pass already ran with the same seed (any
seed, for a seedless policy such as the oracle) takes that record instead of running again.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.core import EpisodeJob, EpisodeProtocol, EpisodeResult, job_seed, run_episodes
from agentrefine_jax.eval.envs.base import EvalTask
from agentrefine_jax.eval.journal import Journal
from agentrefine_jax.eval.loop import ChatProtocol
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


@dataclasses.dataclass(frozen=True)
class Pass:
    """One engine call over a task's episodes: which perturbation variants and Best-of-N samples, decoded
    greedily (temperature 0) or under the run's sampling settings. `name` is its journal phase and its
    role: "main" (reported as its episodes end), "greedy", "samples" or "perturb"."""

    name: str
    variants: tuple[int, ...]
    samples: tuple[int, ...]
    greedy: bool


def task_passes(variants: int, best_of: int, *, sampled_variants: bool) -> list[Pass]:
    """A task's passes. Sampled variants: every variant N times in the main pass (the run's sampling
    settings), the greedy original beside them when N > 1. Otherwise: the greedy original, its N samples
    when N > 1, then the other variants greedily."""
    every, n = tuple(range(variants)), tuple(range(best_of))
    if sampled_variants:
        beside = [Pass("greedy", (0,), (0,), greedy=True)] if best_of > 1 else []
        return [Pass("main", every, n, greedy=False), *beside]
    out = [Pass("main", (0,), (0,), greedy=True)]
    if best_of > 1:
        out.append(Pass("samples", (0,), n, greedy=False))
    if variants > 1:
        out.append(Pass("perturb", every[1:], (0,), greedy=True))
    return out


@dataclasses.dataclass
class TaskRun:
    """What a task's passes made (pass name -> records in job order) and how long they took."""

    passes: dict[str, list[EpisodeResult]]
    seconds: float

    @property
    def variants(self) -> list[EpisodeResult]:
        """Every variant's records: the main pass's, then the perturbed variants' of their own pass."""
        return self.passes["main"] + self.passes.get("perturb", [])

    @property
    def greedy(self) -> list[EpisodeResult]:
        """The single greedy sample of the original variant, beside Best-of-N."""
        return self.passes.get("greedy") or self._original

    @property
    def samples(self) -> list[EpisodeResult]:
        """The Best-of-N samples of the original variant."""
        return self.passes.get("samples") or self._original

    @property
    def _original(self) -> list[EpisodeResult]:
        return [r for r in self.passes["main"] if r.variant == "original"]


class Source(Protocol):
    """An episode source as the runner reads it: its tasks (opened one at a time, closed after their
    passes), each task's episodes and variant count, a pass's jobs and protocol, a line announcing a pass,
    the main pass's report of each ended episode, and the results document of the run."""

    name: str  # "builtin" | "agentboard"
    config: EvalConfig  # the run's
    sampled_variants: bool  # where Best-of-N samples stand (`task_passes`)
    actor: Any  # a privileged policy's `seeded` says which records a later pass may reuse

    def tasks(self) -> Sequence[Any]: ...
    def open(self, handle: Any) -> tuple[str, Any]: ...
    def episodes(self, name: str, task: Any) -> tuple[list[Any], int]: ...
    def jobs(self, name: str, task: Any, specs: list[Any], ps: Pass) -> list[EpisodeJob]: ...
    def protocol(self, task: Any, ps: Pass) -> EpisodeProtocol: ...
    def announce(self, name: str, ps: Pass, jobs: list[EpisodeJob], episodes: int) -> str: ...
    def on_done(self, name: str, specs: list[Any]) -> Callable[[EpisodeResult], None]: ...
    def document(self, runs: dict[str, TaskRun], seconds: float) -> dict[str, Any]: ...


def run(
    source: Source,
    *,
    log: Callable[[str], None] = print,
    journal: Journal | None = None,
    phase: Sequence[Hashable] = (),
) -> dict[str, Any]:
    """Run every task of `source` and return its results document. With a `journal`, episodes an
    interrupted run finished (under `phase`, then the pass's name) are taken from it."""
    runs: dict[str, TaskRun] = {}
    t0 = time.perf_counter()
    if journal is not None:
        journal.begin()
    for handle in source.tasks():
        name, task = source.open(handle)
        try:
            runs[name] = _run_task(source, name, task, log, journal, phase)
        finally:
            task.close()
    seconds = round(time.perf_counter() - t0, 1)
    doc = source.document(runs, seconds)
    if journal is not None and journal.resumed:
        # A resumed result: its time is every sitting's (per-task seconds stay this sitting's).
        doc["seconds"] = journal.total_seconds(seconds)
        doc["sittings"] = journal.prior_sittings + 1
    return doc


def _run_task(
    source: Source,
    name: str,
    task: Any,
    log: Callable[[str], None],
    journal: Journal | None,
    phase: Sequence[Hashable],
) -> TaskRun:
    """A task's passes in order; a job a privileged policy answered in an earlier pass takes that record."""
    t0 = time.perf_counter()
    specs, variants = source.episodes(name, task)
    privileged = is_privileged(source.actor)
    seeded = getattr(source.actor, "seeded", True)

    def same(job: EpisodeJob) -> tuple[Any, ...]:
        return (job.perturbation, job.episode, job.seed if seeded else None)

    ran: dict[tuple[Any, ...], EpisodeResult] = {}
    passes: dict[str, list[EpisodeResult]] = {}
    for ps in task_passes(variants, source.config.best_of, sampled_variants=source.sampled_variants):
        jobs = source.jobs(name, task, specs, ps)
        todo = [j for j in jobs if not (privileged and same(j) in ran)]
        runs = {id(j) for j in todo}
        line = source.announce(name, ps, todo, len(specs)) if todo else ""
        if line:
            log(line)
        on_done = source.on_done(name, specs) if ps.name == "main" else None
        protocol = source.protocol(task, ps)
        fresh = iter(run_episodes(todo, protocol, on_done=on_done, journal=journal, phase=[*phase, ps.name]))
        out = [next(fresh) if id(j) in runs else replace(ran[same(j)], sample=j.sample) for j in jobs]
        for j, r in zip(jobs, out, strict=True):
            ran.setdefault(same(j), r)
        passes[ps.name] = out
    return TaskRun(passes, round(time.perf_counter() - t0, 1))


# ----------------------------------------------------------------------------------------- built-in source


class BuiltinSource:
    """Our episodes (`envs/`, `hotpotqa/`, plug-ins) under our chat protocol: every variant sampled N
    times, a model's greedy run beside them (a privileged policy's is its sample 0: the same seeds)."""

    name = "builtin"
    sampled_variants = True

    def __init__(self, policy: Policy, config: EvalConfig, log: Callable[[str], None]):
        self.actor, self.config, self.log = policy, config, log

    def tasks(self) -> Sequence[str]:
        workdir = self.config.workdir
        os.makedirs(workdir, exist_ok=True)
        # matplotlib (imported by pddlgym) would otherwise build its font cache under $HOME.
        os.environ.setdefault("MPLCONFIGDIR", os.path.join(workdir, "matplotlib"))
        return self.config.tasks

    def open(self, name: str) -> tuple[str, EvalTask]:
        return name, make_task(name, self.config.workdir, **self.config.task_options.get(name, {}))

    def episodes(self, name: str, task: EvalTask) -> tuple[list[Any], int]:
        config = self.config
        specs = task.episode_specs(config.episodes, config.seed)
        task.prepare(specs)
        n_pert = min(config.perturbations, task.num_perturbations)
        if n_pert < config.perturbations:
            self.log(f"{name}: the task defines {task.num_perturbations} perturbations; running those")
        return specs, n_pert + 1

    def jobs(self, name: str, task: EvalTask, specs: list[Any], ps: Pass) -> list[EpisodeJob]:
        """Every (variant, episode, sample) of the pass, in that order, each with its own seed."""
        cfg = self.config
        steps = cfg.max_steps or task.default_max_steps
        greedy = ps.greedy and not is_privileged(self.actor)  # a privileged policy does not decode
        sampling = dataclasses.replace(self.actor.sampling, temperature=0.0) if greedy else None
        return [
            EpisodeJob(
                name, task, s, i, p, k, steps, job_seed(cfg.seed, name, p, i, k), cfg.prompt_style, sampling
            )
            for p in ps.variants
            for i, s in enumerate(specs)
            for k in ps.samples
        ]

    def protocol(self, task: EvalTask, ps: Pass) -> ChatProtocol:
        return ChatProtocol(self.actor, self.config.batch_size)

    def announce(self, name: str, ps: Pass, jobs: list[EpisodeJob], episodes: int) -> str:
        if ps.name == "greedy":
            return f"{name}: greedy run of {len(jobs)} episodes beside Best-of-{self.config.best_of}"
        return (
            f"{name}: {episodes} episodes x {len(ps.variants)} variant(s) x {len(ps.samples)} sample(s), "
            f"max {jobs[0].max_steps} steps, policy {self.actor.name}"
        )

    def on_done(self, name: str, specs: list[Any]) -> Callable[[EpisodeResult], None]:
        def report(r: EpisodeResult) -> None:
            extra = f" ({r.error})" if r.error else ""
            self.log(
                f"{r.task} {r.variant} episode {r.episode} sample {r.sample}: success={int(r.success)} "
                f"progress={r.progress:.2f} steps={r.steps} end={r.termination}{extra}"
            )

        return report

    def document(self, runs: dict[str, TaskRun], seconds: float) -> dict[str, Any]:
        config = self.config
        results = [r for run in runs.values() for r in run.variants]
        variants = task_metrics(results)
        best_of = self._best_of_section(runs) if config.best_of > 1 else None
        # The headline is the greedy run where Best-of-N sampled the variants, else the original variant.
        headline = (
            task_metrics([r for run in runs.values() for r in run.greedy])["original"] if best_of else None
        )
        return results_document(
            "builtin",
            self.actor.name,
            config,
            tasks=headline or variants.get("original", {}),
            variants=variants,
            episodes=[r.to_json() for r in results],
            best_of=best_of,
            extra={"policy": self.actor.name, "seconds": seconds},
        )

    def _best_of_section(self, runs: dict[str, TaskRun]) -> dict[str, Any]:
        sampling = getattr(self.actor, "sampling", None)
        return {
            "n": self.config.best_of,
            "temperature": sampling and sampling.temperature,
            "top_p": sampling and sampling.top_p,
            # a privileged policy's greedy row is its sample 0 (the same seeds), not a run of its own
            "greedy_run": "sample 0" if is_privileged(self.actor) else "temperature 0",
            "tasks": {t: best_of_metrics(run.greedy, run.samples) for t, run in runs.items()},
            "greedy_episodes": [r.to_json() for run in runs.values() for r in run.greedy],
        }


def run_eval(
    policy: Policy, config: EvalConfig, log: Callable[[str], None] = print, journal: Journal | None = None
) -> dict[str, Any]:
    """Run every built-in episode and return the results document (metrics, config, transcripts). With a
    `journal`, episodes an interrupted run finished are taken from it and every new one is appended."""
    if config.source != "builtin":
        raise ValueError("run_eval runs the built-in source (AgentBoard's: eval.agentboard.runner.run)")
    config.validate()
    return run(BuiltinSource(policy, config, log), log=log, journal=journal)


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
