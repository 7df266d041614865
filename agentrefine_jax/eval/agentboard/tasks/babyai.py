"""AgentBoard's BabyAI task: minigrid levels behind macro actions and prose observations.

Our own implementation of the protocol in ../shared/AGENTBOARD.md section 3 (AgentBoard's
agentboard/environment/babyai_env.py and agentboard/tasks/babyai.py):

- Episodes: CFG `env.babyai.game_level` mapped to level ids through the `all_levels` table of
  babyai_env.py (read with `ast`, never imported), seeds `seed`..`seed+env_num_per_task-1`, level-major;
  line i of data/babyai/test.jsonl holds episode i's subgoal patterns and difficulty.
- Minigrid version: AgentBoard pins minigrid 2.3.0; we run the installed 3.x. The only one of AgentBoard's
  28 levels whose episodes differ is BabyAI-GoToObjS6-v0: 2.3.0 registered it as GoToObj with
  room_size=4 (a registration slip, fixed in 3.x as GoToObjS6-v1 with room_size=6 while v0 became an
  error). We build that id as 2.3.0 did (= BabyAI-GoToObjS4-v0), so all 112 episodes are 2.3.0's
  (checked by tests/test_agentboard_babyai.py against minigrid 2.3.0 when it is importable).
- The observation text, the macro actions (primitive lists found by a breadth-first search over
  (cell, heading) in the agent's view), their execution, the annotated-subgoal progress and the
  done/success rules follow AgentBoard, quirks included (double spaces between object sentences, an
  empty object list when only walls are in view, a closed door is not an obstacle for the path search,
  `pickup` not `pick up`, a dict's repr inside one error message, done cleared when progress <= 0.5).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
from collections.abc import Callable
from typing import Any

import numpy as np

from agentrefine_jax.eval.agentboard.checkout import DATA, CheckoutError
from agentrefine_jax.eval.agentboard.tasks.base import AgentBoardTask, EpisodeSpec
from agentrefine_jax.eval.core import StepResult
from agentrefine_jax.eval.envs.babyai import COLORS, DOOR_STATES, OBJECTS, make_level

LEVELS_FILE = "agentboard/environment/babyai_env.py"
LABELS_FILE = "data/babyai/test.jsonl"
PROMPT_FILE = "agentboard/prompts/VanillaAgent/babyai_vanilla_prompt.json"

NAMED = ("door", "key", "ball", "box", "goal", "lava", "wall")
DIRS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid's DIR_TO_VEC: right, down, left, up
# Objects the path search may not step onto, and cells where `drop` is refused (name substrings).
BLOCKING = ("wall", "box", "lava", "ball", "key")
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE = 0, 1, 2, 3, 4, 5

COMPLETED = "\n The task is completed."
NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."


# ------------------------------------------------------------------------------------ the view


class View:
    """The agent's view turned into AgentBoard's description and macro-action table."""

    def __init__(self, env: Any, obs: dict[str, Any]):
        u = env.unwrapped
        self.pos = (int(u.agent_pos[0]), int(u.agent_pos[1]))
        self.dir = int(obs["direction"])
        fwd, right = np.asarray(u.dir_vec), np.asarray(u.right_vec)
        size = int(u.agent_view_size)
        top_left = np.asarray(self.pos) + fwd * (size - 1) - right * (size // 2)
        # The search area: the view square plus, on one axis, one row behind the agent (AgentBoard's bounds).
        far = top_left + size * (right - fwd)
        self.ranges = tuple(
            range(int(far[k]), int(top_left[k]) + 1)
            if far[k] < top_left[k]
            else range(int(top_left[k]), int(far[k]))
            for k in (0, 1)
        )
        image = obs["image"]
        objs: list[tuple[str, tuple[int, int], int]] = []  # (name, cell, manhattan distance)
        barriers: list[tuple[str, tuple[int, int], int]] = []  # (type, cell, distance ahead)
        ahead = DIRS[self.dir]
        for vj in range(size):
            for vi in range(size):
                cell = top_left - fwd * vj + right * vi
                x, y = int(cell[0]), int(cell[1])
                dist = abs(self.pos[0] - x) + abs(self.pos[1] - y)
                if x < 0 or y < 0 or dist == 0:
                    continue
                kind = OBJECTS[image[vi, vj, 0]]
                if kind not in NAMED:
                    continue
                color = COLORS[image[vi, vj, 1]]
                name = (
                    f"{color} {DOOR_STATES[image[vi, vj, 2]]} door" if kind == "door" else f"{color} {kind}"
                )
                objs.append((name, (x, y), dist))
                rel = (x - self.pos[0], y - self.pos[1])
                if kind in ("box", "wall") and ahead[0] * rel[1] - ahead[1] * rel[0] == 0:
                    barriers.append((kind, (x, y), ahead[0] * rel[0] + ahead[1] * rel[1]))
        objs.sort(key=lambda o: o[2])  # stable: ties keep the scan order
        barriers.sort(key=lambda b: b[2])
        self.objs, self.barriers = objs, barriers
        self.blocked = {cell for name, cell, _ in objs if any(b in name for b in BLOCKING)}
        carrying = u.carrying
        self.carrying = None if carrying is None else (carrying.color, carrying.type)
        self.description = self._describe()
        self.errors: dict[str, str] = {}
        self.actions = self._actions()

    def _relative(self, cell: tuple[int, int]) -> tuple[int, int]:
        rel = (cell[0] - self.pos[0], cell[1] - self.pos[1])
        f, r = DIRS[self.dir], DIRS[(self.dir + 1) % 4]
        return f[0] * rel[0] + f[1] * rel[1], r[0] * rel[0] + r[1] * rel[1]

    def _describe(self) -> str:
        if self.objs:
            text = "In front of you in this room, you can see several objects: "
            seen: dict[str, int] = collections.Counter()
            for name, cell, _ in self.objs:
                if "wall" in name:
                    continue
                front, side = self._relative(cell)
                if side == 0:
                    where = f"right in front of you {front} steps away. "
                else:
                    hand = "right" if side > 0 else "left"
                    where = f"{front} steps in front of you and {abs(side)} steps to your {hand}. "
                seen[name] += 1
                text += f"There is a {name} {seen[name]} {where} "
        else:
            text = "You cannot see any objects within sight."
        text += "The room has walls around you. "
        if self.barriers:
            kind, _, dist = self.barriers[0]
            text += f"You are facing a {kind} {dist} steps away. "
        if self.carrying is None:
            return text + "You are not carrying anything."
        return text + f"You are carrying a {self.carrying[0]} {self.carrying[1]}."

    def path(self, target: tuple[int, int], onto: bool) -> list[int] | None:
        """Breadth-first search over (cell, heading); AgentBoard's variant: duplicates are queued, the parent
        of a state is the last one that queued it, and the goal test happens when a state is popped."""
        start = (self.pos, self.dir)
        queue = collections.deque([start])
        popped: set[tuple[tuple[int, int], int]] = set()
        parent: dict[tuple[tuple[int, int], int], tuple[tuple[tuple[int, int], int], int]] = {}
        while queue:
            state = queue.popleft()
            popped.add(state)
            (x, y), d = state
            if (x, y) == target if onto else (target[0] - x, target[1] - y) == DIRS[d]:
                actions = []
                while state != start:
                    state, action = parent[state]
                    actions.append(action)
                return actions[::-1]
            for action in (FORWARD, LEFT, RIGHT):
                if action == FORWARD:
                    nxt = ((x + DIRS[d][0], y + DIRS[d][1]), d)
                else:
                    nxt = ((x, y), (d - 1) % 4 if action == LEFT else (d + 1) % 4)
                cell = nxt[0]
                if cell[0] not in self.ranges[0] or cell[1] not in self.ranges[1]:
                    continue
                if nxt in popped or cell in self.blocked:
                    continue
                queue.append(nxt)
                parent[nxt] = (state, action)
        return None

    def _numbered(self, verb: str, name: str, counts: dict[str, int], found: list[int] | None) -> None:
        """Pickup / go-to numbering: k advances only when a path exists (an unreachable target's error
        names the next k without taking it)."""
        first = f"{verb} {name} 1"
        if found is not None:
            counts[name] = 1 if first not in self.actions else counts[name] + 1
            self.actions[f"{verb} {name} {counts[name]}"] = found
        else:
            label = first if first not in self.actions else f"{verb} {name} {counts[name] + 1}"
            shown = "pickup" if verb == "pickup" else "go to"
            self.errors[label] = (
                f"You cannot {shown} {label[len(verb) + 1 :]}, as there is no path leading to it."
            )

    def _actions(self) -> dict[str, list[int]]:
        self.actions = acts = {"turn left": [LEFT], "turn right": [RIGHT]}
        if not self.barriers or self.barriers[0][2] > 1:
            acts["move forward"] = [FORWARD]
        else:
            self.errors["move forward"] = "There is a barrier in front of you, you can't move forward."
        if self.carrying is None:
            counts: dict[str, int] = {}
            for name, cell, _ in self.objs:
                if "wall" in name or "door" in name or "goal" in name:
                    continue
                found = self.path(cell, onto=False)
                self._numbered("pickup", name, counts, None if found is None else found + [PICKUP])
            self.errors["drop"] = "You cannot drop the object, as you are not carrying anything."
        else:
            front = (self.pos[0] + DIRS[self.dir][0], self.pos[1] + DIRS[self.dir][1])
            if any(cell == front and any(b in name for b in BLOCKING) for name, cell, _ in self.objs):
                self.errors["drop"] = (
                    "You cannot drop the object, as there is already an object in front of you."
                )
            else:
                acts["drop"] = [DROP]
        doors: dict[str, int] = collections.Counter()
        for name, cell, _ in self.objs:
            if "door" not in name:
                continue
            doors[name] += 1
            label = f"{name} {doors[name]}"
            if "open door" in name:
                found = self.path(cell, onto=True)
                if found is not None:
                    acts[f"go through {label}"] = found
                else:
                    self.errors[f"go through {label}"] = (
                        f"You cannot go through {label}, as there is no path leading to it."
                    )
                continue
            if "locked door" in name:
                if self.carrying is None or self.carrying[1] != "key":
                    self.errors[f"toggle and go through {label}"] = (
                        f"You cannot toggle and go through {label}, as you are not carrying a key."
                    )
                    continue
                if self.carrying[0] != name.split(" ")[0]:
                    self.errors[f"toggle and go through {label}"] = (
                        f"You cannot toggle and go through {label}, as the color of the key you are carrying "
                        "does not match the color of door."
                    )
                    continue
            found = self.path(cell, onto=False)
            if found is not None:
                acts[f"toggle and go through {label}"] = found + [TOGGLE, FORWARD]
            else:
                # AgentBoard prints its whole door-count dict here (quirk kept).
                self.errors[f"toggle and go through {label}"] = (
                    f"You cannot toggle and go through {name} {dict(doors)}, "
                    "as there is no path leading to it."
                )
            if found == []:
                acts["toggle"] = [TOGGLE]
            if "closed door" in name:
                self.errors[f"go through {label}"] = (
                    f"You cannot go through {label}, as it is closed. You should toggle it first."
                )
        for name, cell, _ in self.objs:
            if "goal" in name:
                found = self.path(cell, onto=True)
                if found is not None:
                    acts["go to goal"] = found
                else:
                    self.errors["go to goal"] = (
                        "You cannot go to the goal, as there is no path leading to it."
                    )
        counts = {}
        for name, cell, _ in self.objs:
            if "wall" in name or "goal" in name:
                continue
            self._numbered("go to", name, counts, self.path(cell, onto=False))
        acts["check available actions"] = []
        return acts


# ------------------------------------------------------------------------------------ progress


def matches(observation: str, pattern: str) -> bool:
    """A subgoal pattern matches when one `.`-separated sentence holds every `**` (else `*`) piece."""
    pattern = pattern.strip()
    pieces = pattern.split("**" if "**" in pattern else "*")
    return any(all(p.strip(".") in sentence for p in pieces) for sentence in observation.split("."))


class SubgoalProgress:
    """AgentBoard's annotated-subgoal progress (BabyAI, Jericho): a flat pattern list, or alternative
    sequences; per observation the first remaining pattern `match(observation, pattern)` accepts scores."""

    def __init__(self, subgoals: list[Any], match: Callable[[str, str], bool] = matches):
        self.match = match
        self.alternatives = bool(subgoals) and isinstance(subgoals[0], list)
        self.remaining: list[Any] = [list(s) for s in subgoals] if self.alternatives else list(subgoals)
        self.total = (len(subgoals[0]) if self.alternatives else len(subgoals)) if subgoals else 0
        self.points = 0
        self.value = 0.0

    def update(self, observation: str) -> None:
        if not self.remaining:
            return
        if self.alternatives:
            for i in range(len(self.remaining[0])):
                # A shorter alternative would crash AgentBoard (IndexError); here it just cannot match.
                if any(i < len(seq) and self.match(observation, seq[i]) for seq in self.remaining):
                    self._score()
                    for seq in self.remaining:
                        if i < len(seq):
                            seq.remove(seq[i])  # list.remove: the first equal item, as AgentBoard
                    return
        else:
            for pattern in self.remaining:
                if self.match(observation, pattern):
                    self._score()
                    self.remaining.remove(pattern)
                    return

    def _score(self) -> None:
        self.points += 1
        self.value = max(self.value, self.points / self.total)


# ------------------------------------------------------------------------------------ the env


class BabyAIEnv:
    """One AgentBoard BabyAI episode."""

    def __init__(self, level: str, seed: int, subgoals: list[Any]):
        self.level, self.seed, self.subgoals = level, seed, subgoals
        self.env = make_level(level)
        self.goal = ""
        self.done = False
        self.view: View | None = None
        self.last_valid = False
        self.progress = SubgoalProgress(subgoals)

    @property
    def success(self) -> bool:
        return self.done

    def reset(self) -> str:
        with contextlib.redirect_stdout(io.StringIO()):  # minigrid prints each rejected level sample
            obs, _ = self.env.reset(seed=self.seed)
        self.goal = self.env.unwrapped.mission.replace("then", "and").replace("after you", "and")
        self.progress = SubgoalProgress(self.subgoals)
        self.done = False
        self.last_valid = False
        self.image = obs["image"]
        self.view = View(self.env, obs)
        return self.view.description

    def valid_actions(self) -> list[str]:
        assert self.view is not None, "reset first"
        return list(self.view.actions)

    def step(self, action: str) -> StepResult:
        assert self.view is not None, "reset first"
        action = action.lower().strip()
        if "check" in action:
            text = "You can take the following actions: " + ", ".join(self.view.actions)
            self.last_valid = True
            return StepResult(text, self.done, self.progress.value, True)
        if action not in self.view.actions:
            text = "No change in state." if action == "" else self.view.errors.get(action, NOT_RECOGNIZED)
            self.last_valid = False
            return StepResult(text, self.done, self.progress.value, False)
        if not self.view.actions[action]:
            # Already there (`go to X k` facing X): no env step, and AgentBoard leaves its validity flag as
            # the previous step set it (False before any step).
            return StepResult("No change in state.", self.done, self.progress.value, self.last_valid)
        terminated = False
        for primitive in self.view.actions[action]:
            obs, _, terminated, _, _ = self.env.step(primitive)
            if np.array_equal(obs["image"], self.image):
                break  # the primitive changed nothing: the macro stops here
            self.image = obs["image"]
        self.image = obs["image"]
        self.view = View(self.env, obs)
        text = self.view.description + (COMPLETED if terminated else "")
        self.progress.update(text)
        done = bool(terminated) and self.progress.value > 0.5
        if self.progress.value == 1 and not done:
            done = True
            text += COMPLETED
        self.done = done
        self.last_valid = True
        return StepResult(text, done, self.progress.value, True)

    def close(self) -> None:
        self.env.close()


# ------------------------------------------------------------------------------------ the oracle


def _state_key(env: Any) -> tuple:
    u = env.unwrapped
    carrying = None if u.carrying is None else (u.carrying.type, u.carrying.color)
    return (tuple(int(v) for v in u.agent_pos), int(u.agent_dir), carrying, u.grid.encode().tobytes())


class BotStuck(RuntimeError):
    """minigrid's bot re-plans without end on some states (e.g. UnlockToUnlock seed 1234)."""


