"""AgentBoard's VanillaAgent protocol: prompt assembly, history truncation, action parsing, the episode loop.

Written from the fact sheet (docs/eval.md, "AgentBoard protocol"), not from AgentBoard's code:
- One user message: instruction; `\\nHere are examples:\\n` + each example + `\\n`; the goal line; the "check
  valid actions" help line (and the inventory one); the `Observation: ...` / `Action: ...` history joined by
  newlines; then `\\nAction: `. The system message is the prompt file's `system_msg` (plus, for open models,
  the sentence AgentBoard's vLLM wrapper appends).
- Memory keeps the last `memory_size` (100) history items; while the templated prompt exceeds
  `context_length - max_tokens`, the oldest history item is dropped. Instruction, examples and goal are never
  cut.
- Greedy decoding, 100 new tokens. The action parser runs on every reply (AgentBoard's `use_parser` default).
- A step is one model call whatever the action; the loop ends at `max_steps`, when the task reports done, or
  when the model fails. Progress is best-so-far.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from agentrefine_jax.eval import perturb
from agentrefine_jax.eval.agentboard.checkout import CLONE, Checkout, CheckoutError
from agentrefine_jax.eval.agentboard.tasks.base import EpisodeSpec
from agentrefine_jax.eval.config import AGENTBOARD_MAX_STEPS as DEFAULT_MAX_STEPS  # CFG run.max_num_steps
from agentrefine_jax.eval.core import Episode, EpisodeJob, EpisodeResult, job_key
from agentrefine_jax.eval.policies import (
    RandomPolicy,  # noqa: F401 - the one random policy, re-exported
    Reply,
    as_reply,
)
from agentrefine_jax.layout import agentboard_head, history_lines
from agentrefine_jax.layout import agentboard_user as user_prompt

MEMORY_SIZE = 100  # CFG agent.memory_size
MAX_NEW_TOKENS = 100  # CFG llm.<open model>.max_tokens
VLLM_FILE = "agentboard/llm/vllm.py"


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """What one episode's prompt is built from (AgentBoard's prompt JSON, resolved for that episode)."""

    instruction: str
    examples: tuple[str, ...]
    system_msg: str


def load_prompt_set(checkout: Checkout, prompt_file: str, examples_key: str | None) -> PromptSet:
    """Resolve a VanillaAgent prompt JSON for one episode.

    PDDL's file holds one {instruction, examples, system_msg} per game (keyed by `examples_key`); ALFWorld's
    holds one `examples` dict keyed by task type whose lists are joined with "" into a single example.
    """
    doc = checkout.read_json(prompt_file, CLONE)
    where = checkout.root / prompt_file
    if not isinstance(doc, dict):
        raise CheckoutError(f"{where}: expected a JSON object")
    if (
        examples_key is not None
        and isinstance(doc.get(examples_key), dict)
        and "instruction" in doc[examples_key]
    ):
        doc = doc[examples_key]
    for key in ("instruction", "examples", "system_msg"):
        if key not in doc:
            raise CheckoutError(f"{where}: no `{key}` (for {examples_key or 'this task'})")
    examples: Any = doc["examples"]
    if isinstance(examples, dict):
        if examples_key not in examples:
            raise CheckoutError(f"{where}: no example set `{examples_key}` in `examples`")
        chosen = examples[examples_key]
        examples = ["".join(chosen) if isinstance(chosen, list) else chosen]
    elif isinstance(examples, str):
        examples = [examples]
    if not all(isinstance(e, str) for e in examples) or not isinstance(doc["instruction"], str):
        raise CheckoutError(f"{where}: `instruction`/`examples` must be strings")
    return PromptSet(doc["instruction"], tuple(examples), str(doc["system_msg"]))


def vllm_system_suffix(checkout: Checkout) -> str:
    """The sentence AgentBoard's vLLM wrapper appends to the system message of every open model.

    It lives inside a method (`system_message += "..."`), so it is read from the checkout with `ast`.
    """
    import ast

    path = checkout.path(VLLM_FILE, CLONE)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise CheckoutError(f"cannot parse {path}: {e}") from None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.AugAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "system_message"
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise CheckoutError(f'{path}: no `system_message += "..."` sentence found')


def prompt_head(
    prompt: PromptSet, goal: str, check_actions: str | None, check_inventory: bool, need_goal: bool = True
) -> str:
    """Everything before the history: instruction, examples, goal and help lines (never truncated)."""
    p = prompt
    return agentboard_head(p.instruction, p.examples, goal, check_actions, check_inventory, need_goal)


class PromptTooLong(ValueError):
    """Even with no history the prompt does not fit (AgentBoard would loop forever here)."""


def fit_history(
    head: str, memory: Sequence[tuple[str, str]], fits: Callable[[str], bool], memory_size: int = MEMORY_SIZE
) -> tuple[str, int]:
    """The user prompt with the oldest history items dropped until `fits(prompt)`; returns (prompt, dropped).

    Dropping is monotone (fewer items never make the prompt longer), so the least number of dropped items is
    found by bisection instead of AgentBoard's one-at-a-time loop; the result is the same.
    """
    lines = history_lines(memory[-memory_size:] if memory_size > 0 else [])
    clipped = len(memory) - len(lines)
    full = user_prompt(head, lines)
    if fits(full):
        return full, clipped
    if not fits(user_prompt(head, [])):
        raise PromptTooLong("the prompt does not fit the context even with the whole history dropped")
    lo, hi = 0, len(lines)  # fits with hi dropped, not with lo dropped
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(user_prompt(head, lines[mid:])):
            hi = mid
        else:
            lo = mid
    return user_prompt(head, lines[hi:]), clipped + hi


def parse_action(reply: str) -> str:
    """AgentBoard's action parser for open models (fact sheet section 1), reimplemented.

    If "action" occurs (any case), lines are scanned: a line with "next action" and ":" selects the next
    non-empty line (after the first line equal to it) and scanning goes on; a line whose text before the first
    ":" ends with "with action input" is taken whole; a line with "action" and ":" yields its text after the
    first ":" when non-empty; a line with "action" and "is to" yields its text after "is to" when non-empty.
    A blank result falls back to the first raw line. Then spaces and the characters ' and / are stripped from
    the ends and only the first line is kept.
    """
    action = reply
    if "action" in reply.lower():
        lines = reply.split("\n")
        for line in lines:
            if "next action" in line and ":" in line:
                for nxt in lines[lines.index(line) + 1 :]:
                    if nxt:
                        action = nxt
                        break
            if line.split(":")[0].lower().endswith("with action input"):
                action = line
                break
            if "action" in line.lower() and ":" in line:
                after = ":".join(line.split(":")[1:])
                if after:
                    action = after
                    break
            if "action" in line.lower() and "is to" in line:
                after = line.split("is to")[1]
                if after:
                    action = after
                    break
    if action.strip() == "":
        action = reply.split("\n")[0]
    action = action.strip().strip("'/")
    return action.split("\n")[0]


# ----------------------------------------------------------------------------------------- agents


class ModelBackend(Protocol):
    """A language model answering AgentBoard prompts: (system, user) in, raw reply text out."""

    name: str
    context_length: int
    max_tokens: int

    def num_tokens(self, system: str, user: str) -> int: ...

    def generate(
        self, prompts: Sequence[tuple[str, str]], keys: Sequence[Hashable] | None = None
    ) -> list[str | Exception]:
        """Reply texts; `keys` name the episodes asking, so a backend may keep state per episode (its KV
        cache)."""
        ...

    def forget(self, key: Hashable) -> None:
        """The episode `key` ended."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------- episodes


