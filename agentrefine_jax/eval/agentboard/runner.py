"""Run AgentBoard tasks on a checkout, report AgentBoard's metrics, write logs readable beside AgentBoard's.

Metrics per task (AgentBoard's `evaluate`): success_rate, progress_rate, grounding_acc (episode means) and the
`_easy`/`_hard` splits by test.jsonl's `difficulty`. Across tasks (`eval/results.py`, the layout both sources
write): the paper's weighted held-out average and, when the four held-out tasks ran, their unweighted mean
(AgentBoard's convention for its summaries).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from agentrefine_jax.eval import perturb, registry
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
from agentrefine_jax.eval.core import EpisodeResult, run_episodes
from agentrefine_jax.eval.journal import Journal
from agentrefine_jax.eval.metrics import AGENTBOARD_COLUMNS, best_of_metrics, group_metrics
from agentrefine_jax.eval.perturb import variant_name
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
    path: str, template: str | None, context_length: int | None, *, kv_reuse: bool = True
) -> TemplateModel:
    return template_model(
        CheckpointPolicy(path, SamplingParams(), template=template, kv_reuse=kv_reuse),
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
    # strict (a model run): every protocol file is required
    tasks = [registry.make_task(t, source="agentboard", strict=model is not None) for t in config.tasks]
    for task in tasks:
        if policy == "oracle" and hasattr(task, "gold_paths"):
            task.gold_paths = True  # tasks whose oracle data costs time at load (ScienceWorld) make it now
    episodes = {t.name: t.episodes(checkout) for t in tasks}  # every checkout error before any episode runs
    suffix = vllm_system_suffix(checkout) if model is not None else ""
    agent = _agent(model, policy, config.seed, suffix)
    writer = LogWriter(config.log_dir) if config.log_dir else None
    per_task: dict[str, Any] = {}
    variants: dict[str, dict[str, Any]] = {"original": per_task}
    records: list[dict[str, Any]] = []
    bon: dict[str, Any] | None = None
    for task in tasks:
        specs = episodes[task.name][: config.episodes] if config.episodes else episodes[task.name]
        t0 = time.time()

        def report(ep: EpisodeResult, task: Any = task, specs: list = specs) -> None:
            log(
                f"[agentboard] {task.name} {ep.spec.index + 1}/{len(specs)} {ep.spec.id}: "
                f"success={int(ep.success)} progress={ep.progress:.3f} steps={ep.steps} ({ep.end})"
            )
            if writer is not None:
                writer.episode(task.name, ep)

        try:
            jr = {"journal": journal}
            logs = _episodes(
                task, checkout, specs, agent, config, on_done=report, phase=[*phase, "main"], **jr
            )
            if config.best_of > 1:
                samples = _samples(
                    task, checkout, specs, logs, model, policy, suffix, config, log, [*phase, "samples"], jr
                )
                bon = bon or {
                    "n": config.best_of,
                    "temperature": config.temperature,
                    "top_p": config.top_p,
                    "greedy_run": "temperature 0",  # a run of its own, also for a policy (same seeds)
                    "tasks": {},
                    "episodes": [],
                }
                bon["tasks"][task.name] = best_of_metrics(logs, samples)
                bon["episodes"] += [
                    episode_record(x) | {"sample": x.sample, "actions": [t["action"] for t in x.trace]}
                    for x in samples
                ]
        finally:
            task.close()
        metrics = group_metrics(logs, AGENTBOARD_COLUMNS) | {"seconds": round(time.time() - t0, 1)}
        if config.episodes:
            metrics["limited_to"] = config.episodes
        per_task[task.name] = metrics
        records += [episode_record(x) for x in logs]
        if writer is not None:
            writer.task(task.name, metrics)
        if config.perturbations and task.name == "alfworld":
            for k, plogs in _perturbed(
                task, checkout, specs, agent, config, log, [*phase, "perturb"], journal
            ):
                m = {"rewording": perturb.rewording(k).name} | group_metrics(plogs, AGENTBOARD_COLUMNS)
                variants.setdefault(variant_name(k), {})[task.name] = m
                records += [episode_record(x) for x in plogs]
    extra: dict[str, Any] = {"agentboard_dir": str(checkout.root), "max_steps": config.max_steps}
    notes = [n for t in tasks for n in getattr(t, "notes", [])]
    if notes:
        extra["checkout_notes"] = notes
    name = model.name if model is not None else str(policy)
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


def _episodes(
    task: Any,
    checkout: Checkout,
    specs: Sequence[Any],
    agent: Agent,
    config: EvalConfig,
    *,
    perturbations: Sequence[int] = (0,),
    samples: Sequence[int] = (0,),
    **kw: Any,
) -> list[EpisodeResult]:
    """Every episode of `specs` under each perturbation variant and as each Best-of-N sample (in that
    order: variant, sample, episode), all in one engine call."""
    assert config.max_steps is not None  # validate() resolved AgentBoard's default
    jobs = [
        job
        for p in perturbations
        for k in samples
        for job in episode_jobs(task, specs, config.max_steps, perturbation=p, sample=k)
    ]
    return run_episodes(jobs, AgentBoardProtocol(task, checkout, agent, config.batch_size), **kw)


# ----------------------------------------------------------------------------------------- Best-of-N


def _agent(model: ModelBackend | None, policy: str | None, seed: int, suffix: str, sample: int = 0) -> Agent:
    if model is not None:
        return Agent(model=model, system_suffix=suffix)
    actor = OraclePolicy() if policy == "oracle" else RandomPolicy()
    # Sample 0 of a privileged policy is the greedy run itself (same seeds): Best-of-N >= single sample.
    return Agent(
        policy_for=lambda task, env, spec: actor.for_episode(
            task, env, spec, seed * 100003 + spec.index + sample * 7_000_003
        )
    )


def _samples(
    task: Any,
    checkout: Checkout,
    specs: Sequence[Any],
    greedy: Sequence[EpisodeResult],
    model: ModelBackend | None,
    policy: str | None,
    suffix: str,
    config: EvalConfig,
    log: Callable[[str], None],
    phase: list[Any],
    jr: dict[str, Any],
) -> list[EpisodeResult]:
    """`config.best_of` samples of every episode. A model decodes at the temperature and all samples of all
    episodes share the batched calls; the random policy draws sample k with its own seed (sample 0 = the
    greedy run's); the oracle is deterministic, so its samples are the greedy run."""
    n = config.best_of
    log(f"[agentboard] {task.name}: Best-of-{n}, {len(specs)} episodes x {n} samples")
    if policy == "oracle":
        out = [dataclasses.replace(x, sample=k) for k in range(n) for x in greedy]
    elif model is not None:
        sampled = model.sampled(float(config.temperature or 0.0), config.top_p, config.seed)
        agent = Agent(model=sampled, system_suffix=suffix)
        out = _episodes(task, checkout, specs, agent, config, samples=range(n), phase=phase, **jr)
    else:
        out = []
        for k in range(n):
            agent = _agent(None, policy, config.seed, suffix, sample=k)
            out += _episodes(task, checkout, specs, agent, config, samples=[k], phase=[*phase, k], **jr)
    return out


def _perturbed(
    task: Any,
    checkout: Checkout,
    specs: Sequence[Any],
    agent: Agent,
    config: EvalConfig,
    log: Callable[[str], None],
    phase: list[Any],
    journal: Journal | None,
) -> list[tuple[int, list[EpisodeResult]]]:
    """(k, episodes) of the task's episodes again under each reworded-action variant k (Table 3). The
    variants' jobs run together, as the built-in source's do: a model answers them in the same batches."""
    ks = range(1, config.perturbations + 1)
    for k in ks:
        log(f"[agentboard] {task.name}: perturbation {k} ({perturb.rewording(k).name})")
    logs = _episodes(task, checkout, specs, agent, config, perturbations=ks, phase=phase, journal=journal)
    n = len(specs)
    return [(k, logs[i * n : (i + 1) * n]) for i, k in enumerate(ks)]


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
