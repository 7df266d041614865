"""PDDL planning problems from pddlgym's shipped domains, rendered as text.

State atoms and actions are written in plain English per domain (generic `pred(a, b)` for domains
without a template). Commands are "<action> <arg> <arg>", e.g. "stack a b". Transitions, action
applicability and goal checks are pddlgym's own. Oracle: breadth-first search over the ground
actions (`pddl_plan.py`). Progress: best-so-far fraction of goal atoms satisfied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
from collections.abc import Iterator
from typing import Any

from agentrefine_jax.eval.envs.base import INVALID_ACTION, EvalTask, StepResult, TextEnv, rejected
from agentrefine_jax.eval.envs.pddl_plan import bfs_plan, conjuncts, goal_atoms
from agentrefine_jax.eval.perturb import ActionWord, Vocabulary, action_words

NOT_APPLICABLE = 'The action "{action}" cannot be applied in the current state (its conditions do not hold).'


@dataclasses.dataclass(frozen=True)
class DomainText:
    description: str
    words: tuple[ActionWord, ...]
    # Predicate name -> template over positional args, e.g. "{0} is on top of {1}".
    atoms: dict[str, str]
    # pddlgym builds the action space from operators (True) or from action predicates (False).
    operators_as_actions: bool


DOMAINS: dict[str, DomainText] = {
    "blocks": DomainText(
        "You control a robot hand that rearranges blocks on a table. The hand holds at most one block; "
        "only a block with nothing on top of it (a clear block) can be picked up or stacked upon.",
        action_words(
            """
            pickup | {verb} X | pick up the clear block X from the table (your hand must be empty)
              || lift | lift block X off the table when X is clear and the hand is empty
              || raise | raise the clear block X from the table into the empty hand
              || grasp | grasp block X lying clear on the table with the empty hand
            putdown | {verb} X | put the block X you are holding down on the table
              || lower | lower the held block X onto the table
              || set down | set the block X in your hand down on the table
              || release | release the held block X onto the table
            stack | {verb} X Y | put the block X you are holding on top of the clear block Y
              || place | place the held block X onto the clear block Y
              || pile | pile the block X from your hand on the clear block Y
              || put on | put the held block X on the clear block Y
            unstack | {verb} X | take the clear block X off the block it is on (hand must be empty)
              || unpile | lift the clear block X from the block under it into the empty hand
              || take off | take the clear block X off its supporting block with the empty hand
              || remove | remove the clear block X from the top of another block
            """
        ),
        {
            "on": "{0} is on top of {1}",
            "ontable": "{0} is on the table",
            "clear": "{0} is clear",
            "handempty": "the hand is empty",
            "handfull": "the hand is full",
            "holding": "the hand is holding {0}",
        },
        operators_as_actions=False,
    ),
    "gripper": DomainText(
        "A robot with grippers carries balls between rooms. Each gripper holds at most one ball; the robot "
        "can pick up or drop a ball only in the room where it is.",
        action_words(
            """
            move | {verb} FROM TO | the robot moves from room FROM to room TO
              || go | the robot goes from room FROM to room TO
              || travel | the robot travels from room FROM into room TO
              || walk | the robot walks from room FROM over to room TO
            pick | {verb} BALL ROOM GRIPPER | pick up BALL in ROOM with the free GRIPPER
              || grab | grab BALL lying in ROOM using the free GRIPPER
              || grasp | grasp BALL in ROOM with the empty GRIPPER
              || take | take BALL from ROOM into the free GRIPPER
            drop | {verb} BALL ROOM GRIPPER | drop BALL held by GRIPPER in ROOM
              || release | release BALL from GRIPPER into ROOM || put | put BALL held in GRIPPER down in ROOM
              || leave | leave BALL carried by GRIPPER in ROOM
            """
        ),
        {
            "at-robby": "the robot is in {0}",
            "at": "{0} is in {1}",
            "free": "{0} is free",
            "carry": "{1} is carrying {0}",
            "room": "{0} is a room",
            "ball": "{0} is a ball",
            "gripper": "{0} is a gripper",
        },
        operators_as_actions=True,
    ),
    "elevator": DomainText(
        "You operate a lift serving passengers between floors. A passenger boards at their origin floor "
        "and must depart at their destination floor to be served.",
        action_words(
            """
            up | {verb} F | move the lift up to floor F
              || ascend | make the lift ascend to floor F || go up to | take the lift up to floor F
              || rise to | let the lift rise to floor F
            down | {verb} F | move the lift down to floor F
              || descend | make the lift descend to floor F || go down to | take the lift down to floor F
              || sink to | let the lift sink to floor F
            board | {verb} F P | passenger P boards the lift at floor F (their origin)
              || embark | passenger P embarks at floor F, where they start
              || let in | let passenger P into the lift at their origin floor F
              || pick up passenger | pick up passenger P at floor F, their origin
            depart | {verb} F P | passenger P leaves the lift at floor F (their destination)
              || disembark | passenger P disembarks at floor F, their destination
              || let out | let passenger P out of the lift at destination floor F
              || drop off passenger | drop off passenger P at floor F, where they want to go
            """
        ),
        {
            "above": "{1} is above {0}",
            "lift-at": "the lift is at {0}",
            "origin": "{0} starts at {1}",
            "destin": "{0} wants to go to {1}",
            "boarded": "{0} is in the lift",
            "not-boarded": "{0} has not boarded",
            "served": "{0} has been served",
            "not-served": "{0} has not been served",
        },
        operators_as_actions=False,
    ),
    "hanoi": DomainText(
        "Towers of Hanoi: move discs between pegs. Only a clear disc (nothing on it) can move, and only "
        "onto a clear peg or a clear larger disc.",
        action_words(
            """
            move | {verb} DISC TO | move the clear DISC onto TO (a clear peg or clear larger disc)
              || shift | shift the clear DISC onto TO, a clear peg or a clear bigger disc
              || transfer | transfer the clear DISC to TO (clear peg, or clear disc larger than it)
              || relocate | relocate the clear DISC on top of TO (a clear peg or larger clear disc)
            """
        ),
        {
            "on": "{0} is on {1}",
            "clear": "{0} is clear",
            "smaller": "{1} is smaller than {0}",
        },
        operators_as_actions=False,
    ),
}

# (domain, problem path relative to pddlgym/pddl): problems whose BFS plans are <= 23 steps.
DEFAULT_PROBLEMS: dict[str, tuple[str, ...]] = {
    "blocks": tuple(f"blocks/problem{i}.pddl" for i in (1, 3, 5, 7, 9))
    + tuple(f"blocks_test/problem{i}.pddl" for i in (2, 4, 6, 8, 10)),
    "gripper": ("gripper/prob01.pddl", "gripper/prob03.pddl", "gripper_test/prob02.pddl")
    + tuple(f"tinyonearmedgripper/prob0{i}.pddl" for i in range(4))
    + tuple(f"tinyonearmedgripper_test/prob0{i}.pddl" for i in range(4)),
    "elevator": tuple(f"elevator/problem{i}.pddl" for i in range(1, 5)),
    "hanoi": tuple(f"hanoi/problem{i}.pddl" for i in range(4)),
}
# Training problems (the on-policy collector's): pddlgym's shipped problems of these domains that no eval
# list names and whose breadth-first plan is found in seconds (blocks has none: all ten are eval problems).
TRAINING_PROBLEMS: dict[str, tuple[str, ...]] = {
    "elevator": ("elevator/problem5.pddl",),
    "gripper": ("gripper_test/prob04.pddl",),
    "hanoi": ("hanoi_test/test_problem5.pddl", "hanoi_test/test_problem4.pddl"),
}
_DOMAIN_FILE_FOR_DIR = {
    "tinyonearmedgripper": "tinyonearmedgripper",
    "tinyonearmedgripper_test": "tinyonearmedgripper",
}


_DEFAULT_SCRATCH = "/dev/shm"  # pddlgym.spaces.TMP_PDDL_DIR's own default


@contextlib.contextmanager
def quiet_pddlgym() -> Iterator[None]:
    """pddlgym's own prints kept off the terminal (`eval -q` prints none of them; startup.py quiets other
    libraries the same way): gym's deprecation banner on import, its parser's `Warning: type not declared`
    (stdout) and Fast Downward's translator's `Warning: name clash between type and predicate 'room'`
    (stderr, the first grounding of tinyonearmedgripper). Every call into pddlgym goes through it. Python
    exceptions still propagate: they are the caller's to report."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def load_pddlgym() -> Any:
    """pddlgym with its `core` and `spaces` (both sources), imported quietly (`quiet_pddlgym`)."""
    with quiet_pddlgym():
        import pddlgym
        import pddlgym.core
        import pddlgym.spaces
    return pddlgym