def _begin(ep: Episode) -> None:
    """Reset the env: its goal and first observation start the record and the history."""
    obs = ep.env.reset()
    ep.record.goal, ep.record.initial_observation = ep.env.goal, obs
    ep.history = [("Observation", obs)]
    if ep.job.max_steps <= 0:
        ep.finish("max_steps")


def _head(ep: Episode, prompt: PromptSet) -> str:
    task = ep.job.task  # its prompt-side settings: the help and inventory lines
    return prompt_head(prompt, ep.record.goal, task.check_actions, bool(task.check_inventory))


def _take(ep: Episode, action: str) -> None:
    """Take one (parsed) action; update the history and the record."""
    result = ep.env.step(action)
    # AgentBoard's tasks that parse the reply (ALFWorld's parseAction, Jericho's cut) log and remember the
    # parsed action: the history the model reads next shows what was executed.
    action = result.action if result.action is not None else action
    r = ep.record
    r.steps += 1
    r.invalid_actions += not result.valid
    r.progress = max(r.progress, result.progress)
    step = {"action": action, "observation": result.observation, "progress": result.progress}
    r.trace.append(step | {"valid": result.valid})
    ep.history += [("Action", action), ("Observation", result.observation)]
    if result.done:
        # A task may define success apart from done (BabyAI: done with progress <= 0.5 is cleared by the env).
        success = getattr(ep.env, "success", None)
        r.success = r.success or (bool(success) if success is not None else True)
        ep.finish("success" if r.success else "env_done")
    elif r.steps >= ep.job.max_steps:
        ep.finish("max_steps")


