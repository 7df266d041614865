"""AgentBoard's Jericho task: interactive-fiction games through the real `jericho` package (FrotzEnv).

Our own implementation of ../shared/AGENTBOARD.md section 6 (AgentBoard's agentboard/tasks/jericho.py and
agentboard/environment/jericho_env.py):

- Games: CFG `env.jericho.game_name` (20), each `<game_dir>/<game>.z5` (`.z8` for afflicted, anchor,
  snacktime, partyfoul), game_dir data/jericho/z-machine-games-master/jericho-game-suite from the checkout.
  Line i of data/jericho/test.jsonl holds game i's `subgoals` (plain strings) and `difficulty`.
- Goal and initial observation: the `game_goals` / `game_init_obs` tables of jericho_env.py (read with `ast`),
  not the game's own text; a game missing from a table gets `Not written yet.` (CFG's `huntdark` is
  `darkhunt` in the tables, so it gets that for both). The game itself is reset all the same.
- Actions: text before the first `,`, then before the first `.`, first 20 space-separated words. An action
  holding both `check` and `action` lists the valid actions (jericho's `get_valid_actions()` + `check valid
  actions`; jericho builds that list from a set, so its order changes with Python's hash seed: we sort it);
  anything else goes to Frotz. Feedback: newlines -> spaces, runs of spaces collapsed, `[Your score ...]`
  removed; the step is invalid iff the feedback contains `[!` (the help listing is valid).
- Progress: subgoals and feedback are stripped of everything but letters, digits and whitespace; the first
  remaining subgoal found (case-sensitive substring) scores and is removed (at most one per step); progress =
  points / N, best so far. Done = progress 1 or the game ended; success = progress 1.
- Oracle: the game's walkthrough (jericho's own for the games it supports; for other story files, such as
  a TextWorld-compiled one, TextWorld's walkthrough from the `.json` beside it), one command per step.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

from agentrefine_jax.eval.agentboard.checkout import CLONE, DATA, CheckoutError
from agentrefine_jax.eval.agentboard.tasks.babyai import SubgoalProgress
from agentrefine_jax.eval.agentboard.tasks.base import HELP, AgentBoardTask, EpisodeSpec
from agentrefine_jax.eval.core import StepResult
from agentrefine_jax.eval.policies import Replay

ENV_FILE = "agentboard/environment/jericho_env.py"
LABELS_FILE = "data/jericho/test.jsonl"
GAME_DIR = "data/jericho/z-machine-games-master/jericho-game-suite"
PROMPT_FILE = "agentboard/prompts/VanillaAgent/jericho_vanilla_prompt.json"
Z8_GAMES = ("afflicted", "anchor", "snacktime", "partyfoul")
NOT_WRITTEN = "Not written yet."


def parse_action(action: str) -> str:
    """AgentBoard's Jericho action cut (guards Frotz's input buffer)."""
    action = action.split(",")[0].split(".")[0]
    return " ".join(action.split(" ")[:20])


def clean_feedback(text: str) -> str:
    text = re.sub(r"\n", " ", text)
    text = re.sub(r" {2,}", " ", text)
    return re.sub(r"\[Your score .*?\]", "", text)


def _contains(text: str, subgoal: str) -> bool:
    return re.sub(r"[^a-zA-Z0-9\s]", "", subgoal) in re.sub(r"[^a-zA-Z0-9\s]", "", text)


class JerichoEnv:
    """One AgentBoard Jericho episode."""

    def __init__(self, game_file: str, goal: str, init_obs: str, subgoals: list[str]):
        self.game_file, self.subgoals = game_file, list(subgoals)
        self.goal, self.init_obs = goal, init_obs
        self.env: Any = None
        self.tracker = SubgoalProgress(self.subgoals, _contains)
        self.done = False

    @property
    def progress(self) -> float:
        return self.tracker.value

    @property
    def success(self) -> bool:
        return self.progress == 1

    def reset(self) -> str:
        from jericho import FrotzEnv

        if self.env is None:
            self.env = FrotzEnv(self.game_file)
        self.env.reset()
        self.tracker, self.done = SubgoalProgress(self.subgoals, _contains), False
        return self.init_obs

    def valid_actions(self) -> list[str]:
        return sorted(self.env.get_valid_actions()) + [HELP]

    def step(self, action: str) -> StepResult:
        action = parse_action(action)
        lowered = action.strip().lower()
        if "check" in lowered and "action" in lowered:
            text = "You can take the following actions: " + ", ".join(self.valid_actions())
            return StepResult(text, self.done, self.progress, True, action=action)
        feedback, _, game_over, _ = self.env.step(action)
        text = clean_feedback(feedback)
        self.tracker.update(text)
        self.done = self.progress == 1 or bool(game_over)
        return StepResult(text, self.done, self.progress, "[!" not in text, action=action)

    def walkthrough(self) -> list[str]:
        steps = self.env.get_walkthrough() if self.env.is_fully_supported else []
        if not steps:  # a story file jericho does not know: TextWorld's metadata beside it, if any
            meta = pathlib.Path(self.game_file).with_suffix(".json")
            if meta.exists():
                import textworld

                game = textworld.Game.load(str(meta))
                steps = list(game.metadata.get("walkthrough") or game.walkthrough or [])
        return steps

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


class JerichoTask(AgentBoardTask):
    name = "jericho"
    prompt_file = PROMPT_FILE  # CFG env.jericho.check_inventory: "inventory" (the default: on)

    def episodes(self, checkout: Any) -> list[EpisodeSpec]:
        cfg = checkout.env_config("jericho")
        games = [str(g) for g in cfg.get("game_name", [])]
        goals = checkout.literal(ENV_FILE, "game_goals")
        init_obs = checkout.literal(ENV_FILE, "game_init_obs")
        rows = checkout.read_jsonl(LABELS_FILE, DATA)
        if len(rows) < len(games):
            raise CheckoutError(
                f"{checkout.root / LABELS_FILE}: {len(rows)} lines for {len(games)} games (eval config "
                f"env.jericho.game_name; provided by {DATA})"
            )
        specs = []
        for i, game in enumerate(games):
            row = rows[i]
            subgoals = row.get("subgoals")
            if "difficulty" not in row or "subgoals_1" in row or not isinstance(subgoals, list):
                raise CheckoutError(
                    f"{checkout.root / LABELS_FILE}:{i + 1}: expected `subgoals` (a list of strings) and "
                    "`difficulty` (AgentBoard's Jericho task reads no alternative sequences)"
                )
            rel = f"{GAME_DIR}/{game}.{'z8' if game in Z8_GAMES else 'z5'}"
            specs.append(
                EpisodeSpec(
                    "jericho",
                    i,
                    game,
                    row["difficulty"],
                    {
                        "game_file": rel,
                        "goal": goals.get(game, NOT_WRITTEN),
                        "init_obs": init_obs.get(game, NOT_WRITTEN),
                        "subgoals": [str(s) for s in subgoals],
                    },
                )
            )
        return specs

    def make_env(self, checkout: Any, episode: EpisodeSpec) -> JerichoEnv:
        info = episode.info
        game_file = checkout.path(info["game_file"], DATA)
        return JerichoEnv(str(game_file), info["goal"], info["init_obs"], info["subgoals"])

    def oracle(self, env: Any) -> Replay:
        return Replay(env.walkthrough)


__all__ = ["CLONE", "JerichoEnv", "JerichoTask", "clean_feedback", "parse_action"]