def _scratch_exists(pddlgym: Any) -> None:
    """pddlgym's grounding scratch dir is a process global: a built-in run points it into its own
    work dir, which that run deletes at its end; a later run in the same process (e.g. AgentBoard's
    source) then falls back to pddlgym's default rather than to a directory that is gone."""
    if not os.path.isdir(pddlgym.spaces.TMP_PDDL_DIR):
        pddlgym.spaces.TMP_PDDL_DIR = _DEFAULT_SCRATCH


def open_problem(domain: str, folder: str, index: int, operators_as_actions: bool = True) -> Any:
    """pddlgym's environment for problem `index` of `folder` (pddlgym's string-sorted order); both sources."""
    _scratch_exists(load_pddlgym())
    with quiet_pddlgym():  # parsing the domain and every problem of the folder
        env = load_pddlgym().core.PDDLEnv(
            domain, folder, operators_as_actions=operators_as_actions, dynamic_action_space=True
        )
        env.fix_problem_index(index)
    return env


def ground_literals(env: Any, state: Any) -> list[Any]:
    """The ground actions applicable in `state`, sorted (pddlgym's own order follows the string-hash seed)."""
    # pddlgym's grounding (Fast Downward's translator) prints parser warnings to stdout and stderr.
    _scratch_exists(load_pddlgym())
    with quiet_pddlgym():
        return sorted(env.action_space.all_ground_literals(state), key=str)


