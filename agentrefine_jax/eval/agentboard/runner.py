"""Run AgentBoard tasks on a checkout, report AgentBoard's metrics, write logs readable beside AgentBoard's.

Metrics per task (AgentBoard's `evaluate`): success_rate, progress_rate, grounding_acc (episode means) and the
`_easy`/`_hard` splits by test.jsonl's `difficulty`. Across tasks (`eval/results.py`, the layout both sources
write): the paper's weighted held-out average and, when the four held-out tasks ran, their unweighted mean
(AgentBoard's convention for its summaries).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from agentrefine_jax.eval import perturb, registry, runner
from agentrefine_jax.eval.agentboard.checkout import Checkout
from agentrefine_jax.eval.agentboard.protocol import (
    MAX_NEW_TOKENS,
    Agent,
    AgentBoardProtocol,
    ModelBackend,
    episode_jobs,
    vllm_system_suffix,
)
from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.core import EpisodeJob, EpisodeResult
from agentrefine_jax.eval.journal import Journal
from agentrefine_jax.eval.metrics import AGENTBOARD_COLUMNS, best_of_metrics, group_metrics
from agentrefine_jax.eval.policies import (
    ActRequest,
    CheckpointPolicy,
    OraclePolicy,
    RandomPolicy,
    SamplingParams,
    ask,
    forget,
)
from agentrefine_jax.eval.results import results_document
from agentrefine_jax.eval.runner import Pass, TaskRun
from agentrefine_jax.outputs import json_dumps

# AgentBoard's own task names (its log file names); ours differ only for ScienceWorld.
AGENTBOARD_NAMES = {"sciworld": "scienceworld"}


# ----------------------------------------------------------------------------------------- model backends


class TemplateModel:
    """A model actor (a local checkpoint or an OpenAI-compatible endpoint, `eval/policies.py`) answering
    AgentBoard's (system, user) prompts.

    The system message and AgentBoard's single user message go through the model's own chat template (llama3 /
    mistral, as in training); prompt tokens are counted on that templated prompt, as AgentBoard's vLLM path
    counts the templated prompt of its family-substring templates. Decoding is AgentBoard's (greedy, 100 new
    tokens, no stop string) unless `sampled` made a Best-of-N copy.
    """

    def __init__(self, name: str, template: Any, context_length: int, actor: Any):
        self.name = name
        self.template = template
        self.context_length = context_length
        self.max_tokens = MAX_NEW_TOKENS
        self.actor = actor
        self.sampling = SamplingParams(0.0, 1.0, MAX_NEW_TOKENS, ())
        self.seed = 0
        self._calls = 0

    def sampled(self, temperature: float, top_p: float, seed: int) -> TemplateModel:
        """The same model decoding at `temperature` (Best-of-N samples); every call draws a fresh seed."""
        twin = TemplateModel(self.name, self.template, self.context_length, self.actor)
        twin.sampling = SamplingParams(temperature, top_p, MAX_NEW_TOKENS, ())
        twin.seed = seed
        return twin

    @staticmethod
    def messages(system: str, user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def num_tokens(self, system: str, user: str) -> int:
        """What AgentBoard's vLLM wrapper counts: `len(tokenizer(full_prompt)["input_ids"])`, the templated
        text tokenized again. The tokenizer adds its BOS (`<|begin_of_text|>` for Llama-3, `<s>` for Mistral)
        in front of a text that already starts with the template's own, so the count is one more than the
        prompt's ids (Mistral's SentencePiece may also split the re-read text differently); counting the ids
        alone let a prompt one token over AgentBoard's budget keep its oldest history item."""
        ids = self.template.encode_prompt(self.messages(system, user))
        text = self.template.decode(ids, skip_special_tokens=False)
        return len(self.template.tokenizer(text)["input_ids"])

    def generate(
        self, prompts: Sequence[tuple[str, str]], keys: Sequence[Hashable] | None = None
    ) -> list[str | Exception]:
        """The actor's reply texts: AgentBoard's backend interface is text-level (its protocol parses and
        logs text; the actor's token ids stay behind this boundary)."""
        self._calls += 1
        seed = (self.seed * 1_000_003 + self._calls) % 2**31
        names = list(keys) if keys is not None else [None] * len(prompts)
        replies = ask(
            self.actor,
            [
                ActRequest(self.messages(s, u), seed + i, 0, self.sampling, key=k)
                for i, ((s, u), k) in enumerate(zip(prompts, names, strict=True))
            ],
        )
        return [r if isinstance(r, Exception) else r.text for r in replies]

    def forget(self, key: Hashable) -> None:
        forget(self.actor, key)

    def close(self) -> None:
        self.actor.close()


