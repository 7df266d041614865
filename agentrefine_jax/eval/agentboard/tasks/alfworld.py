"""AgentBoard's ALFWorld task through the real `alfworld` package (TextWorld engine, no THOR).

Our own implementation of ../shared/AGENTBOARD.md section 2 (AgentBoard's agentboard/tasks/alfworld.py and
agentboard/environment/alfworld/):

- Games: the user's checkout provides data/alfworld/json_2.1.1/valid_unseen/ (game files) and
  agentboard/environment/alfworld/base_config.yaml, whose `./data/...` paths are resolved against the
  checkout root (AgentBoard runs from there). `alfworld`'s own AlfredTWEnv collects the solvable games of the
  split (task types 1-6; `movable`/`Sliced` skipped); AgentBoard sorts them and TextWorld's batch env shuffles
  them once with numpy's RandomState(1234): that permutation is the episode order (134 games).
- test.jsonl rows are joined on `additional_info.description` = `<task dir>/<trial dir>` of the game file.
- Reset: the text after the first blank line; its first line is the initial observation, the second holds
  `Your task is to: <goal>`. The in-context example set is chosen by the task dir's prefix.
- Actions: stripped; `put X in Y` / `put X on Y` become `put X in/on Y`; one trailing `.` dropped. `look`
  steps the game but answers the remembered location text (the last feedback of a `go to`/`open` action
  that did not say `Nothing happens`); exactly `check valid actions` lists the valid actions without a
  game step; feedback starting `You arrive at loc ` loses its first sentence.
- Grounding: the action is in the valid list (admissible commands + `look` + `check valid actions`) before
  the step. Progress: one flag per subgoal regex plus one that never fires, set when `re.search` finds the
  regex in any observation (help listings included); 1.0 once TextWorld reports done (won).
- Oracle: alfworld's handcoded expert (`AlfredExpert`, offline), which AgentBoard never loads in eval.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import random
import re
import sys
from collections.abc import Iterator
from typing import Any

from agentrefine_jax.eval.agentboard.checkout import CLONE, DATA, CheckoutError
from agentrefine_jax.eval.agentboard.tasks.base import HELP, AgentBoardTask, EpisodeSpec
from agentrefine_jax.eval.core import StepResult

BASE_CONFIG = "agentboard/environment/alfworld/base_config.yaml"
LABELS_FILE = "data/alfworld/test.jsonl"
PROMPT_FILE = "agentboard/prompts/VanillaAgent/alfworld_base.json"
SPLIT = "eval_out_of_distribution"  # CFG env.alfworld.split: valid_unseen
NUM_EXAMS = 134  # AgentBoard's run.num_exam default
ORDER_SEED = 1234  # TextworldBatchGymEnv.__init__ seeds its game shuffle with 1234
MAX_EPISODE_STEPS = 50  # base_config dagger.training.max_nb_steps_per_episode
# Task dir prefix -> example set in alfworld_base.json (AgentBoard's table, in its order).
EXAMPLE_SETS = (
    ("pick_and_place", "put"),
    ("pick_clean_then_place", "clean"),
    ("pick_heat_then_place", "heat"),
    ("pick_cool_then_place", "cool"),
    ("look_at_obj", "examine"),
    ("pick_two_obj", "puttwo"),
)


def post_process(action: str) -> str:
    """AgentBoard's ALFWorld action rewrite (put ... in/on ..., no trailing period)."""
    action = action.strip()
    if "put" in action:
        if " in " in action:
            action = action.replace(" in ", " in/on ")
        elif " on " in action:
            action = action.replace(" on ", " in/on ")
    if action.endswith("."):
        action = action[:-1].strip()
    return action


def _resolve_config(checkout: Any) -> dict[str, Any]:
    import yaml

    path = checkout.path(BASE_CONFIG, CLONE)
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for section, keys in (
        ("dataset", ("data_path", "eval_id_data_path", "eval_ood_data_path")),
        ("logic", ("domain", "grammar")),
    ):
        for key in keys:
            value = config.get(section, {}).get(key)
            if isinstance(value, str) and not os.path.isabs(os.path.expandvars(value)):
                config[section][key] = str(checkout.root / value)
    return config