def _guarded_bot(env: Any) -> Any:
    """A BabyAIBot whose single `replan` may run at most `SEARCHES` path searches."""
    from minigrid.utils.baby_ai_bot import BabyAIBot

    class GuardedBot(BabyAIBot):
        SEARCHES = 300
        searches_left = SEARCHES

        def replan(self, action_taken: Any = None) -> Any:
            self.searches_left = self.SEARCHES
            return super().replan(action_taken)

        def _shortest_path(self, *args: Any, **kwargs: Any) -> Any:
            self.searches_left -= 1
            if self.searches_left < 0:
                raise BotStuck("BabyAIBot re-plans without end")
            return super()._shortest_path(*args, **kwargs)

    return GuardedBot(env)


class BotOracle:
    """minigrid's BabyAIBot driven through the macro-action interface.

    One bot plays the whole episode on a private copy of the env kept in step with the real one. Each turn
    the bot's plan is rolled out on a copy (up to `horizon` primitives); every listed macro is tried on a
    copy too, and the one whose end state lies furthest along the rollout is taken; the bot is then advanced
    to that point. When no macro reproduces even the bot's first primitive, `check available actions` is
    answered (a wasted step, counted like any other)."""

    def __init__(self, horizon: int = 48):
        self.horizon = horizon
        self.pair: tuple[Any, Any] | None = None  # (bot, its env copy), in step with the real env

    def _rollout(self, env: BabyAIEnv) -> dict[tuple, int]:
        if self.pair is None:
            sim = copy.deepcopy(env.env)
            self.pair = (_guarded_bot(sim.unwrapped), sim)
        bot, sim = copy.deepcopy(self.pair)  # together: the bot's references into its env stay consistent
        reached: dict[tuple, int] = {}
        with contextlib.redirect_stdout(io.StringIO()):
            for t in range(self.horizon):
                try:
                    primitive = int(bot.replan())
                except Exception:  # noqa: BLE001 - the bot gives up on some states; keep what it planned
                    break
                _, _, terminated, _, _ = sim.step(primitive)
                reached[_state_key(sim)] = t + 1  # a revisited state counts at its latest visit
                if terminated:
                    break
        return reached

    def next_action(self, env: BabyAIEnv, history: list[tuple[str, str]]) -> str:
        assert env.view is not None
        reached = self._rollout(env)
        if not reached:  # the bot is stuck: a fresh one (no memory of the episode) from the current state
            self.pair = None
            reached = self._rollout(env)
        best, best_t = "check available actions", 0
        for name, primitives in env.view.actions.items():
            if not primitives:
                continue
            trial = copy.deepcopy(env.env)
            image = env.image
            for p in primitives:
                obs, *_ = trial.step(p)
                if np.array_equal(obs["image"], image):
                    break
                image = obs["image"]
            t = reached.get(_state_key(trial), 0)
            if t > best_t:
                best, best_t = name, t
        assert self.pair is not None
        bot, sim = self.pair
        with contextlib.redirect_stdout(io.StringIO()):
            for _ in range(best_t):  # the same replans as the rollout: deterministic
                sim.step(int(bot.replan()))
        return best


