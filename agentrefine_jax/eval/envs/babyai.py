"""BabyAI (minigrid) through our own text rendering of the agent's egocentric view.

The agent acts with minigrid's primitive actions. The view is described relative to the agent
("2 steps ahead and 1 step to your left"), from minigrid's own partial observation, so occlusion
by walls and closed doors is respected. Oracle: minigrid's `BabyAIBot`.

Progress (our definition; AgentBoard's subgoal files are not available): the mission is split
into its instruction leaves (go to / pick up / open / put next to), each leaf into subgoals that
are achievements in the world (merely seeing a target earns nothing); progress is the fraction of
subgoals reached at some point of the episode (best so far), 1.0 on success.
  go to X:          next to X, facing X
  pick up X:        facing X, carrying X
  open door D:      facing D, D open
  put X next to Y:  facing X, carrying X, X placed next to Y
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np

from agentrefine_jax.eval.envs.base import INVALID_ACTION, EvalTask, StepResult, TextEnv, rejected
from agentrefine_jax.eval.perturb import Vocabulary, action_words

# Single-room and one-door levels whose bot solutions fit in the step budget (<= 25 steps measured).
DEFAULT_LEVELS = (
    "BabyAI-GoToRedBallGrey-v0",
    "BabyAI-GoToRedBall-v0",
    "BabyAI-GoToObj-v0",
    "BabyAI-GoToLocal-v0",
    "BabyAI-PickupLoc-v0",
    "BabyAI-PutNextLocal-v0",
    "BabyAI-OpenDoor-v0",
    "BabyAI-GoToDoor-v0",
    "BabyAI-UnlockLocal-v0",
    "BabyAI-GoToObjDoor-v0",
    "BabyAI-ActionObjDoor-v0",
)

WORDS = action_words(
    """
    turn left | {verb} | turn 90 degrees to your left, staying on the same cell
      || rotate left | rotate a quarter turn counter-clockwise without moving
      || face left | change your heading to the direction on your left
      || spin anticlockwise | spin 90 degrees anticlockwise in place
    turn right | {verb} | turn 90 degrees to your right, staying on the same cell
      || rotate right | rotate a quarter turn clockwise without moving
      || face right | change your heading to the direction on your right
      || spin clockwise | spin 90 degrees clockwise in place
    move forward | {verb} | move one cell ahead, if that cell is free (empty floor or an open door)
      || step ahead | advance by one cell in the direction you face, if it is free
      || advance | go one square forward when the square in front is not blocked
      || walk forward | walk a single cell forward unless something blocks you
    pick up | {verb} | pick up the object directly in front of you (you can carry one object)
      || grab | grab the item right in front of you; your hands hold a single item
      || collect | collect the object on the cell ahead of you (only one at a time)
      || lift | lift the thing in front of you and carry it (capacity: one thing)
    drop | {verb} | put the object you carry on the free cell directly in front of you
      || put down | put the carried item down on the empty cell ahead
      || release | release what you hold onto the free square in front of you
      || place | place your carried object on the unoccupied cell before you
    toggle | {verb} | interact with the object in front of you: open or close a door (a locked door needs a
      key of the same colour), or open a box
      || interact | use the thing ahead of you: opens or shuts doors (locked ones need the matching key in
      hand) and opens boxes
      || activate | activate the object before you to open/close a door (same-coloured key needed if locked)
      or open a box
      || operate | operate the cell in front: doors swing open or closed (a locked door wants its colour's
      key), boxes open
    """
)

_VIEW = 7
_AGENT_X, _AGENT_Y = _VIEW // 2, _VIEW - 1
# minigrid's encoding tables (minigrid.core.constants), fixed since minigrid 1.x; both sources read them.
OBJECTS = ("unseen", "empty", "wall", "floor", "door", "key", "ball", "box", "goal", "lava", "agent")
COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
DOOR_STATES = ("open", "closed", "locked")
# minigrid 2.3.0 (AgentBoard's pin) registered BabyAI-GoToObjS6-v0 with room_size=4: GoToObjS4-v0's env.
LEVEL_ALIASES = {"BabyAI-GoToObjS6-v0": "BabyAI-GoToObjS4-v0"}


def make_level(level: str) -> Any:
    import gymnasium
    import minigrid  # noqa: F401 - registers the BabyAI ids

    return gymnasium.make(LEVEL_ALIASES.get(level, level))


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _relative(fwd: int, lat: int) -> str:
    side = "left" if lat < 0 else "right"
    if lat == 0:
        return "right in front of you" if fwd == 1 else f"{_steps(fwd)} straight ahead"
    if fwd == 0:
        return f"{_steps(abs(lat))} to your {side}"
    return f"{_steps(fwd)} ahead and {_steps(abs(lat))} to your {side}"


def _describe_cell(cell: np.ndarray) -> str:
    kind = OBJECTS[int(cell[0])]
    color = COLORS[int(cell[1])]
    if kind == "door":
        return f"a {DOOR_STATES[int(cell[2])]} {color} door"
    if kind in ("key", "ball", "box"):
        return f"a {color} {kind}"
    if kind == "goal":
        return "the green goal square"
    if kind == "lava":
        return "lava"
    return kind


def render_view(image: np.ndarray, carrying: Any) -> str:
    """Describe minigrid's egocentric (7, 7, 3) observation; the agent sits at (3, 6) facing up."""
    objects = []
    for x in range(_VIEW):
        for y in range(_VIEW):
            if (x, y) == (_AGENT_X, _AGENT_Y):
                continue
            kind = OBJECTS[int(image[x, y, 0])]
            if kind in ("unseen", "empty", "wall", "floor", "agent"):
                continue
            fwd, lat = _AGENT_Y - y, x - _AGENT_X
            objects.append((fwd + abs(lat), fwd, lat, _describe_cell(image[x, y])))
    lines = []
    if objects:
        lines.append("You see:")
        for _, fwd, lat, desc in sorted(objects):
            lines.append(f"- {desc}, {_relative(fwd, lat)}")
    else:
        lines.append("You see no objects around you.")
    front = image[_AGENT_X, _AGENT_Y - 1]
    front_kind = OBJECTS[int(front[0])]
    front_desc = "empty floor" if front_kind == "empty" else _describe_cell(front)
    lines.append(f"Directly in front of you: {front_desc}.")
    lines.append(
        "Nearest wall: "
        + f"ahead {_wall_distance(image, 0, -1)}, left {_wall_distance(image, -1, 0)}, "
        + f"right {_wall_distance(image, 1, 0)}."
    )
    lines.append(f"You are carrying {_carried(carrying)}.")
    return "\n".join(lines)


