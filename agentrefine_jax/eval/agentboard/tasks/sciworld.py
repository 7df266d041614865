"""AgentBoard's ScienceWorld task: the task/variation pairs of the checkout's `data/scienceworld/test.jsonl`.

Facts implemented (fact sheet section 4): episodes are test.jsonl's lines keyed `{env_name}_{var}` in file
order (a repeated key keeps its first place and its last line, as a dict does); each runs in
`ScienceWorldEnv(envStepLimit=30)` loaded with the simplifications `selfWateringFlowerPots,openContainers,
openDoors,noElectricalAction`; the goal is the line's `goal`; the first observation is the reset text + `\\n`
+ the inventory. Exactly `check valid actions` lists the action templates (no env step, no scoring); any other
action goes to the simulator, whose own score and done are ignored. Progress = the fraction of the line's
`subgoals` regexes ever found (`re.search`) in an observation; done = all found = success. Grounding = the
action is among the simulator's valid action-object combinations (or the help command) AFTER the step.

Oracle: ScienceWorld's gold action sequence for the variation (it solves the simulator's task; whether it also
hits every annotated subgoal depends on the annotations, so the oracle's success rate is a check of both).
"""

from __future__ import annotations

import re
from typing import Any

from agentrefine_jax.eval.agentboard.checkout import CONFIG_FILE, DATA, Checkout, CheckoutError
from agentrefine_jax.eval.agentboard.tasks.base import HELP, AgentBoardTask, EpisodeSpec
from agentrefine_jax.eval.core import StepResult
from agentrefine_jax.eval.envs.sciworld import JVMPool
from agentrefine_jax.eval.policies import Replay

LABELS = "data/scienceworld/test.jsonl"
PROMPT_FILE = "agentboard/prompts/VanillaAgent/scienceworld_base.json"
SIMPLIFICATION = "selfWateringFlowerPots,openContainers,openDoors,noElectricalAction"
ENV_STEP_LIMIT = 30  # CFG env.scienceworld.envStepLimit


class SciWorldTask(AgentBoardTask):
    name = "sciworld"
    prompt_file = PROMPT_FILE
    max_in_flight = 4  # each episode in flight holds a simulator JVM (~0.5 GB)

    def __init__(self, strict: bool = True):
        super().__init__(strict)  # check_actions, check_inventory: from the config (CFG env.scienceworld)
        self.gold_paths = False  # set by `oracle`: gold paths cost time at load, so only an oracle run asks
        self._pool = JVMPool(ENV_STEP_LIMIT)

    def episodes(self, checkout: Checkout) -> list[EpisodeSpec]:
        if checkout.has_config():
            cfg = checkout.env_config("scienceworld")
            self.check_actions = cfg.get("check_actions")
            # AgentBoard adds the inventory line whenever the key is set (`is not None`), even to False.
            self.check_inventory = cfg.get("check_inventory") is not None
        else:
            self.note_missing(checkout, CONFIG_FILE, "check_actions and check_inventory on")
        rows = checkout.read_jsonl(LABELS, DATA)
        by_key: dict[str, dict[str, Any]] = {}
        for n, row in enumerate(rows, 1):
            info = row.get("additional_info")
            if not isinstance(info, dict) or "env_name" not in info or "var" not in info:
                raise CheckoutError(f"{checkout.root / LABELS}:{n}: no additional_info.env_name/var")
            subgoals = row.get("subgoals")
            if (
                not isinstance(subgoals, list)
                or not subgoals
                or not all(isinstance(s, str) for s in subgoals)
            ):
                raise CheckoutError(
                    f"{checkout.root / LABELS}:{n}: `subgoals` must be a non-empty list of strings"
                )
            for pattern in subgoals:
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise CheckoutError(
                        f"{checkout.root / LABELS}:{n}: bad subgoal regex {pattern!r}: {e}"
                    ) from None
            by_key[f"{info['env_name']}_{info['var']}"] = {
                "task_name": str(info["env_name"]),
                "var": int(info["var"]),
                "goal": str(row.get("goal", "")),
                "subgoals": list(subgoals),
                "difficulty": str(row.get("difficulty", "")),
            }
        return [
            EpisodeSpec("sciworld", i, key, v["difficulty"], v) for i, (key, v) in enumerate(by_key.items())
        ]

    def make_env(self, checkout: Checkout, episode: EpisodeSpec) -> SciWorldEnv:
        return SciWorldEnv(episode, self._pool.acquire(), self._pool.release, self.gold_paths)

    def oracle(self, env: SciWorldEnv) -> Replay | None:
        return Replay(env.gold_path) if env.gold_path else None

    def close(self) -> None:
        self._pool.close()


class SciWorldEnv:
    def __init__(self, episode: EpisodeSpec, sim: Any, release: Any, gold_paths: bool):
        self.episode = episode
        self._sim = sim
        self._release = release
        self._gold = gold_paths
        self.goal = episode.info["goal"]
        self.subgoals: list[str] = episode.info["subgoals"]
        self.found = [False] * len(self.subgoals)
        self.gold_path: list[str] = []
        self.success = False

    @property
    def progress(self) -> float:
        return sum(self.found) / len(self.found)

    def reset(self) -> str:
        info = self.episode.info
        self._sim.load(
            info["task_name"], info["var"], simplificationStr=SIMPLIFICATION, generateGoldPath=self._gold
        )
        obs, _ = self._sim.reset()
        if self._gold:
            self.gold_path = list(self._sim.get_gold_action_sequence())
        self.found = [False] * len(self.subgoals)
        self.success = False
        return obs + "\n" + self._sim.inventory()

    def valid_actions(self) -> list[str]:
        """What `check valid actions` lists: the simulator's action templates (no `reset`), then the help."""
        templates = [a for a in self._sim.get_possible_actions() if "reset" not in a]
        return templates + ([] if HELP in templates else [HELP])

    def candidate_actions(self) -> list[str]:
        """Concrete valid action-object combinations (what the random policy samples from)."""
        return [a["action"] for a in self._sim.get_valid_action_object_combinations_with_templates()]

    def step(self, action: str) -> StepResult:
        action = action.strip()
        if action == HELP:
            listing = "Choose an action from these valid actions: " + ", ".join(self.valid_actions())
            return StepResult(listing, False, self.progress, True)
        obs = self._sim.step(action)[0]
        for i, pattern in enumerate(self.subgoals):
            if not self.found[i] and re.search(pattern, obs):
                self.found[i] = True
        self.success = all(self.found)
        # AgentBoard checks grounding after the step, on the new state's combinations.
        valid = action in self.candidate_actions() or action == HELP
        return StepResult(obs, self.success, self.progress, valid)

    def close(self) -> None:
        if self._sim is not None:
            sim, self._sim = self._sim, None
            self._release(sim)