# ----------------------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class Agent:
    """Who answers: a model backend (`model`), or a privileged policy (`policy`: `policies.OraclePolicy`,
    `RandomPolicy`, anything with `for_episode(task, env, spec, seed) -> Solver`), each episode's solver
    made from the job's seed."""

    model: ModelBackend | None = None
    system_suffix: str = ""  # appended to every system message (AgentBoard's vLLM sentence for open models)
    policy: Any = None

    def __post_init__(self) -> None:
        if (self.model is None) == (self.policy is None):
            raise ValueError("an Agent needs exactly one of a model backend or a policy")


def budget_fits(model: ModelBackend, system: str) -> Callable[[str], bool]:
    """AgentBoard's truncation test: the prompt fits while its tokens are <= context_length - max_tokens."""
    budget = model.context_length - model.max_tokens
    return lambda user: model.num_tokens(system, user) <= budget


def episode_jobs(
    task: Any,
    specs: Sequence[EpisodeSpec],
    max_steps: int = DEFAULT_MAX_STEPS,
    *,
    perturbation: int = 0,
    sample: int = 0,
    seed: int = 0,
) -> list[EpisodeJob]:
    """The jobs of AgentBoard's episodes `specs` of `task`, in order, under reworded-action variant
    `perturbation` (0: the original) as Best-of-N sample `sample`. A job's seed (from the run's `seed`)
    is a privileged policy's (`Agent.policy`); a model backend draws its own."""
    return [
        EpisodeJob(
            task.name,
            task,
            s,
            s.index,
            perturbation,
            sample,
            max_steps,
            seed * 100003 + s.index + sample * 7_000_003,
        )
        for s in specs
    ]


def reworded(prompt: PromptSet, perturbation: int) -> PromptSet:
    """The prompt set of reworded-action variant `perturbation` (Table 3): instruction and examples speak
    the variant's action words."""
    rw = perturb.rewording(perturbation)
    instruction, examples = perturb.reword_prompt(rw, prompt.instruction, prompt.examples)
    return PromptSet(instruction, examples, prompt.system_msg)