def _wall_distance(image: np.ndarray, dx: int, dy: int) -> str:
    x, y, d = _AGENT_X + dx, _AGENT_Y + dy, 1
    while 0 <= x < _VIEW and 0 <= y < _VIEW:
        kind = OBJECTS[int(image[x, y, 0])]
        if kind == "wall":
            return _steps(d)
        if kind == "unseen":
            return "not visible"
        x, y, d = x + dx, y + dy, d + 1
    return f"more than {_steps(d - 1)}"


def _carried(obj: Any) -> str:
    return "nothing" if obj is None else f"a {obj.color} {obj.type}"


def _leaves(instr: Any) -> list[Any]:
    from minigrid.envs.babyai.core.verifier import SeqInstr

    if isinstance(instr, SeqInstr):
        return _leaves(instr.instr_a) + _leaves(instr.instr_b)
    return [instr]


class BabyAIEnv(TextEnv):
    task = "babyai"
    intro = (
        "You are an agent in a 2D grid world of rooms, walls, doors and objects (balls, boxes, keys). "
        "You see the 7x7 area in front of you; walls and closed doors block the view. Positions are "
        "given relative to you: steps ahead, and steps to your left or right. You can only interact "
        "with the cell directly in front of you."
    )

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary):
        super().__init__(spec, vocab)
        self._env = make_level(spec["level"]).unwrapped
        self._actions = {
            "turn left": self._env.actions.left,
            "turn right": self._env.actions.right,
            "move forward": self._env.actions.forward,
            "pick up": self._env.actions.pickup,
            "drop": self._env.actions.drop,
            "toggle": self._env.actions.toggle,
        }
        self._bot: Any = None
        self._last_action: Any = None
        self._subgoals_done: set[int] = set()
        self._num_subgoals = 1

    def _reset(self) -> tuple[str, str]:
        # minigrid prints "Sampling rejected" while placing objects; that is not our output.
        with contextlib.redirect_stdout(io.StringIO()):
            obs, _ = self._env.reset(seed=int(self.spec["seed"]))
        self._bot = None
        self._last_action = None
        self._leaves = _leaves(self._env.instrs)
        self._num_subgoals = sum(3 if type(leaf).__name__ == "PutNextInstr" else 2 for leaf in self._leaves)
        self._subgoals_done = set()
        self._update_subgoals()
        return self._env.mission, render_view(obs["image"], self._env.carrying)

    def _initial_progress(self) -> float:
        return len(self._subgoals_done) / self._num_subgoals

    def _valid_canonical(self) -> list[str]:
        return list(self._actions)

    def _oracle_canonical(self) -> str:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        if self._bot is None:
            self._bot = BabyAIBot(self._env)
        action = self._bot.replan(self._last_action)
        for name, a in self._actions.items():
            if a == action:
                return name
        raise RuntimeError(f"BabyAIBot suggested {action!r} on an unfinished {self.spec['level']} episode")

    def _step(self, canonical: str) -> StepResult:
        key = canonical.lower()
        if key not in self._actions:
            return rejected(INVALID_ACTION.format(action=self.vocab.to_surface(canonical)))
        env = self._env
        before = (tuple(env.agent_pos), env.agent_dir, env.carrying, self._front_state())
        action = self._actions[key]
        obs, reward, terminated, truncated, _ = env.step(action)
        self._last_action = action
        self._update_subgoals()
        feedback = self._feedback(key, before)
        text = render_view(obs["image"], env.carrying)
        if feedback:
            text = f"{feedback}\n{text}"
        success = bool(terminated and reward > 0)
        if terminated and not success:
            text += "\nThe mission has failed."
        progress = len(self._subgoals_done) / self._num_subgoals
        return StepResult(text, bool(terminated or truncated), progress, success=success)

    # ------------------------------------------------------------------ helpers

    def _front_state(self) -> tuple[Any, Any]:
        cell = self._env.grid.get(*self._env.front_pos)
        return (cell, getattr(cell, "is_open", None))

    def _feedback(self, action: str, before: tuple) -> str:
        """Say when an action had no effect, so the agent is not left guessing."""
        env = self._env
        pos, _, carrying, (front, front_open) = before
        if action == "move forward" and tuple(env.agent_pos) == pos:
            return f"You cannot move forward: {_front_name(front)} blocks the way."
        if action == "pick up" and env.carrying is carrying:
            if carrying is not None:
                return f"You are already carrying {_carried(carrying)}; drop it first."
            return f"There is nothing you can pick up in front of you ({_front_name(front)})."
        if action == "drop" and env.carrying is carrying and carrying is not None:
            return f"You cannot drop {_carried(carrying)} here: the cell in front of you is not free."
        if action == "toggle":
            now_cell, now_open = self._front_state()
            if front is not None and front.type == "door":
                if now_open != front_open:
                    return f"You {'opened' if now_open else 'closed'} the {front.color} door."
                if front.is_locked:
                    return f"The {front.color} door is locked; you need to carry a {front.color} key."
            elif front is not None and front.type == "box" and now_cell is not front:
                inside = "nothing" if now_cell is None else f"a {now_cell.color} {now_cell.type}"
                return f"You opened the {front.color} box; it contained {inside}."
            return f"Nothing happens ({_front_name(front)} in front of you)."
        return ""

    def _update_subgoals(self) -> None:
        env = self._env
        front = env.grid.get(*env.front_pos)
        idx = 0
        for leaf in self._leaves:
            kind = type(leaf).__name__
            if kind == "PutNextInstr":
                moving, fixed = leaf.desc_move.obj_set, leaf.desc_fixed.obj_set
                checks = [
                    any(front is o for o in moving) or any(env.carrying is o for o in moving),
                    any(env.carrying is o for o in moving),
                    any(_next_to(a, b) for a in moving for b in fixed if a is not env.carrying),
                ]
            else:
                objs = leaf.desc.obj_set
                facing = any(front is o for o in objs)
                if kind == "GoToInstr":
                    checks = [any(_next_to(env.agent_pos, o) for o in objs), facing]
                elif kind == "PickupInstr":
                    carrying = any(env.carrying is o for o in objs)
                    checks = [facing or carrying, carrying]
                else:  # OpenInstr
                    checks = [facing, any(getattr(o, "is_open", False) for o in objs)]
            for ok in checks:
                if ok:
                    self._subgoals_done.add(idx)
                idx += 1


