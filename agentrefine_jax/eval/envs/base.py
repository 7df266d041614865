"""The text interface every evaluation environment implements.

An environment receives the agent's command exactly as parsed from its `Action:` line (in the
surface wording of the active vocabulary) and answers with text. Success, best-so-far progress and
the step bookkeeping live here so every environment reports them the same way.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

from agentrefine_jax.eval.core import StepResult, Task
from agentrefine_jax.eval.perturb import ActionWord, Vocabulary
from agentrefine_jax.eval.react import CHECK_VALID_ACTIONS

INVALID_ACTION = (
    'The action "{action}" is not valid here. Use "' + CHECK_VALID_ACTIONS + '" to list the valid actions.'
)
RENAMED_ACTION = (
    'The action "{action}" does not exist in this environment. Use the action names listed in the '
    'instructions, or "' + CHECK_VALID_ACTIONS + '".'
)

# ScienceWorld can list hundreds of applicable commands; the listing is capped to keep prompts bounded.
MAX_LISTED = 150


def rejected(observation: str) -> StepResult:
    """A command refused before reaching the simulator."""
    return StepResult(observation, valid=False, executed=False)


class TextEnv(abc.ABC):
    """One episode of one task, seen through text: a built-in source's `core.Env`."""

    task: ClassVar[str]
    # Paragraph describing the world and the rules; the action list is appended from the vocabulary.
    intro: ClassVar[str]

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary):
        self.spec = dict(spec)
        self.vocab = vocab
        self.goal = ""
        self.success = False
        self.done = False
        self.best_progress = 0.0

    # ----------------------------------------------------------------- subclass hooks

    @abc.abstractmethod
    def _reset(self) -> tuple[str, str]:
        """Start the episode; return (goal, first observation)."""

    @abc.abstractmethod
    def _step(self, canonical: str) -> StepResult:
        """Apply a canonical command; `progress` is the new state's (`step` keeps the best so far)."""

    @abc.abstractmethod
    def _valid_canonical(self) -> list[str]:
        """Canonical commands that are applicable now."""

    @abc.abstractmethod
    def _oracle_canonical(self) -> str:
        """The reference solver's next command in canonical wording."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # ----------------------------------------------------------------- public interface

    @property
    def instruction(self) -> str:
        return f"{self.intro.strip()}\n\nAvailable actions:\n{self.vocab.describe()}"

    def reset(self) -> str:
        """Start the episode (`core.Env`): the first observation; `goal` is set."""
        self.success = False
        self.done = False
        self.best_progress = 0.0
        goal, obs = self._reset()
        self.goal = goal
        self.best_progress = max(self.best_progress, self._initial_progress())
        return obs

    def _initial_progress(self) -> float:
        return 0.0

    def valid_actions(self) -> list[str]:
        return [self.vocab.to_surface(a) for a in self._valid_canonical()]

    def _list_valid(self) -> str:
        actions = self.valid_actions()
        shown = "\n".join(f"- {a}" for a in actions[:MAX_LISTED])
        more = f"\n({len(actions) - MAX_LISTED} more not shown)" if len(actions) > MAX_LISTED else ""
        return f"Valid actions now:\n{shown}{more}"

    def oracle_action(self) -> str:
        return self.vocab.to_surface(self._oracle_canonical())

    def step(self, command: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.task}: step() after the episode ended")
        if command.strip().lower() == CHECK_VALID_ACTIONS:
            return StepResult(self._list_valid(), False, self.best_progress, True, executed=False)
        canonical = self.vocab.to_canonical(command)
        if canonical is None:
            return StepResult(
                RENAMED_ACTION.format(action=command), False, self.best_progress, False, executed=False
            )
        out = self._step(canonical)
        self.success = self.success or out.success
        self.done = out.done or out.success
        if out.executed:
            self.best_progress = max(self.best_progress, 1.0 if self.success else out.progress)
        return StepResult(
            out.observation, self.done, self.best_progress, out.valid, self.success, out.executed
        )


class EvalTask(Task, abc.ABC):
    """A built-in family of episodes (e.g. all BabyAI levels) with its paper weight and defaults."""

    name: ClassVar[str]
    display_name: ClassVar[str]
    default_max_steps: ClassVar[int]
    words: ClassVar[Sequence[ActionWord]]

    def __init__(self, workdir: str):
        self.workdir = workdir

    @property
    def num_perturbations(self) -> int:
        return Vocabulary.num_variants(self.words)

    def vocabulary(self, perturbation: int) -> Vocabulary:
        return Vocabulary(self.words, perturbation)

    @abc.abstractmethod
    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        """n deterministic episode descriptions (JSON-serialisable) for a run seed."""

    # Tasks with a training split (the on-policy collector's worlds, `eval/onpolicy.py`) override both:
    # `training_specs` never returns a spec `is_eval_spec` accepts, and every spec `episode_specs` returns
    # for a run seed in [0, config.SEED_LIMIT) is one `is_eval_spec` accepts (tests/test_eval_onpolicy.py).
    has_training_split: ClassVar[bool] = False

    def training_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        """n deterministic training episodes for a collection seed, disjoint from every eval episode."""
        raise ValueError(f"task {self.name!r} defines no training episodes (the on-policy collector's)")

    def is_eval_spec(self, spec: dict[str, Any]) -> bool:
        """Whether an eval run (any run seed in [0, SEED_LIMIT)) can play `spec`: True unless the task
        has a training split that tells them apart."""
        return True

    def prepare(self, specs: Sequence[dict[str, Any]]) -> None:  # noqa: B027 - optional hook
        """Expensive one-off work for a batch of specs (e.g. generating game files)."""

    @abc.abstractmethod
    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> TextEnv:
        """A fresh environment for one episode; the caller resets and closes it.

        `oracle` asks for whatever the reference solver needs (e.g. ScienceWorld's gold path).
        """

    def oracle(self, env: TextEnv) -> EnvOracle:
        return EnvOracle()


class EnvOracle:
    """The built-in environments' reference solver, as a per-episode policy (`OraclePolicy`)."""

    def next_action(self, env: TextEnv, history: list[tuple[str, str]]) -> str:
        return env.oracle_action()