def _atom_text(lit: Any, atoms: dict[str, str]) -> str:
    args = [v.name for v in lit.variables]
    template = atoms.get(lit.predicate.name)
    if template is None:
        return f"{lit.predicate.name}({', '.join(args)})"
    return template.format(*args)


class PDDLEnv(TextEnv):
    task = "pddl"
    intro = ""

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary, workdir: str):
        super().__init__(spec, vocab)
        pddlgym = load_pddlgym()
        # pddlgym writes grounding scratch files to /dev/shm and never deletes them; keep them ours.
        pddlgym.spaces.TMP_PDDL_DIR = workdir
        self.text = DOMAINS[spec["domain"]]
        base = os.path.join(os.path.dirname(pddlgym.__file__), "pddl")
        problem_dir, problem_file = os.path.split(spec["problem"])
        domain = os.path.join(base, f"{_DOMAIN_FILE_FOR_DIR.get(problem_dir, spec['domain'])}.pddl")
        self._env = open_problem(domain, os.path.join(base, problem_dir), 0, self.text.operators_as_actions)
        names = [os.path.basename(p.problem_fname) for p in self._env.problems]
        if problem_file not in names:
            raise FileNotFoundError(f"pddlgym has no problem {spec['problem']!r} (found {names})")
        with quiet_pddlgym():
            self._env.fix_problem_index(names.index(problem_file))
        self._plan: list[Any] = []

    @property
    def instruction(self) -> str:
        return (
            f"{self.text.description}\nWrite each action as its name followed by its arguments separated by "
            f'spaces, e.g. "{self._example()}".\n\nAvailable actions:\n{self.vocab.describe()}'
        )

    def _example(self) -> str:
        w = self.text.words[0]
        n_args = len(w.usage.split()) - 1
        return " ".join([self.vocab.surface(w.canonical)] + ["a", "b", "c"][:n_args])

    def _reset(self) -> tuple[str, str]:
        with quiet_pddlgym():  # a dynamic action space grounds the initial state
            state, _ = self._env.reset()
        self._goal_pos, self._goal_neg = goal_atoms(state.goal)
        self._plan = []
        goal = (
            "reach a state where "
            + "; ".join(_atom_text(lit, self.text.atoms) for lit in sorted(conjuncts(state.goal), key=str))
            + "."
        )
        return goal, self._render(state)

    def _render(self, state: Any) -> str:
        facts = sorted(_atom_text(lit, self.text.atoms) for lit in state.literals)
        return "The current state is: " + "; ".join(facts) + "."

    def _progress(self, state: Any) -> float:
        atoms = {str(lit) for lit in state.literals}
        total = len(self._goal_pos) + len(self._goal_neg)
        if total == 0:
            return 1.0
        hit = len(self._goal_pos & atoms) + len(self._goal_neg - atoms)
        return hit / total

    def _initial_progress(self) -> float:
        return self._progress(self._env.get_state())

    def _valid_literals(self) -> list[Any]:
        return ground_literals(self._env, self._env.get_state())

    def _valid_canonical(self) -> list[str]:
        return [_command(lit) for lit in self._valid_literals()]

    def _oracle_canonical(self) -> str:
        state = self._env.get_state()
        if not self._plan or self._plan[0] not in set(self._valid_literals()):
            plan = bfs_plan(self._env, state)
            if plan is None:
                raise RuntimeError(f"BFS found no plan for {self.spec['problem']}")
            self._plan = plan
        return _command(self._plan[0])

    def _step(self, canonical: str) -> StepResult:
        tokens = re.sub(r"[(),]", " ", canonical.lower()).split()
        valid = {tuple(_command(lit).split()): lit for lit in self._valid_literals()}
        lit = valid.get(tuple(tokens))
        if lit is None:
            surface = self.vocab.to_surface(" ".join(tokens)) if tokens else canonical
            if tokens and tokens[0] in {w.canonical for w in self.text.words}:
                return rejected(NOT_APPLICABLE.format(action=surface))
            return rejected(INVALID_ACTION.format(action=surface))
        if self._plan and self._plan[0] == lit:
            self._plan.pop(0)
        else:
            self._plan = []
        with quiet_pddlgym():
            state, _, done, _, _ = self._env.step(lit)
        obs = f'You executed "{self.vocab.to_surface(_command(lit))}". {self._render(state)}'
        if done:
            obs += " The goal is reached."
        return StepResult(obs, bool(done), self._progress(state), success=bool(done))