# ------------------------------------------------------------------------------------ the task


class BabyAITask(AgentBoardTask):
    name = "babyai"
    prompt_file = PROMPT_FILE  # CFG env.babyai.check_inventory: "inventory" (the default: on)

    def episodes(self, checkout: Any) -> list[EpisodeSpec]:
        cfg = checkout.env_config("babyai")
        levels_table = checkout.literal(LEVELS_FILE, "all_levels")
        try:
            levels = [levels_table[int(i)] for i in cfg.get("game_level", [])]
        except (KeyError, ValueError, TypeError) as e:
            raise CheckoutError(f"{checkout.root / LEVELS_FILE}: no level {e} in all_levels") from None
        first_seed, per_level = int(cfg.get("seed", 1234)), int(cfg.get("env_num_per_task", 1))
        checkout.path(LABELS_FILE, DATA)
        rows = checkout.read_jsonl(LABELS_FILE)
        if len(rows) != len(levels) * per_level:
            raise CheckoutError(
                f"{checkout.root / LABELS_FILE}: {len(rows)} lines, expected "
                f"{len(levels)} levels x {per_level} "
                f"seeds = {len(levels) * per_level} (eval config env.babyai; provided by {DATA})"
            )
        specs = []
        for level in levels:
            for seed in range(first_seed, first_seed + per_level):
                i = len(specs)
                row = rows[i]
                if "difficulty" not in row:
                    raise CheckoutError(f"{checkout.root / LABELS_FILE}:{i + 1}: no difficulty")
                if "subgoals" in row and "subgoals_1" not in row:
                    subgoals = row["subgoals"]
                else:  # alternative sequences: every key naming subgoals, in file order
                    subgoals = [v for k, v in row.items() if "subgoals" in k]
                specs.append(
                    EpisodeSpec(
                        "babyai",
                        i,
                        f"{level}/{seed}",
                        row["difficulty"],
                        {"level": level, "seed": seed, "subgoals": subgoals},
                    )
                )
        return specs

    def make_env(self, checkout: Any, episode: EpisodeSpec) -> BabyAIEnv:
        info = episode.info
        return BabyAIEnv(info["level"], int(info["seed"]), info["subgoals"])

    def oracle(self, env: Any) -> BotOracle:
        return BotOracle()
