"""Run AgentBoard tasks on a checkout, report AgentBoard's metrics, write logs readable beside AgentBoard's.

Metrics per task (AgentBoard's `evaluate`): success_rate, progress_rate, grounding_acc (episode means) and the
`_easy`/`_hard` splits by test.jsonl's `difficulty`. Across tasks: the four held-out tasks' unweighted mean
(AgentBoard's convention for its summaries) and, labelled apart, the episode-weighted mean (112/90/60/20 for
BabyAI/ScienceWorld/PDDL/Jericho when complete).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentrefine_jax.eval.agentboard.checkout import Checkout
from agentrefine_jax.eval.agentboard.protocol import (
    DEFAULT_MAX_STEPS,
    MAX_NEW_TOKENS,
    Agent,
    EpisodeLog,
    ModelBackend,
    RandomPolicy,
    run_episodes,
    vllm_system_suffix,
)

TASKS = ("alfworld", "babyai", "sciworld", "pddl", "jericho")
HELD_OUT = ("babyai", "sciworld", "pddl", "jericho")
# AgentBoard's episode counts, for the labelled episode-weighted mean.
EPISODES = {"alfworld": 134, "babyai": 112, "sciworld": 90, "pddl": 60, "jericho": 20}
# AgentBoard's own task names (its log file names); ours differ only for ScienceWorld.
AGENTBOARD_NAMES = {"sciworld": "scienceworld"}
METRICS = ("success_rate", "progress_rate", "grounding_acc")


def make_task(name: str, strict: bool) -> Any:
    """The task object of `tasks/<name>.py`: its class whose `name` is `name` (constructed with `strict` when
    it takes that argument: strict = every protocol file is required, as for a model run)."""
    if name not in TASKS:
        raise ValueError(f"unknown AgentBoard task {name!r}; choose from {','.join(TASKS)}")
    try:
        module = importlib.import_module(f"agentrefine_jax.eval.agentboard.tasks.{name}")
    except ModuleNotFoundError as e:
        if e.name and e.name.endswith(f"tasks.{name}"):
            raise ValueError(f"AgentBoard task {name!r} is not implemented in this build") from None
        raise ImportError(f"task {name!r} needs {e.name}: pip install -e '.[eval]'") from None
    for obj in vars(module).values():
        if (
            inspect.isclass(obj)
            and obj.__module__ == module.__name__
            and getattr(obj, "name", None) == name
            and callable(getattr(obj, "episodes", None))
        ):
            params = inspect.signature(obj).parameters
            return obj(strict=strict) if "strict" in params else obj()
    raise ValueError(f"tasks/{name}.py defines no task class named {name!r}")


# ----------------------------------------------------------------------------------------- model backends


class TemplateModel:
    """A model behind our chat templates: a local checkpoint (ChatGenerator) or an OpenAI-compatible endpoint.

    The system message and AgentBoard's single user message go through the model's own chat template (llama3 /
    mistral, as in training); prompt tokens are counted on that templated prompt, as AgentBoard's vLLM path
    counts the templated prompt of its family-substring templates.
    """

    def __init__(
        self,
        name: str,
        template: Any,
        context_length: int,
        complete: Callable[[list[list[dict[str, str]]]], list[str | Exception]],
        closer: Callable[[], None] | None = None,
    ):
        self.name = name
        self.template = template
        self.context_length = context_length
        self.max_tokens = MAX_NEW_TOKENS
        self._complete = complete
        self._closer = closer

    @staticmethod
    def messages(system: str, user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def num_tokens(self, system: str, user: str) -> int:
        return len(self.template.encode_prompt(self.messages(system, user)))

    def generate(self, prompts: Sequence[tuple[str, str]]) -> list[str | Exception]:
        return self._complete([self.messages(s, u) for s, u in prompts])

    def close(self) -> None:
        if self._closer is not None:
            self._closer()


def checkpoint_model(path: str, template: str | None, context_length: int | None) -> TemplateModel:
    from agentrefine_jax.inference.chat import ChatGenerator

    gen = ChatGenerator.from_checkpoint(path, template=template)
    ctx = context_length or int(gen.model.cfg.max_position_embeddings)

    def complete(convs: list[list[dict[str, str]]]) -> list[str | Exception]:
        # Greedy, 100 new tokens, no stop string (AgentBoard's vLLM settings); the template's end token stops.
        return list(gen.chat(convs, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, top_p=1.0, stop=[]))

    return TemplateModel(f"checkpoint:{path}", gen.template, ctx, complete)


def endpoint_model(
    base_url: str, model: str, template: str, context_length: int, api_key_env: str, timeout: float
) -> TemplateModel:
    import concurrent.futures

    import openai

    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer

    tpl = get_template(template, load_tokenizer(template))
    from agentrefine_jax.http_client import describe_api_error, openai_client

    key = os.environ.get(api_key_env) or "EMPTY"
    client = openai_client(base_url, key, timeout=timeout, max_retries=2)  # timeout: whole request
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    def one(messages: list[dict[str, str]]) -> str | Exception:
        try:
            resp = client.chat.completions.create(
                model=model, messages=messages, temperature=0.0, top_p=1.0, max_tokens=MAX_NEW_TOKENS
            )
        except openai.APIError as e:
            return RuntimeError(describe_api_error(e, key))  # one line, key redacted, no raw body
        return (
            (resp.choices[0].message.content or "") if resp.choices else RuntimeError("no choices returned")
        )

    def close() -> None:
        pool.shutdown(wait=True)
        client.close()

    return TemplateModel(f"openai:{model}", tpl, context_length, lambda c: list(pool.map(one, c)), close)


# ----------------------------------------------------------------------------------------- metrics


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def episode_record(log: EpisodeLog) -> dict[str, Any]:
    return {
        "task": log.spec.task,
        "index": log.spec.index,
        "id": log.spec.id,
        "difficulty": log.spec.difficulty,
        "success": log.success,
        "progress_rate": log.progress,
        "grounding_acc": log.grounding,
        "steps": log.steps,
        "end": log.end,
    }


def task_metrics(logs: Sequence[EpisodeLog]) -> dict[str, Any]:
    """AgentBoard's per-task metrics; a split with no episode is null (AgentBoard writes 0)."""
    out: dict[str, Any] = {"episodes": len(logs)}
    rows = {
        "success_rate": [float(x.success) for x in logs],
        "progress_rate": [x.progress for x in logs],
        "grounding_acc": [x.grounding for x in logs],
    }
    for key, values in rows.items():
        out[key] = _mean(values)
    for split in ("easy", "hard"):
        picked = [x for x in logs if x.spec.difficulty == split]
        out[f"success_rate_{split}"] = _mean([float(x.success) for x in picked])
        out[f"progress_rate_{split}"] = _mean([x.progress for x in picked])
    return out