def _front_name(cell: Any) -> str:
    if cell is None:
        return "empty floor"
    if cell.type == "door":
        state = "open" if cell.is_open else ("locked" if cell.is_locked else "closed")
        return f"a {state} {cell.color} door"
    if cell.type == "wall":
        return "a wall"
    return f"a {cell.color} {cell.type}"


def _next_to(pos: Any, obj: Any) -> bool:
    """`obj` stands on a cell beside `pos` (a position, or an object's)."""
    pb = obj.cur_pos
    pa = getattr(pos, "cur_pos", pos)
    if pa is None or pb is None or pa[0] < 0 or pb[0] < 0:
        return False
    return abs(int(pa[0]) - int(pb[0])) + abs(int(pa[1]) - int(pb[1])) == 1


# Level seeds of training episodes start here (2**50 ~ 1.1e15); minigrid takes any seed >= 0.
TRAIN_SEED_BASE = 2**50


class BabyAITask(EvalTask):
    name = "babyai"
    display_name = "BabyAI"
    default_max_steps = 40
    words = WORDS

    def __init__(self, workdir: str, levels: tuple[str, ...] = DEFAULT_LEVELS):
        super().__init__(workdir)
        self.levels = levels

    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [{"level": self.levels[i % len(self.levels)], "seed": seed * 100_003 + i} for i in range(n)]

    has_training_split = True

    def training_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        """Level seeds from TRAIN_SEED_BASE on: eval seeds (run seed < 2**31, so below 100_003 * 2**31 + n
        ~ 2.1e14 + n) never reach them."""
        base = TRAIN_SEED_BASE + seed * 100_003
        if seed < 0 or n > 100_003:
            raise ValueError("babyai training episodes need --seed >= 0 and at most 100003 episodes per seed")
        return [{"level": self.levels[i % len(self.levels)], "seed": base + i} for i in range(n)]

    def is_eval_spec(self, spec: dict[str, Any]) -> bool:
        return int(spec["seed"]) < TRAIN_SEED_BASE

    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> TextEnv:
        return BabyAIEnv(spec, self.vocabulary(perturbation))
