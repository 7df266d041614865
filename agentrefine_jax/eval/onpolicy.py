"""On-policy refinement data: the model plays training worlds, the expert refines its mistakes.

A model (a `CheckpointPolicy`, or any batched actor) plays episodes of a task's *training* split
(`EvalTask.training_specs`: worlds no eval run plays, `is_eval_spec` refuses them) on the one engine
(`core.run_episodes`) under our chat protocol (`loop.ChatProtocol`). Whenever its action is rejected (the
environment says it is invalid, or the parser cannot read the reply), the next turn is the expert's: the
task's oracle, kept in step with the environment (it is asked after the reset and after every executed
step, so a stateful solver such as BabyAIBot sees every action taken), answers that state, its action is
executed and the model plays on from there. Each episode with at least one refinement becomes one canonical
trajectory row (data/schema.py), cut after its last refinement:

* the model's rejected turns are erroneous (`loss: false`), followed by the environment's answer;
* the expert's turns are the refinements (`loss: true`);
* the model's accepted turns are context only (`train: false`: not trained, not a mistake).

Episodes are journaled like an eval run's (`journal.py`), so a killed collection resumes; the rows are
written in job order, at the end, atomically (`outputs.py`). The CLI is `python -m agentrefine_jax.eval
onpolicy` (docs/data.md, "On-policy refinement data").
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

from agentrefine_jax.eval import core
from agentrefine_jax.eval.core import Episode, EpisodeJob, job_seed
from agentrefine_jax.eval.journal import Journal
from agentrefine_jax.eval.loop import ChatProtocol, end, start
from agentrefine_jax.eval.policies import PolicyError, Reply
from agentrefine_jax.eval.registry import lookup, make_task
from agentrefine_jax.layout import assistant_turn

log = logging.getLogger("agentrefine_jax.eval")

SOURCE = "onpolicy"  # the journal's namespace
BLANK_REPLY = "(no reply)"  # what a blank model reply is written as: the schema needs text
# Environments are made with whatever their oracle needs; no privileged actor is made for the model.
_WITH_ORACLE = types.SimpleNamespace(needs_oracle=True)


def recovery_thought(observation: str, unparseable: bool) -> str:
    """The refinement's first sentence: what went wrong, in the words of the demo's recoveries."""
    from agentrefine_jax.data import demo_world as dw

    if unparseable:
        return "My last reply did not follow the format; I answer with one valid action."
    return dw._recovery_thought(observation)


def expert_thought(run: Episode, observation: str, unparseable: bool) -> str:
    """The expert turn's thought: the recovery sentence, then the step's reason (the demo expert's own
    words in a demo world; a plain one elsewhere)."""
    from agentrefine_jax.data import demo_world as dw
    from agentrefine_jax.eval.envs.demo_world import DemoWorldEnv

    env = run.env
    if isinstance(env, DemoWorldEnv) and env.world is not None:
        step = dw._expert_steps(env.world)[0][0]
    else:
        step = "I take the next step of a plan that reaches the goal."
    return f"{recovery_thought(observation, unparseable)} {step}"


class OnPolicyProtocol(ChatProtocol):
    """The chat protocol with an expert behind the model: after a rejected turn the expert answers."""

    source = SOURCE

    def start(self, job: EpisodeJob) -> Episode:
        run = start(job, _WITH_ORACLE)
        run.expert_steps = []  # the steps (1-based) the expert answered
        run.expert_invalid = 0  # expert actions the environment rejected (never expected)
        run.expert_next = None  # the expert's action for the current state
        run.expert_pending = False
        run.expert_error = None
        if run.finished:
            return run
        try:
            run.expert = job.task.oracle(run.env)
        except Exception as e:  # noqa: BLE001 - reported per episode
            end(run, "error", f"expert failed to start: {type(e).__name__}: {e}")
            return run
        self._ask_expert(run)
        return run

    @staticmethod
    def _ask_expert(run: Episode) -> None:
        try:
            run.expert_next = run.expert.next_action(run.env, run.history)
            run.expert_error = None
        except Exception as e:  # noqa: BLE001 - e.g. BabyAIBot after the model opened a box: no expert now
            run.expert_next, run.expert_error = None, f"{type(e).__name__}: {e}"

    @staticmethod
    def _rejected(run: Episode) -> bool:
        return bool(run.record.trace) and not run.record.trace[-1]["valid"]

    def answer(self, runs: list[Episode]) -> list[tuple[Episode, Reply | Exception]]:
        replies: dict[int, Reply | Exception] = {}
        for run in runs:
            run.expert_pending = self._rejected(run)
            if run.expert_pending:
                replies[id(run)] = self._expert_reply(run)
        model = [r for r in runs if not r.expert_pending]
        for run, reply in super().answer(model) if model else []:
            replies[id(run)] = reply
        return [(r, replies[id(r)]) for r in runs]

    @staticmethod
    def _expert_reply(run: Episode) -> Reply | Exception:
        if run.expert_next is None:
            return PolicyError(f"no expert action for this state ({run.expert_error})")
        observation = run.history[-1][1]
        thought = expert_thought(run, observation, unparseable=run.record.trace[-1]["action"] is None)
        return Reply(assistant_turn(thought, run.expert_next))

    def apply(self, run: Episode, reply: Reply) -> None:
        expert, run.expert_pending = run.expert_pending, False
        trace = run.record.trace
        before = len(trace)
        super().apply(run, reply)
        entry = trace[-1] if len(trace) > before else None
        if expert:
            run.expert_steps.append(run.record.steps)
            if entry is not None and not entry["valid"]:
                run.expert_invalid += 1
                log.warning(f"{run.job.name} episode {run.job.episode}: the expert's action was rejected")
        if not run.finished and entry is not None and entry.get("executed"):
            self._ask_expert(run)  # every executed step: a stateful expert follows the episode

    def result(self, run: Episode) -> dict[str, Any]:  # type: ignore[override]
        r = super().result(run)
        expert = set(getattr(run, "expert_steps", []))
        model_steps = [e for e in r.trace if e["step"] not in expert]
        return {
            "task": r.task,
            "episode": r.episode,
            "spec": r.spec,
            "success": r.success,
            "progress": r.progress,
            "steps": r.steps,
            "termination": r.termination,
            "error": r.error,
            "model_turns": len(model_steps),
            "model_errors": sum(not e["valid"] for e in model_steps),
            "refinements": len(expert),
            "expert_invalid": getattr(run, "expert_invalid", 0),
            "row": refinement_row(row_id(r.task, r.episode, r.spec), r.messages, r.trace, sorted(expert)),
        }

    @staticmethod
    def dump(result: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        return result

    @staticmethod
    def load(job: EpisodeJob, record: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        return record


def row_id(task: str, episode: int, spec: dict[str, Any]) -> str:
    """`onpolicy-TASK-EPISODE-<spec values>`: unique within a collection, naming the world it played."""
    return "-".join(["onpolicy", task, str(episode), *(str(v) for v in spec.values())])


def refinement_row(
    rid: str, messages: Sequence[dict[str, str]], trace: Sequence[dict[str, Any]], expert_steps: Sequence[int]
) -> dict[str, Any] | None:
    """The canonical row of one episode (None without a refinement): system, first observation, then
    every turn up to the last expert turn, flagged as the module docstring says. Assistant turn k (1-based
    step) is `messages[2k]`, its observation `messages[2k + 1]`."""
    if not expert_steps:
        return None
    last = max(expert_steps)
    expert = set(expert_steps)
    out: list[dict[str, Any]] = [dict(m) for m in messages[: 2 * last + 1]]
    for k in range(1, last + 1):
        turn, valid = out[2 * k], bool(trace[k - 1]["valid"])
        if not turn["content"].strip():
            turn["content"] = BLANK_REPLY
        if k in expert:
            turn["loss"] = valid  # the refinement (an expert action the env rejected would not be one)
        elif not valid:
            turn["loss"] = False  # the model's mistake
        else:
            turn["loss"], turn["train"] = True, False  # the model's own accepted turn: context only
    return {"id": rid, "messages": out}


@dataclasses.dataclass
class Collection:
    """What a collection made: the rows (job order) and each episode's record (the row included)."""

    rows: list[dict[str, Any]]
    episodes: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        """Per task: episodes, rows, model turns and errors, refinements, successes, how episodes ended."""
        out: dict[str, Any] = {}
        for e in self.episodes:
            s = out.setdefault(
                e["task"],
                {
                    "episodes": 0,
                    "rows": 0,
                    "model_turns": 0,
                    "model_errors": 0,
                    "refinements": 0,
                    "expert_invalid": 0,
                    "successes": 0,
                    "terminations": collections.Counter(),
                },
            )
            s["episodes"] += 1
            s["rows"] += e["row"] is not None
            for k in ("model_turns", "model_errors", "refinements", "expert_invalid"):
                s[k] += e[k]
            s["successes"] += bool(e["success"])
            s["terminations"][e["termination"]] += 1
        for s in out.values():
            s["terminations"] = dict(sorted(s["terminations"].items()))
        return out