def held_out_summary(per_task: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Unweighted mean of the four held-out tasks' rates, and the episode-weighted mean (labelled)."""
    missing = [t for t in HELD_OUT if t not in per_task]
    if missing:
        return {"missing": missing, "note": "the held-out means need babyai, sciworld, pddl and jericho"}
    out: dict[str, Any] = {"tasks": list(HELD_OUT)}
    out["unweighted_mean"] = {m: _mean([per_task[t][m] for t in HELD_OUT]) for m in METRICS[:2]}
    counts = {t: per_task[t]["episodes"] for t in HELD_OUT}
    total = sum(counts.values())
    out["episode_weighted_mean"] = {
        m: sum(per_task[t][m] * counts[t] for t in HELD_OUT) / total for m in METRICS[:2]
    } | {
        "weights": counts,
        "label": "weighted by episodes (112/90/60/20 on full sets); not AgentBoard's mean",
    }
    return out


# ----------------------------------------------------------------------------------------- logs


def _trajectory(log: EpisodeLog) -> dict[str, Any]:
    # AgentBoard keys its trajectory by step; its step-0 observation overwrites the initial one.
    traj: dict[str, Any] = {}
    for k, turn in enumerate(log.turns):
        entry: dict[str, Any] = {}
        if k == 0:
            entry["Goal"] = log.goal
        entry["Observation"] = turn["observation"]
        entry["Action"] = turn["action"]
        entry["Progress Rate"] = turn["progress"]
        traj[f"Interaction Turn {k}"] = entry
    return traj


def agentboard_log(log: EpisodeLog) -> dict[str, Any]:
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


class LogWriter:
    """{dir}/logs/<task>.jsonl (indent=2 objects), {dir}/<task>.txt summary lines, {dir}/all_results.txt."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(os.path.join(root, "logs"), exist_ok=True)

    def episode(self, task: str, log: EpisodeLog) -> None:
        name = AGENTBOARD_NAMES.get(task, task)
        with open(os.path.join(self.root, "logs", f"{name}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(agentboard_log(log), ensure_ascii=False, indent=2) + "\n")
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
            f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------------------- run


@dataclasses.dataclass
class RunConfig:
    tasks: tuple[str, ...]
    max_steps: int = DEFAULT_MAX_STEPS
    batch_size: int = 8
    seed: int = 0
    log_dir: str | None = None
    limit: int | None = None  # first N episodes per task (smoke runs; a full run leaves it None)
    perturbations: int = 0  # ALFWorld reworded-action variants to run beside the original (Table 3: 5)

    def validate(self) -> None:
        if not self.tasks:
            raise ValueError("--tasks is empty")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"unknown AgentBoard task {t!r}; choose from {','.join(TASKS)}")
        if self.max_steps < 1:
            raise ValueError("--max-steps must be >= 1")
        if self.batch_size < 1:
            raise ValueError("--batch-size must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--episodes must be >= 1")
        if self.perturbations < 0:
            raise ValueError("--num-perturbations must be >= 0")
        if self.perturbations and "alfworld" not in self.tasks:
            raise ValueError(
                "AgentBoard perturbations (reworded actions, Table 3) are defined for alfworld only"
            )


def run(
    checkout: Checkout,
    config: RunConfig,
    *,
    model: ModelBackend | None = None,
    policy: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate a model backend, or a policy ("oracle" | "random"), on `config.tasks`."""
    config.validate()
    if (model is None) == (policy is None):
        raise ValueError("give exactly one of a model or a policy")
    if policy not in (None, "oracle", "random"):
        raise ValueError(f"unknown policy {policy!r}")
    tasks = [make_task(t, strict=model is not None) for t in config.tasks]
    for task in tasks:
        if policy == "oracle" and hasattr(task, "gold_paths"):
            task.gold_paths = True  # tasks whose oracle data costs time at load (ScienceWorld) make it now
    episodes = {t.name: t.episodes(checkout) for t in tasks}  # every checkout error before any episode runs
    if model is not None:
        agent = Agent(model=model, system_suffix=vllm_system_suffix(checkout))
    elif policy == "oracle":
        agent = Agent(policy_for=_oracle_for)
    else:
        agent = Agent(policy_for=lambda task, env, spec: RandomPolicy(config.seed * 100003 + spec.index))
    writer = LogWriter(config.log_dir) if config.log_dir else None
    doc: dict[str, Any] = {
        "protocol": "agentboard",
        "agentboard_dir": str(checkout.root),
        "agent": model.name if model is not None else policy,
        "max_steps": config.max_steps,
        "tasks": {},
        "episodes": [],
    }
    for task in tasks:
        specs = episodes[task.name][: config.limit] if config.limit else episodes[task.name]
        t0 = time.time()

        def report(ep: EpisodeLog, task: Any = task, specs: list = specs) -> None:
            log(
                f"[agentboard] {task.name} {ep.spec.index + 1}/{len(specs)} {ep.spec.id}: "
                f"success={int(ep.success)} progress={ep.progress:.3f} steps={ep.steps} ({ep.end})"
            )
            if writer is not None:
                writer.episode(task.name, ep)

        try:
            logs = run_episodes(
                task,
                checkout,
                specs,
                agent,
                max_steps=config.max_steps,
                batch_size=config.batch_size,
                on_done=report,
            )
        finally:
            if callable(getattr(task, "close", None)):
                task.close()
        metrics = task_metrics(logs) | {"seconds": round(time.time() - t0, 1)}
        if config.limit:
            metrics["limited_to"] = config.limit
        doc["tasks"][task.name] = metrics
        doc["episodes"] += [episode_record(x) for x in logs]
        if writer is not None:
            writer.task(task.name, metrics)
        if config.perturbations and task.name == "alfworld":
            doc.setdefault("perturbation", {})[task.name] = _perturbed(
                task, checkout, specs, agent, config, metrics, log
            )
    notes = [n for t in tasks for n in getattr(t, "notes", [])]
    if notes:
        doc["checkout_notes"] = notes
    doc["held_out"] = held_out_summary(doc["tasks"])
    return doc


def _perturbed(
    task: Any,
    checkout: Checkout,
    specs: Sequence[Any],
    agent: Agent,
    config: RunConfig,
    original: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The task's episodes again under each reworded-action variant; Table 3's original/mean/std layout."""
    from agentrefine_jax.eval.agentboard import perturb
    from agentrefine_jax.eval.agentboard.protocol import PromptSet

    variants = []
    for k in range(1, config.perturbations + 1):
        rw = perturb.rewording(k)

        def reword(ps: PromptSet, rw: Any = rw) -> PromptSet:
            instruction, examples = perturb.reword_prompt(rw, ps.instruction, ps.examples)
            return PromptSet(instruction, examples, ps.system_msg)

        log(f"[agentboard] {task.name}: perturbation {k} ({rw.name})")
        logs = run_episodes(
            task,
            checkout,
            specs,
            agent,
            max_steps=config.max_steps,
            batch_size=config.batch_size,
            wrap_env=lambda env, rw=rw: perturb.RewordedEnv(env, rw),
            reword_prompt=reword,
        )
        variants.append({"index": k, "name": rw.name} | task_metrics(logs))
    out: dict[str, Any] = {"variants": variants}
    for m in ("success_rate", "progress_rate"):
        out[m] = perturb.summary(original[m], [v[m] for v in variants])
    return out


def _oracle_for(task: Any, env: Any, spec: Any) -> Any:
    oracle = task.oracle(env)
    if oracle is None:
        raise ValueError(f"AgentBoard task {task.name!r} has no offline oracle")
    return oracle


def _pct(x: float | None) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def format_table(doc: dict[str, Any]) -> str:
    """A plain-text table of the per-task metrics and the held-out means."""
    cols = ("success", "progress", "grounding", "SR easy", "SR hard")
    head = f"{'task':<10} {'n':>4} " + " ".join(f"{c:>9}" for c in cols)
    lines = [f"AgentBoard protocol — {doc['agent']} (max {doc['max_steps']} steps)", head]
    for name, m in doc["tasks"].items():
        keys = ("success_rate", "progress_rate", "grounding_acc", "success_rate_easy", "success_rate_hard")
        lines.append(f"{name:<10} {m['episodes']:>4} " + " ".join(f"{_pct(m[k]):>9}" for k in keys))
    held = doc.get("held_out", {})
    if "unweighted_mean" in held:
        u, w = held["unweighted_mean"], held["episode_weighted_mean"]
        lines.append(
            f"held-out unweighted mean (AgentBoard's convention): success {_pct(u['success_rate'])} "
            f"progress {_pct(u['progress_rate'])}"
        )
        lines.append(
            f"held-out episode-weighted mean (112/90/60/20, NOT AgentBoard's): "
            f"success {_pct(w['success_rate'])} progress {_pct(w['progress_rate'])}"
        )
    for name, p in doc.get("perturbation", {}).items():
        for m in ("success_rate", "progress_rate"):
            r = p[m]
            lines.append(
                f"{name} {m} under reworded actions: original {_pct(r['original'])}, "
                f"{len(r['perturbations'])} variants mean {_pct(r['mean'])} ± {100 * r['std']:.1f}"
            )
    for note in doc.get("checkout_notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- run directories


def kept_checkpoints(path: str) -> list[tuple[int, str]]:
    """(step, step dir) of every finished checkpoint of a training run dir or checkpoint root, ascending."""
    from agentrefine_jax.checkpoint import RUN_CHECKPOINTS_SUBDIR, as_path, checkpoint_steps

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
    config: RunConfig,
    checkpoints: Sequence[tuple[int, str]],
    make_model: Callable[[str], ModelBackend],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate each kept checkpoint (the paper reports the epoch with the best average) and pick the best."""
    results = []
    for step, path in checkpoints:
        log(f"[agentboard] checkpoint step {step}: {path}")
        model = make_model(path)
        try:
            step_cfg = dataclasses.replace(
                config, log_dir=os.path.join(config.log_dir, f"step_{step}") if config.log_dir else None
            )
            doc = run(checkout, step_cfg, model=model, log=log)
        finally:
            model.close()
        results.append({"step": step, "checkpoint": path, "score": list(selection_score(doc)), "result": doc})
    best = max(results, key=lambda r: (tuple(r["score"]), -r["step"]))  # ties: the earlier checkpoint
    return {
        "protocol": "agentboard",
        "selection": "held-out unweighted mean success, then progress (mean of the tasks run if not all 4)",
        "best_step": best["step"],
        "best_checkpoint": best["checkpoint"],
        "checkpoints": results,
    }


def format_run_table(doc: dict[str, Any]) -> str:
    parts = []
    for r in doc["checkpoints"]:
        mark = "  <- best" if r["step"] == doc["best_step"] else ""
        parts.append(f"== step {r['step']}: score {r['score'][0]:.3f}/{r['score'][1]:.3f}{mark}")
        parts.append(format_table(r["result"]))
    parts.append(
        f"best checkpoint: step {doc['best_step']} ({doc['best_checkpoint']}); by {doc['selection']}"
    )
    return "\n".join(parts)
