"""The contract between the AgentBoard protocol loop and one task's environment."""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrefine_jax.eval.agentboard.checkout import CLONE, DATA
from agentrefine_jax.eval.core import Env, Task
from agentrefine_jax.layout import CHECK_VALID_ACTIONS as HELP  # AgentBoard's help action, all tasks


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One AgentBoard episode: its task, place in AgentBoard's order, and what the task needs to build it."""

    task: str  # "alfworld" | "babyai" | "sciworld" | "pddl" | "jericho"
    index: int  # 0-based position in AgentBoard's episode order (= line of data/<task>/test.jsonl)
    id: str  # human-readable id, e.g. "BabyAI-GoToRedBall-v0/1234", "gripper/prob01.pddl"
    difficulty: str  # "easy" | "hard" (from test.jsonl)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # task-specific (subgoals, paths, seed...)


class AgentBoardTask(Task):
    """An AgentBoard-source task (over `core.Task`); the defaults are what most of AgentBoard's tasks use."""

    name: str  # as in AgentBoard: "alfworld", "babyai", "scienceworld"->"sciworld" here, "pddl", "jericho"
    # path relative to the checkout, e.g. "agentboard/prompts/VanillaAgent/babyai_vanilla_prompt.json"
    prompt_file: str
    check_actions: str | None = HELP  # CFG env.<task>.check_actions
    check_inventory = True

    def __init__(self, strict: bool = True):
        # strict: every protocol file must exist (a model run). Otherwise (oracle/random runs) what a task can
        # do without falls back to AgentBoard's published defaults, each recorded in `notes`.
        self.strict = strict
        self.notes: list[str] = []

    def note_missing(self, checkout: Any, rel: str, fallback: str) -> None:
        """A protocol file is absent: the one-line error for a strict task, else a note of the fallback."""
        if self.strict:
            checkout.path(rel, DATA if rel.startswith("data/") else CLONE)  # raises the one-line error
        self.notes.append(f"{checkout.root / rel} absent: {fallback}")

    def episodes(self, checkout: Any) -> list[EpisodeSpec]:
        raise NotImplementedError

    def make_env(self, checkout: Any, episode: EpisodeSpec) -> Env:
        raise NotImplementedError

    def examples_key(self, episode: EpisodeSpec) -> str | None:
        """Which prompt example set (alfworld/pddl); None for a task with one."""
        return None
