"""ScienceWorld (the `scienceworld` wheel ships its simulator jar; needs Java 17).

Observations and action parsing are the simulator's own; we only reword action verbs under
perturbations. Oracle: ScienceWorld's gold action sequence. Progress: the simulator's 0-100 task
score, best so far, divided by 100 (a failed task reports -100 and counts as 0).
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from typing import Any

from agentrefine_jax.eval.envs.base import INVALID_ACTION, EvalTask, StepResult, TextEnv, rejected
from agentrefine_jax.eval.perturb import Vocabulary, action_words

# Task types whose gold paths (simplification "easy", test variations) finish in <= 31 steps. Left out:
# long procedures (boil, melt, grow-*, mendelian-*, inclined-plane-*, identify-life-stages-1) and
# freeze / change-the-state-of-matter-of, whose gold paths fail on some test variations.
DEFAULT_TASKS = (
    "find-living-thing",
    "find-non-living-thing",
    "find-plant",
    "find-animal",
    "lifespan-longest-lived",
    "lifespan-shortest-lived",
    "lifespan-longest-lived-then-shortest-lived",
    "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color",
    "chemistry-mix",
    "power-component",
    "power-component-renewable-vs-nonrenewable-energy",
    "identify-life-stages-2",
    "test-conductivity",
    "test-conductivity-of-unknown-substances",
    "use-thermometer",
    "measure-melting-point-known-substance",
)
DEFAULT_SIMPLIFICATION = "easy"
_NO_MATCH = "No known action matches that input."
# Commands the agent may not send: they would restart the task and erase the score.
_BLOCKED = ("reset task",)

WORDS = action_words(
    """
    open | {verb} OBJ | open a container or door
      || open up | open up a container or a door || unclose | make a container or door open
      || pry open | pry a container or door open
    close | {verb} OBJ | close a container or door
      || shut | shut a container or a door || seal | seal a container or door closed
      || close up | close up a container or door
    activate | {verb} OBJ | turn on a device
      || switch on | switch a device on || turn on | turn a device on || power on | power a device on
    deactivate | {verb} OBJ | turn off a device
      || switch off | switch a device off || turn off | turn a device off || power off | power a device off
    connect | {verb} OBJ to OBJ | connect two electrical components
      || attach | attach one electrical component to another || link | link two electrical components
      || wire | wire an electrical component to another
    disconnect | {verb} OBJ | disconnect an electrical component
      || detach | detach an electrical component || unlink | unlink an electrical component
      || unwire | unwire an electrical component
    use | {verb} OBJ [on OBJ] | use a device or item, optionally on another object
      || apply | apply a device or item, optionally on another object
      || utilize | utilize an item or device, optionally on something
      || employ | employ a device or item, optionally on another object
    look around | {verb} | describe the current room
      || survey the room | get a description of the room you are in
      || scan surroundings | scan the surroundings of your current room
      || observe the area | observe the area you are in
    look at | {verb} OBJ | describe an object in detail
      || examine | examine an object closely || inspect | inspect an object in detail
      || study | study an object carefully
    look in | {verb} OBJ | describe a container's contents
      || peek into | peek into a container to see its contents
      || search | search a container and list what is inside
      || peer into | peer into a container to list its contents
    read | {verb} OBJ | read a note or book
      || peruse | peruse a note or a book || skim | skim through a note or book
      || scan | scan a note or a book
    move | {verb} OBJ to OBJ | move an object to a container
      || transfer | transfer an object into a container || relocate | relocate an object to a container
      || shift | shift an object into a container
    pick up | {verb} OBJ | move an object to the inventory
      || grab | grab an object and keep it in the inventory || take | take an object into your inventory
      || collect | collect an object into the inventory
    put down | {verb} OBJ | drop an inventory item
      || drop | drop an item from the inventory || set down | set down an item you carry
      || release | release an inventory item
    pour | {verb} OBJ in OBJ | pour a liquid into a container
      || decant | decant a liquid into a container || tip | tip a liquid into a container
      || spill | spill a liquid into a container
    dunk | {verb} OBJ in OBJ | dunk a container into a liquid
      || dip | dip a container into a liquid || submerge | submerge a container in a liquid
      || plunge | plunge a container into a liquid
    mix | {verb} OBJ | chemically mix a container's contents
      || stir | stir the contents of a container together || blend | blend a container's contents
      || combine | combine the contents of a container
    go to | {verb} LOC | move to a new location
      || walk to | walk to another location || head to | head to a different location
      || travel to | travel to another location
    teleport to | {verb} LOC | teleport to a specific room
      || warp to | warp directly to a room || jump to | jump straight to a room
      || transport to | get transported to a room
    eat | {verb} OBJ | eat a food
      || consume | consume some food || devour | devour some food || ingest | ingest a food
    flush | {verb} OBJ | flush a toilet
      || drain | drain a toilet || purge | purge a toilet || empty | empty a toilet by flushing
    focus on | {verb} OBJ | signal the object the task is about (irreversible: focusing on a wrong object
      fails the task)
      || concentrate on | declare the object the task is about (focusing on a wrong one fails the task)
      || select | select the task-relevant object; a wrong selection fails the task
      || mark | mark the object the task asks about; marking a wrong one fails the task
    wait | {verb} | take no action for 10 steps
      || pause | do nothing for 10 steps || idle | stay idle for 10 steps || hold on | hold on for 10 steps
    wait1 | {verb} | take no action for 1 step
      || pause1 | do nothing for a single step || idle1 | stay idle for one step
      || hold on1 | hold on for one step
    task | {verb} | describe the current task
      || show task | show the current task || describe task | describe the task again
      || repeat task | repeat the task description
    inventory | {verb} | list your inventory
      || show inventory | show what you are carrying || list items | list the items you carry
      || view inventory | view your inventory
    """
)

_CHOICE_RE = re.compile(r"^(\s*\d+:\s*)(.*)$", re.MULTILINE)


class JVMPool:
    """ScienceWorld simulators, one fresh JVM per episode (both sources), the next one started in advance.

    A simulator is never reused: `load` seeds Scala's global `Random` with the variation index, but the
    first use of a class in a JVM (companion objects' initialisers: pictures, books, animals...) draws from
    that same generator. On a JVM that already ran other episodes those draws are gone, so the same
    task/variation shows other wandering bees or a thermometer one degree off. With a pool shared by the
    episodes in flight, which JVM ran what depended on the batch size: runs were not reproducible.
    AgentBoard runs every episode on one fresh JVM in file order; a fresh JVM per episode makes each
    episode depend on its own seed only (the first episode equals AgentBoard's). `release` closes the JVM;
    a spare is started in a background thread after each `acquire`, so an episode rarely waits for one.
    """

    def __init__(self, step_limit: int):
        self.step_limit = step_limit
        self._lock = threading.Lock()
        self._spare: concurrent.futures.Future[Any] | None = None
        self._starter = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sciworld-jvm"
        )
        self._open: list[Any] = []
        self._closed = False

    def _start(self) -> Any:
        from scienceworld import ScienceWorldEnv

        env = ScienceWorldEnv("", envStepLimit=self.step_limit)
        with self._lock:
            self._open.append(env)
        return env

    def acquire(self) -> Any:
        with self._lock:
            spare, self._spare = self._spare, None
        env = spare.result() if spare is not None else self._start()
        with self._lock:
            if not self._closed:
                self._spare = self._starter.submit(self._start)
        return env

    def release(self, env: Any) -> None:
        with self._lock:
            if env in self._open:
                self._open.remove(env)
        _close(env)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            try:
                spare.result()  # joined, then closed below with the rest
            except Exception:  # noqa: BLE001 - a spare that failed to start has nothing to close
                pass
        self._starter.shutdown(wait=True)
        with self._lock:
            envs, self._open = self._open, []
        for env in envs:
            _close(env)


def _close(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - best effort shutdown of a child JVM
        pass


class SciWorldEnv(TextEnv):
    task = "sciworld"
    intro = (
        "You are an agent in ScienceWorld, a simulated house with rooms, objects and science equipment. "
        "Complete the science task you are given. OBJ and LOC stand for names of objects and locations as "
        "they appear in the observations. When an action is ambiguous the environment lists numbered "
        "options; answer with the number."
    )

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary, pool: JVMPool, oracle: bool):
        super().__init__(spec, vocab)
        self._pool = pool
        self._oracle = oracle
        self._sw: Any = pool.acquire()
        self._gold: list[str] = []
        self._gold_pos = 0
        self._valid: list[str] = []

    def close(self) -> None:
        if self._sw is not None:
            self._pool.release(self._sw)
            self._sw = None

    def _reset(self) -> tuple[str, str]:
        sw = self._sw
        sw.load(
            self.spec["task_name"],
            int(self.spec["variation"]),
            self.spec["simplification"],
            generateGoldPath=self._oracle,
        )
        obs, info = sw.reset()
        self._gold = list(sw.get_gold_action_sequence()) if self._oracle else []
        self._gold_pos = 0
        self._valid = list(info.get("valid", []))
        self._score = max(0, int(info.get("score", 0)))
        return sw.get_task_description(), self._surface_text(obs)

    def _initial_progress(self) -> float:
        return self._score / 100.0

    def _surface_text(self, obs: str) -> str:
        # Numbered disambiguation options name canonical actions; show them in the agent's wording.
        return _CHOICE_RE.sub(lambda m: m.group(1) + self.vocab.to_surface(m.group(2)), obs)

    def _valid_canonical(self) -> list[str]:
        return [a for a in self._valid if a not in _BLOCKED]

    def _oracle_canonical(self) -> str:
        if not self._oracle:
            raise RuntimeError("this ScienceWorld episode was created without its gold path (oracle=False)")
        if self._gold_pos >= len(self._gold):
            raise RuntimeError(f"gold path of {self.spec} exhausted before the task completed")
        return self._gold[self._gold_pos]

    def _step(self, canonical: str) -> StepResult:
        if canonical.strip().lower() in _BLOCKED:
            return rejected(INVALID_ACTION.format(action=canonical))
        if self._oracle and self._gold_pos < len(self._gold):
            gold = self._gold[self._gold_pos]
            # Gold paths use aliases (e.g. "examine") that a perturbed vocabulary may map onto another
            # canonical verb ("look at"); compare after the same surface round trip the command took.
            if canonical in (gold, self.vocab.to_canonical(self.vocab.to_surface(gold))):
                self._gold_pos += 1
        obs, _, completed, info = self._sw.step(canonical)
        score = int(info.get("score", 0))
        self._valid = list(info.get("valid", []))
        accepted = obs.strip() != _NO_MATCH
        success = bool(completed) and score >= 100
        if completed and not success:
            obs += "\nThe task has ended unsuccessfully."
        return StepResult(self._surface_text(obs), bool(completed), max(0, score) / 100.0, accepted, success)


class SciWorldTask(EvalTask):
    name = "sciworld"
    display_name = "SciWorld"
    default_max_steps = 40
    words = WORDS

    def __init__(
        self,
        workdir: str,
        tasks: tuple[str, ...] = DEFAULT_TASKS,
        simplification: str = DEFAULT_SIMPLIFICATION,
        split: str = "test",
    ):
        super().__init__(workdir)
        if split not in ("train", "dev", "test"):
            raise ValueError(f"split must be train, dev or test, got {split!r}")
        self.tasks = tasks
        self.simplification = simplification
        self.split = split
        # The simulator's own step limit must not cut an episode before our max_steps does.
        self._pool = JVMPool(step_limit=10_000)
        self._variations: dict[str, list[int]] = {}

    def _split_variations(self, task_name: str) -> list[int]:
        if task_name not in self._variations:
            sw = self._pool.acquire()
            try:
                known = sw.get_task_names()
                if task_name not in known:
                    raise ValueError(f"unknown ScienceWorld task {task_name!r}; known: {known}")
                sw.load(task_name, 0, self.simplification)
                getter = getattr(sw, f"get_variations_{self.split}")  # train | dev | test, checked at init
                self._variations[task_name] = sorted(int(v) for v in getter())
            finally:
                self._pool.release(sw)
        return self._variations[task_name]

    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        specs = []
        for i in range(n):
            name = self.tasks[i % len(self.tasks)]
            variations = self._split_variations(name)
            specs.append(
                {
                    "task_name": name,
                    "variation": variations[(seed + i // len(self.tasks)) % len(variations)],
                    "simplification": self.simplification,
                }
            )
        return specs

    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> TextEnv:
        return SciWorldEnv(spec, Vocabulary(self.words, perturbation), self._pool, oracle)

    def close(self) -> None:
        self._pool.close()
