"""The chat protocol (our ReAct layout, for built-in episode sources) on the one engine (`core.run_episodes`).

Up to `batch_size` episodes are in flight; every round each active episode contributes its
conversation, the policy answers all of them at once (one batched generate call, or concurrent HTTP
requests), and each reply's `Action:` is parsed (`react.parse_action`) and executed. Every assistant
turn is a step, as in AgentBoard: malformed replies and "check valid actions" count toward `max_steps`.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from agentrefine_jax.eval.core import EpisodeJob, EpisodeResult, job_key
from agentrefine_jax.eval.envs.base import TextEnv
from agentrefine_jax.eval.perturb import variant_name
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


class _Running:
    """One episode in flight under the chat protocol (`finished` and `result` are set at its end)."""

    def __init__(
        self, job: EpisodeJob, env: TextEnv | None = None, messages: list[dict[str, str]] | None = None
    ):
        self.job = job
        self.env = env
        self.messages = messages or []
        self.solver: Any = None  # a privileged policy's solver for this episode (`for_episode`)
        # Every reply the actor gave, with its token ids and log-probabilities when it has them (kept in
        # memory for callers that learn from them; the results record keeps the text, in `messages`).
        self.replies: list[Reply] = []
        self.steps = 0
        self.invalid = 0
        self.format_errors = 0
        self.trace: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        # agentboard style: the Observation/Action history the single user message is rebuilt from.
        self.goal = ""
        self.history: list[tuple[str, str]] = []
        self.finished = False
        self.result: EpisodeResult | None = None

    def request_messages(self) -> list[dict[str, str]]:
        """What the policy sees: the transcript (chat style) or AgentBoard's single-message prompt."""
        assert self.env is not None
        if self.job.prompt_style == "agentboard":
            return agentboard_messages(SYSTEM_PROMPT, self.env.instruction, self.goal, self.history)
        return self.messages

    def finish(self, termination: str, error: str | None = None) -> None:
        env = self.env
        if env is not None:
            try:
                env.close()
            except Exception as e:  # noqa: BLE001 - a failing close must not lose the episode's result
                log.warning(f"warning: closing {self.job.name} env failed: {e}")
        job = self.job
        self.finished = True
        self.result = EpisodeResult(
            task=job.name,
            variant=variant_name(job.perturbation),
            episode=job.episode,
            sample=job.sample,
            spec=job.spec,
            success=bool(env is not None and env.success),
            progress=float(env.best_progress) if env is not None else 0.0,
            steps=self.steps,
            termination=termination,
            error=error,
            invalid_actions=self.invalid,
            format_errors=self.format_errors,
            seconds=round(time.perf_counter() - self.t0, 3) if env is not None else 0.0,
            messages=self.messages,
            trace=self.trace,
        )


def _start(job: EpisodeJob, policy: Policy) -> _Running:
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
        failed = _Running(job)
        failed.finish("error", f"environment failed to start: {type(e).__name__}: {e}")
        return failed
    check_style(job.prompt_style)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": first_user_turn(env.instruction, goal, obs)},
    ]
    run = _Running(job, env, messages)
    run.goal, run.history, run.solver = goal, [("Observation", obs)], solver
    return run


class ChatProtocol:
    """Our chat protocol for `core.run_episodes`: prompts are the transcript (or AgentBoard's single
    message), replies are parsed by `react.parse_action`, and every end has its `termination`."""

    source = "builtin"

    def __init__(self, policy: Policy, batch_size: int):
        self.actor, self.width = policy, batch_size

    key = staticmethod(job_key)

    def start(self, job: EpisodeJob) -> _Running:
        return _start(job, self.actor)

    def answer(self, runs: list[_Running]) -> list[tuple[_Running, Reply | Exception]]:
        requests = [
            ActRequest(
                r.request_messages(),
                r.job.seed,
                r.steps,
                r.job.sampling,
                r.env,
                r.history,
                r.solver,
                key=job_key(r.job),
            )
            for r in runs
        ]
        return list(zip(runs, ask(self.actor, requests), strict=True))

    def apply(self, run: _Running, reply: Reply) -> None:
        run.replies.append(reply)
        termination = _advance(run, reply.text)
        if termination is not None:
            run.finish(termination, run.trace[-1].get("error") if termination == "error" else None)

    def failed(self, run: _Running, error: Exception) -> None:
        if isinstance(error, ContextOverflow):
            run.finish("context_overflow", str(error))
        else:
            log.warning(f"{run.job.name} episode {run.job.episode}: policy error: {error}")
            run.finish("error", str(error))

    @staticmethod
    def result(run: _Running) -> EpisodeResult:
        assert run.result is not None
        return run.result

    @staticmethod
    def dump(result: EpisodeResult) -> dict[str, Any]:
        return result.to_json()

    @staticmethod
    def load(job: EpisodeJob, record: dict[str, Any]) -> EpisodeResult:
        return EpisodeResult(**record)


def _advance(run: _Running, reply: str) -> str | None:
    """Apply one assistant turn; returns a termination reason or None to continue."""
    assert run.env is not None
    run.messages.append({"role": "assistant", "content": reply})
    run.steps += 1
    action = parse_action(reply)
    entry: dict[str, Any] = {"step": run.steps, "action": action}
    if action is None:
        run.format_errors += 1
        observation = FORMAT_ERROR
        entry.update(valid=False, executed=False)
    else:
        try:
            result = run.env.step(action)
        except Exception as e:  # noqa: BLE001 - a simulator crash ends this episode only
            entry.update(
                valid=False, executed=False, error=f"environment step failed: {type(e).__name__}: {e}"
            )
            log.warning(f"{run.job.name} episode {run.job.episode}: {entry['error']}")
            log.debug(traceback.format_exc(limit=3))
            run.trace.append(entry)
            return "error"
        observation = result.observation
        run.invalid += 0 if result.valid else 1
        entry.update(valid=result.valid, executed=result.executed)
    entry.update(progress=round(run.env.best_progress, 4), success=run.env.success)
    run.trace.append(entry)
    run.messages.append({"role": "user", "content": observation_turn(observation)})
    run.history += [("Action", action if action is not None else reply.strip()), ("Observation", observation)]
    if run.env.success:
        return "success"
    if run.env.done:
        return "env_done"
    if run.steps >= run.job.max_steps:
        return "max_steps"
    return None
