"""The chat protocol (our ReAct layout, for built-in episode sources) on the one engine (`core.run_episodes`).

Up to `batch_size` episodes are in flight; every round each active episode contributes its
conversation, the policy answers all of them at once (one batched generate call, or concurrent HTTP
requests), and each reply's `Action:` is parsed (`react.parse_action`) and executed. Every assistant
turn is a step, as in AgentBoard: malformed replies and "check valid actions" count toward `max_steps`.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from agentrefine_jax.eval.core import Episode, EpisodeJob, EpisodeResult, job_key
from agentrefine_jax.eval.policies import (
    ActRequest,
    ContextOverflow,
    Policy,
    Reply,
    ask,
    is_privileged,
)
from agentrefine_jax.eval.react import FORMAT_ERROR, parse_action
from agentrefine_jax.layout import (
    SYSTEM_PROMPT,
    agentboard_messages,
    check_style,
    first_user_turn,
    observation_turn,
)

log = logging.getLogger(__name__)


def _prompt(run: Episode) -> list[dict[str, str]]:
    """What the policy sees: the transcript (chat style) or AgentBoard's single-message prompt."""
    assert run.env is not None
    if run.job.prompt_style == "agentboard":
        return agentboard_messages(SYSTEM_PROMPT, run.env.instruction, run.record.goal, run.history)
    return run.record.messages


def end(run: Episode, termination: str, error: str | None = None) -> None:
    """End a chat-protocol episode: success and best-so-far progress are the env's at its end."""
    env = run.env
    run.record.success = bool(env is not None and env.success)
    run.record.progress = float(env.best_progress) if env is not None else 0.0
    run.finish(termination, error)


def start(job: EpisodeJob, policy: Policy) -> Episode:
    """A chat-protocol episode of `job`, its env reset (one that failed to start comes back finished);
    a privileged `policy` gets its solver for the episode."""
    try:
        env = job.task.make_env(job.spec, job.perturbation, oracle=policy.needs_oracle)
        try:
            obs = env.reset()
            goal = env.goal
            solver = policy.for_episode(job.task, env, job.spec, job.seed) if is_privileged(policy) else None
        except BaseException:
            env.close()
            raise
    except Exception as e:  # noqa: BLE001 - reported per episode, the run goes on
        failed = Episode(job)
        end(failed, "error", f"environment failed to start: {type(e).__name__}: {e}")
        return failed
    check_style(job.prompt_style)
    run = Episode(job, env)
    run.record.messages += [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": first_user_turn(env.instruction, goal, obs)},
    ]
    run.record.goal, run.record.initial_observation = goal, obs
    run.history, run.solver = [("Observation", obs)], solver
    return run


class ChatProtocol:
    """Our chat protocol for `core.run_episodes`: prompts are the transcript (or AgentBoard's single
    message), replies are parsed by `react.parse_action`, and every end has its `termination`."""

    source = "builtin"

    def __init__(self, policy: Policy, batch_size: int):
        self.actor, self.width = policy, batch_size

    key = staticmethod(job_key)

    def start(self, job: EpisodeJob) -> Episode:
        return start(job, self.actor)

    def answer(self, runs: list[Episode]) -> list[tuple[Episode, Reply | Exception]]:
        requests = [
            ActRequest(
                _prompt(r),
                r.job.seed,
                r.record.steps,
                r.job.sampling,
                r.env,
                r.history,
                r.solver,
                key=job_key(r.job),
            )
            for r in runs
        ]
        return list(zip(runs, ask(self.actor, requests), strict=True))

    def apply(self, run: Episode, reply: Reply) -> None:
        run.replies.append(reply)
        termination = _advance(run, reply.text)
        if termination is not None:
            end(run, termination, run.record.trace[-1].get("error") if termination == "error" else None)

    def failed(self, run: Episode, error: Exception) -> None:
        if isinstance(error, ContextOverflow):
            end(run, "context_overflow", str(error))
        else:
            log.warning(f"{run.job.name} episode {run.job.episode}: policy error: {error}")
            end(run, "error", str(error))

    @staticmethod
    def result(run: Episode) -> EpisodeResult:
        return run.record

    @staticmethod
    def dump(result: EpisodeResult) -> dict[str, Any]:
        return result.to_json()

    @staticmethod
    def load(job: EpisodeJob, record: dict[str, Any]) -> EpisodeResult:
        return EpisodeResult(**record)


def _advance(run: Episode, reply: str) -> str | None:
    """Apply one assistant turn; returns a termination reason or None to continue."""
    env, r = run.env, run.record
    assert env is not None
    r.messages.append({"role": "assistant", "content": reply})
    r.steps += 1
    action = parse_action(reply)
    entry: dict[str, Any] = {"step": r.steps, "action": action}
    if action is None:
        r.format_errors += 1
        observation = FORMAT_ERROR
        entry.update(valid=False, executed=False)
    else:
        try:
            result = env.step(action)
        except Exception as e:  # noqa: BLE001 - a simulator crash ends this episode only
            entry.update(
                valid=False, executed=False, error=f"environment step failed: {type(e).__name__}: {e}"
            )
            log.warning(f"{run.job.name} episode {run.job.episode}: {entry['error']}")
            log.debug(traceback.format_exc(limit=3))
            r.trace.append(entry)
            return "error"
        observation = result.observation
        r.invalid_actions += 0 if result.valid else 1
        entry.update(valid=result.valid, executed=result.executed)
    entry.update(progress=round(env.best_progress, 4), success=env.success)
    r.trace.append(entry)
    r.messages.append({"role": "user", "content": observation_turn(observation)})
    run.history += [("Action", action if action is not None else reply.strip()), ("Observation", observation)]
    if env.success:
        return "success"
    if env.done:
        return "env_done"
    if r.steps >= run.job.max_steps:
        return "max_steps"
    return None