def template_model(actor: Any, template: str | None, context_length: int | None) -> TemplateModel:
    """A model actor under AgentBoard's protocol: a checkpoint counts tokens with its own chat template (its
    context by default); an endpoint needs the template's name and the context length."""
    gen = getattr(actor, "generator", None)
    if gen is not None:
        ctx = context_length or int(gen.model.cfg.max_position_embeddings)
        return TemplateModel(actor.name, gen.template, ctx, actor)
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer

    if not template or not context_length:
        raise ValueError(
            "the agentboard source with --base-url needs --template (llama3|mistral) and --context-length: "
            "history is truncated on the templated prompt's token count"
        )
    return TemplateModel(actor.name, get_template(template, load_tokenizer(template)), context_length, actor)


def checkpoint_model(
    path: str,
    template: str | None,
    context_length: int | None,
    *,
    kv_reuse: bool = True,
    dtype: str | None = None,
) -> TemplateModel:
    return template_model(
        CheckpointPolicy(path, SamplingParams(), template=template, kv_reuse=kv_reuse, dtype=dtype),
        template,
        context_length,
    )


# ----------------------------------------------------------------------------------------- logs


def _trajectory(log: EpisodeResult) -> dict[str, Any]:
    # AgentBoard keys its trajectory by step; its step-0 observation overwrites the initial one.
    traj: dict[str, Any] = {}
    for k, turn in enumerate(log.trace):
        entry: dict[str, Any] = {}
        if k == 0:
            entry["Goal"] = log.goal
        entry["Observation"] = turn["observation"]
        entry["Action"] = turn["action"]
        entry["Progress Rate"] = turn["progress"]
        traj[f"Interaction Turn {k}"] = entry
    return traj


def agentboard_log(log: EpisodeResult) -> dict[str, Any]:
    rec = {
        "id": log.spec.index,
        "task_name": log.spec.info.get("task_name", log.spec.info.get("game", log.spec.task)),
        "goal": log.goal,
        "difficulty": log.spec.difficulty,
        "is_done": log.success,
        "progress_rate": log.progress,
        "grounding_acc": log.grounding,
        "score_change_record": [list(x) for x in log.score_change_record],
        "trajectory": _trajectory(log),
        # Ours, beyond AgentBoard's fields: what its log loses.
        "episode_id": log.spec.id,
        "initial_observation": log.initial_observation,
        "end": log.end,
        "history_items_dropped": log.dropped_history,
    }
    if not log.success and log.last_prompt is not None:
        rec["example_prompt"] = log.last_prompt
    return rec


def episode_record(r: EpisodeResult) -> dict[str, Any]:
    """An AgentBoard-source episode in the results JSON (its summary: the transcript is in the logs)."""
    return {
        "task": r.task,
        "variant": r.variant,
        "index": r.spec.index,
        "id": r.spec.id,
        "difficulty": r.spec.difficulty,
        "success": r.success,
        "progress_rate": r.progress,
        "grounding_acc": r.grounding,
        "steps": r.steps,
        "end": r.end,
    }