class AgentBoardProtocol:
    """AgentBoard's loop for `core.run_episodes`: its prompt (fitted to the budget), its parser on
    every reply, its end reasons. A privileged policy answers one episode at a time from the env. A job's
    perturbation k > 0 runs the episode under reworded-action variant k: the env reads the variant's
    actions and the prompt speaks them."""

    source = "agentboard"

    def __init__(self, task: Any, checkout: Checkout, agent: Agent, batch_size: int = 1):
        self.task, self.checkout, self.agent = task, checkout, agent
        self.actor = agent.model
        width = max(1, batch_size if agent.model is not None else 1)
        self.width = min(width, getattr(task, "max_in_flight", width))  # e.g. one JVM per SciWorld episode

    key = staticmethod(job_key)

    def start(self, job: EpisodeJob) -> Episode:
        task, agent, spec = self.task, self.agent, job.spec
        env = task.make_env(self.checkout, spec)
        if job.perturbation:
            env = perturb.RewordedEnv(env, perturb.rewording(job.perturbation))
        ep = Episode(job, env)
        try:
            if agent.model is not None:
                prompt = load_prompt_set(self.checkout, task.prompt_file, task.examples_key(spec))
                ep.prompt = reworded(prompt, job.perturbation) if job.perturbation else prompt
            _begin(ep)
        except CheckoutError:
            env.close()
            raise
        if agent.model is None and not ep.finished:
            try:
                ep.solver = agent.policy.for_episode(task, env, spec, job.seed)
            except (RuntimeError, OSError, ValueError) as e:  # e.g. the planner found no plan: reported
                ep.finish("error", f"policy_error: {e}")
        return ep

    def answer(self, active: list[Episode]) -> list[tuple[Episode, Reply | Exception]]:
        model = self.agent.model
        if model is None:
            return [(ep, _act(ep)) for ep in active]
        batch: list[tuple[str, str]] = []
        for ep in active:
            system = ep.prompt.system_msg + self.agent.system_suffix
            try:
                user, dropped = fit_history(_head(ep, ep.prompt), ep.history, budget_fits(model, system))
            except PromptTooLong as e:
                ep.finish("context_overflow", f"prompt_too_long: {e}")
                user, dropped = "", 0
            ep.record.dropped_history = max(ep.record.dropped_history, dropped)
            ep.record.last_prompt = user
            batch.append((system, user))
        live = [k for k, ep in enumerate(active) if not ep.finished]
        keys = [self.key(active[k].job) for k in live]
        replies = model.generate([batch[k] for k in live], keys) if live else []
        return [
            (active[k], reply if isinstance(reply, Exception) else as_reply(reply))
            for k, reply in zip(live, replies, strict=True)
        ]

    @staticmethod
    def apply(ep: Episode, reply: Reply) -> None:
        _step(ep, parse_action(reply.text), reply.text)

    def failed(self, ep: Episode, error: Exception) -> None:
        who = "policy" if self.agent.model is None else "model"
        ep.finish("error", f"{who}_error: {type(error).__name__}: {error}")

    @staticmethod
    def result(ep: Episode) -> EpisodeResult:
        return ep.record

    @staticmethod
    def dump(log: EpisodeResult) -> dict[str, Any]:
        return dataclasses.asdict(log) | {"spec": None}

    @staticmethod
    def load(job: EpisodeJob, record: dict[str, Any]) -> EpisodeResult:
        return EpisodeResult(**(record | {"spec": job.spec}))


def _act(ep: Episode) -> Reply | Exception:
    """A privileged policy's reply (its solver's action, as AgentBoard's parser reads it: no ReAct turn
    around it); its failure ends this episode only, reported."""
    assert ep.solver is not None
    try:
        return Reply(ep.solver.next_action(ep.env, list(ep.history)))
    except Exception as e:  # noqa: BLE001
        return e


def _step(ep: Episode, action: str, reply: str) -> None:
    try:
        _take(ep, action)
    except Exception as e:  # noqa: BLE001 - a simulator crash ends this episode, reported with its step
        ep.finish("error", f"env_error: {type(e).__name__}: {e}")
        return
    if reply != ep.record.trace[-1]["action"]:
        ep.record.trace[-1]["reply"] = reply