def game_files(checkout: Any, split: str = SPLIT) -> list[str]:
    """The split's solvable games in AgentBoard's episode order (sorted, then RandomState(1234)-shuffled)."""
    import numpy as np
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = _resolve_config(checkout)
    key = {"eval_out_of_distribution": "eval_ood_data_path", "eval_in_distribution": "eval_id_data_path"}
    data_dir = config["dataset"][key.get(split, "data_path")]
    if not os.path.isdir(data_dir):
        raise CheckoutError(f"missing {data_dir}: provided by {DATA}")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        files = sorted(AlfredTWEnv(config, train_eval=split).game_files)
    np.random.RandomState(ORDER_SEED).shuffle(files)
    return files


def episode_name(game_file: str) -> str:
    return "/".join(game_file.split("/")[-3:-1])


def example_set(name: str) -> str | None:
    return next((key for prefix, key in EXAMPLE_SETS if name.startswith(prefix)), None)


_PUT = re.compile(r"put (.+) in/on (.+)")


def _expert_wrapper(base: Any, kind: str) -> Any:
    """alfworld's expert wrapper, speaking the game's own command grammar.

    alfworld >= 0.4 renamed `put X in/on Y` to `move X to Y` in its grammar, and its handcoded TextWorld
    expert tests admissibility in the new wording; the game files of AgentBoard's download carry the older
    grammar (their own copy). So the expert is shown the state in the new wording and its answer is put back
    into the game's. Otherwise as alfworld's wrapper: the expert observes the intro, then acts on every new
    state; a suggestion that is not admissible becomes `look`.
    """

    class Expert(base):
        def _gather_infos(self) -> None:
            self.state["extra.expert_plan"] = ["look"]
            if not self.prev_command:
                self._handcoded_expert.observe(self.state["feedback"])
                return
            admissible = self.state["admissible_commands"]
            old = {_PUT.sub(r"move \1 to \2", c): c for c in admissible if _PUT.fullmatch(c)}
            state = copy.copy(self.state)
            state["admissible_commands"] = [_PUT.sub(r"move \1 to \2", c) for c in admissible]
            last = _PUT.sub(r"move \1 to \2", self.prev_command) if old else self.prev_command
            try:
                action = self._handcoded_expert.act(state, 0, self.state["won"], last)
            except Exception:  # noqa: BLE001 - the expert times out after 200 steps: it just stops helping
                return
            action = old.get(action, action)
            if action in admissible:
                self.state["extra.expert_plan"] = [action]

    return Expert(expert_type=kind)


class ALFWorldEnv:
    """One AgentBoard ALFWorld episode on one game file."""

    # The reply rewrite `step` applies, offered to wrappers that match a reply before stepping
    # (`perturb.RewordedEnv`).
    parse_action = staticmethod(post_process)

    def __init__(self, game_file: str, subgoals: list[str], expert: bool = False):
        self.game_file, self.subgoals, self.expert = game_file, list(subgoals), expert
        self.goal = ""
        self.env: Any = None
        self.admissible: list[str] = []
        self.location = ""
        self.won = False
        self.flags = [0] * (len(self.subgoals) + 1)
        self.expert_plan: list[str] = []
        self.steps = 0

    @property
    def success(self) -> bool:
        return self.won

    @property
    def progress(self) -> float:
        return 1.0 if self.won else sum(self.flags) / len(self.flags)

    def _start(self) -> Any:
        import textworld
        import textworld.gym
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredExpert,
            AlfredExpertType,
            AlfredInfos,
        )

        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        wrappers: list[Any] = [AlfredDemangler(shuffle=False), AlfredInfos]
        if self.expert:
            wrappers.append(_expert_wrapper(AlfredExpert, AlfredExpertType.HANDCODED))
            infos.extras.append("expert_plan")
        env_id = textworld.gym.register_games(
            [self.game_file],
            infos,
            batch_size=1,
            asynchronous=False,
            max_episode_steps=MAX_EPISODE_STEPS,
            wrappers=wrappers,
        )
        return textworld.gym.make(env_id)

    def reset(self) -> str:
        self.close()
        self.env = self._start()
        # Loading the game runs fast-downward's translator in this process, and it overwrites sys.argv
        # (['translate.py', 'domain', 'task']): the caller's command line is given back.
        argv = sys.argv[:]
        try:
            obs, info = self.env.reset()
        finally:
            sys.argv[:] = argv
        lines = "\n".join(obs[0].split("\n\n")[1:]).split("\n")
        if len(lines) < 2 or "Your task is to:" not in lines[1]:
            raise ValueError(f"{self.game_file}: unexpected ALFWorld intro text {obs[0][:120]!r}")
        self.goal = lines[1].split("Your task is to:")[1].strip()
        self.location = lines[0]
        self.won = False
        self.steps = 0
        self.flags = [0] * (len(self.subgoals) + 1)
        self._infos(info)
        return lines[0]

    def _infos(self, info: dict[str, Any]) -> None:
        self.admissible = list(info["admissible_commands"][0])
        if self.expert:
            self.expert_plan = list(info.get("extra.expert_plan", [[]])[0] or [])

    @contextlib.contextmanager
    def _seeded(self) -> Iterator[None]:
        """alfworld's expert breaks ties and loops with the global `random`: seed it per game and step so
        oracle runs repeat, and give the caller's random state back afterwards."""
        if not self.expert:
            yield
            return
        saved = random.getstate()
        self.steps += 1
        random.seed(f"{episode_name(self.game_file)}:{self.steps}")
        try:
            yield
        finally:
            random.setstate(saved)

    def valid_actions(self) -> list[str]:
        return self.admissible + [a for a in ("look", HELP) if a not in self.admissible]

    def step(self, action: str) -> StepResult:
        action = post_process(action)
        valid = action in self.valid_actions()
        if action == HELP:
            text = "Choose an action from these valid actions: " + ", ".join(self.valid_actions())
        else:
            with self._seeded():
                obs, _, dones, info = self.env.step([action])
            text = self.location if action == "look" else obs[0]
            self.won = bool(dones[0])
            self._infos(info)
            if ("go to" in action or "open" in action) and "Nothing happens" not in text:
                self.location = text
        if text.startswith("You arrive at loc "):
            text = text[text.find(". ") + 2 :]
        for i, pattern in enumerate(self.subgoals):
            if re.search(pattern, text):
                self.flags[i] = 1
        return StepResult(text, self.won, self.progress, valid, action=action)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