class LogWriter:
    """{dir}/logs/<task>.jsonl (indent=2 objects), {dir}/<task>.txt summary lines, {dir}/all_results.txt."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(os.path.join(root, "logs"), exist_ok=True)

    def episode(self, task: str, log: EpisodeResult) -> None:
        name = AGENTBOARD_NAMES.get(task, task)
        with open(os.path.join(self.root, "logs", f"{name}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json_dumps(agentboard_log(log), ensure_ascii=False, indent=2) + "\n")
        with open(os.path.join(self.root, f"{name}.txt"), "a", encoding="utf-8") as f:
            f.write(
                f"[EXP] {log.spec.index}: [success_rate]: {log.success}, [progress_rate]: {log.progress}, "
                f"[grounding_acc]: {log.grounding}, [score_state]: {log.score_change_record}\n"
            )

    def task(self, task: str, metrics: dict[str, Any]) -> None:
        row = {"task_name": AGENTBOARD_NAMES.get(task, task)} | {
            k: v for k, v in metrics.items() if k != "seconds"
        }
        with open(os.path.join(self.root, "all_results.txt"), "a", encoding="utf-8") as f:
            f.write(json_dumps(row) + "\n")


# ----------------------------------------------------------------------------------------- run


class AgentBoardSource:
    """AgentBoard's episodes on a checkout under its protocol (`runner.run` runs it): every variant run
    greedily, the original sampled N times in a pass of its own; its logs written as episodes end."""

    name = "agentboard"
    sampled_variants = False

    def __init__(
        self, checkout: Checkout, config: EvalConfig, model: ModelBackend | None, policy: str | None, log: Any
    ):
        self.checkout, self.config, self.model, self.policy, self.log = checkout, config, model, policy, log
        # strict (a model run): every protocol file is required
        strict = model is not None
        self.opened = [registry.make_task(t, source="agentboard", strict=strict) for t in config.tasks]
        for task in self.opened:
            # tasks whose oracle data costs time at load (ScienceWorld) make it now
            if policy == "oracle" and hasattr(task, "gold_paths"):
                task.gold_paths = True
        # every checkout error before any episode runs
        self.all_episodes = {t.name: t.episodes(checkout) for t in self.opened}
        self.suffix = vllm_system_suffix(checkout) if model is not None else ""
        self.actor: Any = model or (OraclePolicy() if policy == "oracle" else RandomPolicy())
        self.writer = LogWriter(config.log_dir) if config.log_dir else None

    def tasks(self) -> Sequence[Any]:
        return self.opened

    @staticmethod
    def open(task: Any) -> tuple[str, Any]:
        return task.name, task

    def episodes(self, name: str, task: Any) -> tuple[list[Any], int]:
        cfg, specs = self.config, self.all_episodes[name]
        # AgentBoard's reworded-action variants (Table 3) are ALFWorld's
        variants = cfg.perturbations + 1 if name == "alfworld" else 1
        return specs[: cfg.episodes] if cfg.episodes else specs, variants

    def jobs(self, name: str, task: Any, specs: list[Any], ps: Pass) -> list[EpisodeJob]:
        cfg = self.config
        assert cfg.max_steps is not None  # validate() resolved AgentBoard's default
        return [
            job
            for p in ps.variants
            for k in ps.samples
            for job in episode_jobs(task, specs, cfg.max_steps, perturbation=p, sample=k, seed=cfg.seed)
        ]

    def protocol(self, task: Any, ps: Pass) -> AgentBoardProtocol:
        cfg = self.config
        if self.model is None:
            agent = Agent(policy=self.actor)
        elif ps.greedy:
            agent = Agent(model=self.model, system_suffix=self.suffix)
        else:  # a fresh sampled copy per task: its calls draw their seeds from the run's seed
            sampled = self.model.sampled(float(cfg.temperature or 0.0), cfg.top_p, cfg.seed)
            agent = Agent(model=sampled, system_suffix=self.suffix)
        return AgentBoardProtocol(task, self.checkout, agent, cfg.batch_size)

    def announce(self, name: str, ps: Pass, jobs: list[EpisodeJob], episodes: int) -> str:
        n = self.config.best_of
        if ps.name == "samples":
            return f"[agentboard] {name}: Best-of-{n}, {episodes} episodes x {n} samples"
        if ps.name == "perturb":
            return "\n".join(
                f"[agentboard] {name}: perturbation {k} ({perturb.rewording(k).name})" for k in ps.variants
            )
        return ""

    def on_done(self, name: str, specs: list[Any]) -> Callable[[EpisodeResult], None]:
        def report(ep: EpisodeResult) -> None:
            self.log(
                f"[agentboard] {name} {ep.spec.index + 1}/{len(specs)} {ep.spec.id}: "
                f"success={int(ep.success)} progress={ep.progress:.3f} steps={ep.steps} ({ep.end})"
            )
            if self.writer is not None:
                self.writer.episode(name, ep)

        return report

    def document(self, runs: dict[str, TaskRun], seconds: float) -> dict[str, Any]:
        config = self.config
        per_task: dict[str, Any] = {}
        variants: dict[str, dict[str, Any]] = {"original": per_task}
        records: list[dict[str, Any]] = []
        bon: dict[str, Any] | None = None
        if config.best_of > 1:
            bon = {
                "n": config.best_of,
                "temperature": config.temperature,
                "top_p": config.top_p,
                "greedy_run": "temperature 0",  # a run of its own, also for a policy (same seeds)
                "tasks": {},
                "episodes": [],
            }
        for name, run in runs.items():
            main = run.passes["main"]
            metrics = group_metrics(main, AGENTBOARD_COLUMNS) | {"seconds": run.seconds}
            if config.episodes:
                metrics["limited_to"] = config.episodes
            per_task[name] = metrics
            records += [episode_record(x) for x in main]
            if self.writer is not None:
                self.writer.task(name, metrics)
            if bon is not None:
                bon["tasks"][name] = best_of_metrics(run.greedy, run.samples)
                bon["episodes"] += [
                    episode_record(x) | {"sample": x.sample, "actions": [t["action"] for t in x.trace]}
                    for x in run.samples
                ]
            perturbed = run.passes.get("perturb", [])
            for variant in dict.fromkeys(x.variant for x in perturbed):  # perturbation_<k>, in k's order
                logs = [x for x in perturbed if x.variant == variant]
                m = {"rewording": perturb.rewording(int(variant.split("_")[1])).name}
                variants.setdefault(variant, {})[name] = m | group_metrics(logs, AGENTBOARD_COLUMNS)
                records += [episode_record(x) for x in logs]
        extra: dict[str, Any] = {"agentboard_dir": str(self.checkout.root), "max_steps": config.max_steps}
        notes = [n for t in self.opened for n in getattr(t, "notes", [])]
        if notes:
            extra["checkout_notes"] = notes
        name = self.model.name if self.model is not None else str(self.policy)
        return results_document(
            "agentboard",
            name,
            config,
            tasks=per_task,
            variants=variants,
            episodes=records,
            best_of=bon,
            extra=extra,
        )


def run(
    checkout: Checkout,
    config: EvalConfig,
    *,
    model: ModelBackend | None = None,
    policy: str | None = None,
    log: Callable[[str], None] = print,
    journal: Journal | None = None,
    phase: Sequence[Any] = (),
) -> dict[str, Any]:
    """Evaluate a model backend, or a policy ("oracle" | "random"), on `config.tasks`. With a `journal`,
    episodes an interrupted run finished (under `phase`, e.g. a checkpoint's step) are taken from it."""
    if config.source != "agentboard":
        raise ValueError("agentboard.runner.run needs EvalConfig(source='agentboard')")
    config.validate()
    if (model is None) == (policy is None):
        raise ValueError("give exactly one of a model or a policy")
    if policy not in (None, "oracle", "random"):
        raise ValueError(f"unknown policy {policy!r}")
    source = AgentBoardSource(checkout, config, model, policy, log)
    return runner.run(source, log=log, journal=journal, phase=phase)


# ----------------------------------------------------------------------------------------- run directories


def kept_checkpoints(path: str) -> list[tuple[int, str]]:
    """(step, step dir) of every finished checkpoint of a training run dir or checkpoint root, ascending."""
    from agentrefine_jax.checkpoint import RUN_CHECKPOINTS_SUBDIR, checkpoint_steps
    from agentrefine_jax.paths import as_path

    p = as_path(path)
    root = p / RUN_CHECKPOINTS_SUBDIR if (p / RUN_CHECKPOINTS_SUBDIR).is_dir() else p
    steps = checkpoint_steps(root)
    if not steps:
        raise ValueError(f"{path}: no finished checkpoint (expected a run dir with checkpoints/ or a root)")
    return [(s, str(root / str(s))) for s in steps]


def selection_score(doc: dict[str, Any]) -> tuple[float, float]:
    """What "best checkpoint" maximises: the held-out unweighted mean success (then progress) when all four
    held-out tasks ran, else the unweighted mean over the tasks that ran."""
    held = doc.get("held_out", {})
    if "unweighted_mean" in held:
        u = held["unweighted_mean"]
        return (u["success_rate"], u["progress_rate"])
    tasks = list(doc["tasks"].values())
    return (
        sum(t["success_rate"] for t in tasks) / len(tasks),
        sum(t["progress_rate"] for t in tasks) / len(tasks),
    )


def run_checkpoints(
    checkout: Checkout,
    config: EvalConfig,
    checkpoints: Sequence[tuple[int, str]],
    make_model: Callable[[str], ModelBackend],
    log: Callable[[str], None] = print,
    journal: Journal | None = None,
) -> dict[str, Any]:
    """Evaluate each kept checkpoint (the paper reports the epoch with the best average) and pick the best."""
    from agentrefine_jax.eval.model_identity import checkpoint_identity

    results = []
    for step, path in checkpoints:
        log(f"[agentboard] checkpoint step {step}: {path}")
        # The step's parameters' fingerprint keys its journaled episodes: a step saved again with other
        # parameters since an interrupted run is evaluated afresh, never mixed with the old episodes.
        fingerprint = checkpoint_identity(path)["fingerprint"]
        model = make_model(path)
        try:
            step_cfg = dataclasses.replace(
                config, log_dir=os.path.join(config.log_dir, f"step_{step}") if config.log_dir else None
            )
            phase = [f"step_{step}", fingerprint]
            doc = run(checkout, step_cfg, model=model, log=log, journal=journal, phase=phase)
        finally:
            model.close()
        score = list(selection_score(doc))
        results.append(
            {"step": step, "checkpoint": path, "fingerprint": fingerprint, "score": score, "result": doc}
        )
    best = max(results, key=lambda r: (tuple(r["score"]), -r["step"]))  # ties: the earlier checkpoint
    return {
        "protocol": "agentboard",
        "selection": "held-out unweighted mean success, then progress (mean of the tasks run if not all 4)",
        "best_step": best["step"],
        "best_checkpoint": best["checkpoint"],
        "checkpoints": results,
    }