def _command(lit: Any) -> str:
    return " ".join([lit.predicate.name] + [v.name for v in lit.variables])


class PDDLTask(EvalTask):
    name = "pddl"
    display_name = "PDDL"
    default_max_steps = 40
    words = DOMAINS["blocks"].words

    def __init__(self, workdir: str, problems: dict[str, tuple[str, ...]] | None = None):
        super().__init__(workdir)
        self.problems = dict(problems or DEFAULT_PROBLEMS)
        unknown = set(self.problems) - set(DOMAINS)
        if unknown:
            raise ValueError(
                f"no text rendering for PDDL domains {sorted(unknown)}; known: {sorted(DOMAINS)}"
            )
        self._scratch = os.path.join(workdir, "pddlgym")

    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        domains = sorted(self.problems)
        specs = []
        for i in range(n):
            d = domains[i % len(domains)]
            probs = self.problems[d]
            specs.append({"domain": d, "problem": probs[(seed + i // len(domains)) % len(probs)]})
        return specs

    has_training_split = True

    def training_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        """The training problems in turn (domain by domain, as `episode_specs`), starting at `seed`; never
        a problem this task's eval list (or the default one) holds."""
        pool = [(d, p) for d in sorted(TRAINING_PROBLEMS) for p in TRAINING_PROBLEMS[d]]
        pool = [(d, p) for d, p in pool if not self.is_eval_spec({"domain": d, "problem": p})]
        if not pool:
            raise ValueError("pddl: every training problem is in this task's eval list")
        return [{"domain": d, "problem": p} for d, p in (pool[(seed + i) % len(pool)] for i in range(n))]

    def is_eval_spec(self, spec: dict[str, Any]) -> bool:
        lists = (*self.problems.values(), *DEFAULT_PROBLEMS.values())
        return any(spec["problem"] in problems for problems in lists)

    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> TextEnv:
        os.makedirs(self._scratch, exist_ok=True)
        return PDDLEnv(spec, Vocabulary(DOMAINS[spec["domain"]].words, perturbation), self._scratch)