class ExpertOracle:
    """alfworld's handcoded expert: the next command of its plan for the current state."""

    def next_action(self, env: ALFWorldEnv, history: list[tuple[str, str]]) -> str:
        if not env.expert_plan:
            return HELP
        rewording = getattr(env, "rw", None)  # a perturbed episode (perturb.RewordedEnv) shows other wording
        return rewording.to_surface(env.expert_plan[0]) if rewording else env.expert_plan[0]


class ALFWorldTask(AgentBoardTask):
    name = "alfworld"
    prompt_file = PROMPT_FILE

    def __init__(self, expert: bool = False):
        super().__init__()
        self.expert = expert  # load the handcoded expert with each game (the oracle policy needs it)

    def episodes(self, checkout: Any) -> list[EpisodeSpec]:
        split = checkout.env_config("alfworld").get("split", SPLIT)
        files = game_files(checkout, split)
        rows = checkout.read_jsonl(LABELS_FILE, DATA)
        labels = {}
        for n, row in enumerate(rows, 1):
            try:
                labels[row["additional_info"]["description"]] = row
            except (KeyError, TypeError):
                raise CheckoutError(
                    f"{checkout.root / LABELS_FILE}:{n}: no additional_info.description"
                ) from None
        specs = []
        for game_file in files[:NUM_EXAMS]:
            name = episode_name(game_file)
            row = labels.get(name)
            if row is None:
                raise CheckoutError(f"{checkout.root / LABELS_FILE}: no line for game {name}")
            if example_set(name) is None:
                raise CheckoutError(f"{game_file}: task type of {name} has no AgentBoard example set")
            specs.append(
                EpisodeSpec(
                    "alfworld",
                    len(specs),
                    name,
                    row.get("difficulty", ""),
                    {"game_file": game_file, "subgoals": list(row.get("subgoals", []))},
                )
            )
        return specs

    def make_env(self, checkout: Any, episode: EpisodeSpec) -> ALFWorldEnv:
        return ALFWorldEnv(episode.info["game_file"], episode.info["subgoals"], expert=self.expert)

    def examples_key(self, episode: EpisodeSpec) -> str | None:
        return example_set(episode.id)

    def oracle(self, env: Any) -> ExpertOracle | None:
        """The expert rides along with the game: asked before `reset` it is loaded then; an env already
        started without it is restarted with it (the runner asks before its first step)."""
        if not isinstance(env, ALFWorldEnv):
            return None
        if not env.expert:
            env.expert = True
            if env.env is not None:
                env.reset()
        return ExpertOracle()