@dataclasses.dataclass
class Plan:
    """A collection's episodes, checked before any model loads: the tasks (closed by `close`) and one job
    per training episode, none of them an eval episode."""

    tasks: dict[str, Any]
    jobs: list[EpisodeJob]

    def close(self) -> None:
        for task in self.tasks.values():
            task.close()


def plan(
    tasks: Sequence[str], episodes: int, *, seed: int = 0, workdir: str, max_steps: int | None = None
) -> Plan:
    """`episodes` training episodes of each task (`EvalTask.training_specs`); every spec is checked against
    the task's eval split (`is_eval_spec`): an eval episode is refused, never played."""
    from agentrefine_jax.eval.config import SEED_LIMIT

    if episodes < 1:
        raise ValueError(f"--episodes must be >= 1, got {episodes}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**31), got {seed}")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {max_steps}")
    out = Plan({}, [])
    try:
        for name in [lookup(t, "builtin").result_name("builtin") for t in tasks]:
            task = out.tasks[name] = make_task(name, workdir)
            if not task.has_training_split:
                raise ValueError(
                    f"task {name!r} has no training split (on-policy data: demo_world, babyai, pddl)"
                )
            specs = task.training_specs(episodes, seed)
            held_out = [s for s in specs if task.is_eval_spec(s)]
            if held_out:
                raise ValueError(f"refusing {name} eval episodes as training data: {held_out[:3]}")
            steps = max_steps or task.default_max_steps
            out.jobs += [
                EpisodeJob(name, task, s, i, 0, 0, steps, job_seed(seed, name, 0, i, 0))
                for i, s in enumerate(specs)
            ]
    except BaseException:
        out.close()
        raise
    return out


def collect(
    policy: Any,
    episodes: Plan,
    *,
    batch_size: int = 8,
    journal: Journal | None = None,
    log_line: Callable[[str], None] = log.info,
) -> Collection:
    """Play the planned episodes with `policy` (`batch_size` in flight), the expert refining every rejected
    turn; with a `journal`, episodes it holds are not played again and every finished one is appended."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")

    def report(e: dict[str, Any]) -> None:
        log_line(
            f"{e['task']} episode {e['episode']}: {e['refinements']} refinement(s) of "
            f"{e['model_errors']} rejected model turn(s) in {e['steps']} steps, end={e['termination']}"
        )

    protocol = OnPolicyProtocol(policy, batch_size)
    records = core.run_episodes(episodes.jobs, protocol, on_done=report, journal=journal, phase=["collect"])
    return Collection([r["row"] for r in records if r["row"] is not None], records)
