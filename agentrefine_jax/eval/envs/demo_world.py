"""Held-out worlds of the demo's own generator (`data/demo_world.py`), played as an eval task.

The shipped demo trajectories (`agentrefine_jax/data/demo`) come from seeds 0.. (train) and
1,000,000.. (eval); this task plays worlds from seeds 2,000,000 + 10,000 * run seed + i, which neither
file uses, with the same rooms, containers, objects, action grammar and simulator (`World.step`: its
validity verdicts and error texts are the environment's). A model refinement-tuned on the demo is thus
measured on unseen worlds of the distribution it was trained on: the mini paper's in-distribution check
(benchmarks/mini_paper.py). The prompt layout is the eval harness's (agentrefine_jax.layout), the
demo's system text (rooms, the action help) its instruction.

Progress (two subgoals, best so far): the task object has been carried (0.5); it lies in/on the target
place (1.0, success). The episode has no terminal failure: it ends on success or at the step limit.
Oracle: the demo's expert (`_expert_steps`) replanned from the current state.
"""

from __future__ import annotations

import random
from typing import Any

from agentrefine_jax.data import demo_world as dw
from agentrefine_jax.eval.envs.base import EvalTask, StepResult, TextEnv
from agentrefine_jax.eval.perturb import Vocabulary, action_words

# Seeds of the held-out worlds: past both shipped splits (train 0.., eval 1,000,000..).
SEED_BASE = 2_000_000
SEED_STRIDE = 10_000
# Training worlds (the on-policy collector's): the demo generator's training seeds, 0..999,999 (the worlds
# of `data demo-world --train N`); held-out worlds are >= SEED_BASE for every run seed >= 0.
TRAIN_SEEDS = range(0, 1_000_000)

WORDS = action_words(
    """
    go to | {verb} <adjacent room> | walk to a room connected to the one you are in
      || move to | move into a neighbouring room
      || head to | head into a room next to this one
      || walk to | walk into an adjacent room
    open | {verb} <container> | open a closed container in this room to see inside
      || pull open | pull a closed container in this room open
      || unlatch | unlatch a closed container here
      || uncover | uncover a closed container here to see its contents
    take | {verb} <object> from <place> | pick up an object you can see in/on a place in this room
      || pick up | pick up a visible object from a place in this room
      || grab | grab a visible object from a place here
      || collect | collect a visible object from a place here
    put | {verb} <object> in/on <place> | put an object you carry in/on a place in this room
      || place | place a carried object in/on a place here
      || set | set a carried object in/on a place here
      || leave | leave a carried object in/on a place here
    look | {verb} | describe the room you are in
      || look around | describe your surroundings
      || observe | observe the room you are in
      || survey | survey the room you are in
    inventory | {verb} | list what you carry
      || check bag | list the objects you are holding
      || check hands | say what you are holding
      || list items | list the items you carry
    """
)


class DemoWorldEnv(TextEnv):
    task = "demo_world"
    intro = ""  # set per world (its rooms), in __init__

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary):
        super().__init__(spec, vocab)
        self.world: dw.World | None = None
        self.intro = (
            "You are an agent in a text household. Open containers to see inside. Rooms of this house: "
            + ", ".join(dw.make_world(random.Random(int(spec["seed"]))).rooms)
            + "."
        )

    def _reset(self) -> tuple[str, str]:
        self.world = dw.make_world(random.Random(int(self.spec["seed"])))
        w = self.world
        return f"put the {w.task_object} {dw._prep(w.task_target)} the {w.task_target}", w.describe()

    def _progress(self) -> float:
        assert self.world is not None
        if self.world.location.get(self.world.task_object) == self.world.task_target:
            return 1.0
        return max(
            self.best_progress, 0.5 if self.world.location.get(self.world.task_object) == "agent" else 0.0
        )

    def _step(self, canonical: str) -> StepResult:
        assert self.world is not None
        observation, valid = self.world.step(canonical)
        progress = self._progress()
        return StepResult(observation, progress=progress, valid=valid, success=progress == 1.0)

    def _valid_canonical(self) -> list[str]:
        w = self.world
        assert w is not None
        room = w.agent_room
        out = ["look", "inventory", *(f"go to {r}" for r in sorted(w.edges[room]))]
        out += [f"open {c}" for c in w.places[room] if c in w.closed]
        out += [f"take {o} from {p}" for o, p in w.visible(room)]
        held = sorted(o for o, p in w.location.items() if p == "agent")
        out += [f"put {o} {dw._prep(p)} {p}" for o in held for p in w.places[room] if p not in w.closed]
        return out

    def _oracle_canonical(self) -> str:
        assert self.world is not None
        return dw._expert_steps(self.world)[0][1]


class DemoWorldTask(EvalTask):
    name = "demo_world"
    display_name = "Demo world"
    # The expert needs at most ~12 steps; 20 leaves room for a few recoveries.
    default_max_steps = 20
    words = WORDS

    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [{"seed": SEED_BASE + SEED_STRIDE * seed + i} for i in range(n)]

    has_training_split = True

    def training_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        """Worlds seed, seed + 1, ..., seed + n - 1 of the generator's training range."""
        if seed < TRAIN_SEEDS.start or seed + n > TRAIN_SEEDS.stop:
            raise ValueError(
                f"demo_world training worlds are seeds {TRAIN_SEEDS.start}..{TRAIN_SEEDS.stop - 1}: "
                f"--seed {seed} with {n} episodes leaves them"
            )
        return [{"seed": seed + i} for i in range(n)]

    def is_eval_spec(self, spec: dict[str, Any]) -> bool:
        return int(spec["seed"]) >= SEED_BASE

    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> TextEnv:
        return DemoWorldEnv(spec, self.vocabulary(perturbation))
