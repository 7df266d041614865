"""AgentBoard's PDDL task (gripper, blockworld, barman, tyreworld; 20/10/20/10 problems) on a user's checkout.

Facts implemented (fact sheet section 5): the checkout's domain and problem files are loaded with pddlgym
(operators as actions, dynamic action space); problems are the string-sorted `*.pddl` of each game's folder
(blockworld's index 1 is problem10); difficulty comes from `data/pddl/test.jsonl` in order. Literals are
rendered with the checkout's `predicate_map` (read with `ast`; unmapped: `name arg1 arg2`). Goal = the sorted
goal texts; state = capitalized literal texts, sorted; for barman and tyreworld after a step only the new
literals. Actions are parsed AgentBoard's way (lowercase, word tokens; the first token naming a currently
valid operator, then the tokens naming objects, in order, cut to its arity). Progress = satisfied goal atoms /
goal atoms, best so far, moving only on state-changing actions. Success = the goal holds.

Where AgentBoard's text follows Python set order (the valid-action listing, `look around`), we sort: set order
of pddlgym literals depends on the process's string-hash seed, so AgentBoard's own order is not reproducible.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

from agentrefine_jax.eval.agentboard.checkout import CLONE, Checkout, CheckoutError
from agentrefine_jax.eval.agentboard.tasks.base import HELP, AgentBoardTask, EpisodeSpec
from agentrefine_jax.eval.core import StepResult
from agentrefine_jax.eval.envs.pddl import ground_literals, open_problem, quiet_pddlgym
from agentrefine_jax.eval.policies import Replay

PDDL_DIR = "agentboard/environment/pddl_env/pddlgym/pddl"
ENV_FILE = "agentboard/environment/pddl_env/pddl_env.py"
TASK_FILE = "agentboard/tasks/pddl.py"
LABELS = "data/pddl/test.jsonl"
PROMPT_FILE = "agentboard/prompts/VanillaAgent/pddl_vanilla_prompt.json"
# AgentBoard's published defaults (CFG env.pddl and T/pddl.py `Num_Problems`), used when the checkout lacks
# those files and no model is evaluated (a policy run needs only the PDDL files).
DEFAULT_GAMES = ("gripper", "blockworld", "barman", "tyreworld")
DEFAULT_NUM_PROBLEMS = {"barman": 20, "blockworld": 10, "gripper": 20, "tyreworld": 10}
DEFAULT_PER_TASK = 20
LOOK = "look around"
DIFF_GAMES = ("barman", "tyreworld")  # games whose step observation lists only the new literals
NOT_VALID = "The action is not valid and therefore takes no effect."
GOAL_SATISFIED = " The goal is satisfied."
PLANNER_TIMEOUT_S = 300


@dataclasses.dataclass
class PddlTexts:
    """The checkout's rendering table and the two invalid-action hints (pddl_env.py), or fallbacks."""

    predicate_map: dict[str, str]
    unparsable: str  # reply when no valid operator/objects are found
    no_effect: str  # reply when pddlgym leaves the state unchanged


def _hint_sentences(path: pathlib.Path) -> tuple[str, str] | None:
    """The two `The action is not valid ...` sentences of pddl_env.py's step (read with `ast`)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(NOT_VALID)
        ):
            found.append(node.value)
    # The no-effect reply is the longer one that reminds of the actions' restrictions.
    no_effect = [s for s in found if "restriction" in s]
    other = [s for s in found if "restriction" not in s]
    if not no_effect or not other:
        return None
    return other[0], no_effect[0]


class PddlTask(AgentBoardTask):
    name = "pddl"
    prompt_file = PROMPT_FILE
    check_inventory = False

    def __init__(self, strict: bool = True):
        super().__init__(strict)
        self._texts: PddlTexts | None = None

    # ------------------------------------------------------------------ checkout

    def texts(self, checkout: Checkout) -> PddlTexts:
        if self._texts is None:
            if checkout.exists(ENV_FILE):
                pmap = checkout.literal(ENV_FILE, "predicate_map")
                if not isinstance(pmap, dict) or not all(isinstance(v, str) for v in pmap.values()):
                    raise CheckoutError(f"{checkout.root / ENV_FILE}: predicate_map is not a dict of strings")
                hints = _hint_sentences(checkout.root / ENV_FILE)
                if hints is None:
                    raise CheckoutError(f"{checkout.root / ENV_FILE}: invalid-action replies not found")
                self._texts = PddlTexts(dict(pmap), *hints)
            else:
                self.note_missing(
                    checkout, ENV_FILE, "literals rendered as `name arg1 arg2`, no hint sentences"
                )
                self._texts = PddlTexts({}, NOT_VALID, NOT_VALID)
        return self._texts

    def _games(self, checkout: Checkout) -> tuple[list[str], int]:
        if checkout.has_config():
            cfg = checkout.env_config("pddl")
            games = cfg.get("game_name") or list(DEFAULT_GAMES)
            per_task = int(cfg.get("env_num_per_task", DEFAULT_PER_TASK))
            self.check_actions = cfg.get("check_actions")
            return [str(g) for g in games], per_task
        self.note_missing(
            checkout, "eval_configs/main_results_all_tasks.yaml", "games and counts from defaults"
        )
        return list(DEFAULT_GAMES), DEFAULT_PER_TASK

    def episodes(self, checkout: Checkout) -> list[EpisodeSpec]:
        games, per_task = self._games(checkout)
        if checkout.exists(TASK_FILE):
            num_problems = checkout.literal(TASK_FILE, "Num_Problems")
        else:
            self.note_missing(checkout, TASK_FILE, "Num_Problems = 20/10/20/10")
            num_problems = DEFAULT_NUM_PROBLEMS
        difficulties: list[str] | None = None
        if checkout.exists(LABELS):
            difficulties = [str(row.get("difficulty", "")) for row in checkout.read_jsonl(LABELS)]
        else:
            self.note_missing(checkout, LABELS, "difficulty unknown, no easy/hard split")
        specs: list[EpisodeSpec] = []
        for game in games:
            if game not in num_problems:
                raise CheckoutError(f"{checkout.root / TASK_FILE}: no Num_Problems entry for game {game!r}")
            domain = checkout.path(f"{PDDL_DIR}/{game}.pddl", CLONE)
            folder = checkout.path(f"{PDDL_DIR}/{game}", CLONE)
            problems = sorted(str(p) for p in folder.glob("*.pddl"))  # pddlgym's string sort
            count = min(per_task, int(num_problems[game]))
            if len(problems) < count:
                raise CheckoutError(
                    f"{folder}: {len(problems)} problems, AgentBoard runs {count}: provided by {CLONE}"
                )
            for i in range(count):
                k = len(specs)
                if difficulties is not None and k >= len(difficulties):
                    raise CheckoutError(
                        f"{checkout.root / LABELS}: {len(difficulties)} lines, episode {k} has none"
                    )
                specs.append(
                    EpisodeSpec(
                        task="pddl",
                        index=k,
                        id=f"{game}/{os.path.basename(problems[i])}",
                        difficulty=difficulties[k] if difficulties is not None else "unknown",
                        info={
                            "game": game,
                            "problem_index": i,
                            "domain": str(domain),
                            "problem": problems[i],
                        },
                    )
                )
        return specs

    def examples_key(self, episode: EpisodeSpec) -> str | None:
        return episode.info["game"]

    def make_env(self, checkout: Checkout, episode: EpisodeSpec) -> PddlEnv:
        return PddlEnv(episode, self.texts(checkout))

    def oracle(self, env: PddlEnv) -> Replay:
        """Follows a Fast Downward plan for the episode's problem, written as `operator obj1 obj2 ...`."""
        return Replay(plan(env.episode.info["domain"], env.episode.info["problem"]))


# ----------------------------------------------------------------------------------------- environment


def _word_tokens(text: str) -> list[str]:
    """nltk's word_tokenize (sentences by an untrained Punkt, then NLTK's Treebank-style word tokenizer).

    AgentBoard calls `nltk.word_tokenize`, whose English Punkt model is a download; the untrained Punkt splits
    the short action texts the same way (it differs only on abbreviations).
    """
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    words = NLTKWordTokenizer()
    return [w for sentence in PunktSentenceTokenizer().tokenize(text) for w in words.tokenize(sentence)]


def _unparsable(domain: str, folder: str, error: Exception) -> str:
    """One line naming the file pddlgym could not parse (its own exceptions name none)."""
    from pddlgym.parser import PDDLDomainParser, PDDLProblemParser

    culprit = f"{domain} or a problem in {folder}"
    with quiet_pddlgym():
        try:
            culprit = domain
            d = PDDLDomainParser(domain, expect_action_preds=False, operators_as_actions=True)
            for problem in sorted(str(p) for p in pathlib.Path(folder).glob("*.pddl")):
                culprit = problem
                PDDLProblemParser(problem, d.domain_name, d.types, d.predicates, d.actions, d.constants)
        except Exception:  # noqa: BLE001 - this is the file that fails
            pass
    return f"{culprit}: malformed PDDL, pddlgym cannot parse it ({type(error).__name__}: {error})"


class PddlEnv:
    """One PDDL problem under AgentBoard's rules (see the module docstring)."""

    def __init__(self, episode: EpisodeSpec, texts: PddlTexts):
        self.episode = episode
        self.game = episode.info["game"]
        self.texts = texts
        folder = os.path.dirname(episode.info["problem"])
        try:
            self._env = open_problem(episode.info["domain"], folder, episode.info["problem_index"])
        except Exception as e:  # noqa: BLE001 - pddlgym's parser reports bad files as Index/Attribute/AssertionError
            raise CheckoutError(_unparsable(episode.info["domain"], folder, e)) from None
        self.goal = ""
        self.success = False
        self.progress = 0.0
        self._state: Any = None
        self._goal_literals: list[Any] = []

    # ------------------------------------------------------------------ rendering

    def literal_text(self, literal: Any) -> str:
        names = [str(v.name) for v in literal.variables]
        template = self.texts.predicate_map.get(literal.predicate.name)
        if template is not None:
            return template.format(*names)
        return literal.predicate.name + " " + " ".join(names)

    def _state_text(self, literals: Any, previous: Any = None) -> str:
        if previous is not None and self.game in DIFF_GAMES:
            literals = [lit for lit in literals if lit not in previous]
        return " ".join(sorted(self.literal_text(lit).capitalize() for lit in literals))

    # ------------------------------------------------------------------ Env

    def reset(self) -> str:
        with quiet_pddlgym():
            obs, _ = self._env.reset()
        self._state = obs
        self._goal_literals = list(obs.goal.literals)
        goals = sorted(self.literal_text(lit) for lit in self._goal_literals)
        self.goal = "The goal is to satisfy the following conditions: " + ", ".join(goals)
        self.success = False
        self.progress = 0.0
        return self._state_text(obs.literals)

    def _valid_literals(self) -> list[Any]:
        return ground_literals(self._env, self._state)

    def valid_actions(self) -> list[str]:
        extra = [HELP, LOOK] if self.game in DIFF_GAMES else [HELP]
        return sorted(self.literal_text(lit) for lit in self._valid_literals()) + extra

    def _satisfied(self, literals: Any) -> float:
        return sum(lit in literals for lit in self._goal_literals) / len(self._goal_literals)

    def parse(self, action: str) -> Any | None:
        """AgentBoard's text -> operator literal, or None when no operator and enough objects are named."""
        from pddlgym.structs import Literal

        tokens = _word_tokens(action.lower())
        valid = self._valid_literals()
        operators = {lit.predicate.name.lower(): lit.predicate for lit in valid}
        name = next((t for t in tokens if t in operators), None)
        if name is None:
            return None
        predicate = operators[name]
        if predicate.arity == 0:
            return Literal(predicate, [])
        objects = {obj.name: obj for obj in self._state.objects}
        typed = {str(obj): str(obj) for obj in self._state.objects}
        picked = [objects[t] if t in objects else typed[t] for t in tokens if t in objects or t in typed]
        if len(picked) < predicate.arity:
            return None
        return Literal(predicate, picked[: predicate.arity])

    def step(self, action: str) -> StepResult:
        low = action.lower()
        if "check" in low:
            return self._reply("Valid actions are: " + ", ".join(self.valid_actions()), True)
        if LOOK in low:
            return self._reply(
                " ".join(sorted(self.literal_text(x).capitalize() for x in self._state.literals)), True
            )
        literal = self.parse(action)
        if literal is None:
            return self._reply(self.texts.unparsable, False)
        with quiet_pddlgym():
            new_state = self._env.step(literal)[0]
        if new_state == self._state:  # pddlgym ignores an inapplicable action silently
            return self._reply(self.texts.no_effect, False)
        previous, self._state = self._state, new_state
        self.progress = max(self.progress, self._satisfied(new_state.literals))
        text = self._state_text(new_state.literals, previous.literals)
        self.success = all(lit in new_state.literals for lit in self._goal_literals)
        if self.success:
            text += GOAL_SATISFIED
        return StepResult(text, self.success, self.progress, True)

    def _reply(self, text: str, valid: bool) -> StepResult:
        return StepResult(text, False, self.progress, valid)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------- oracle


def fast_downward_bin() -> pathlib.Path:
    """up-fast-downward's build folder: the `downward` search binary and its own translator package."""
    spec = importlib.util.find_spec("up_fast_downward")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the PDDL oracle needs Fast Downward: pip install --no-deps up-fast-downward==1.0.0"
        )
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    bin_dir = root / "downward" / "builds" / "release" / "bin"
    if not (bin_dir / "downward").is_file() or not (bin_dir / "fast_downward" / "translate").is_dir():
        raise ImportError(f"up-fast-downward is installed but {bin_dir} lacks `downward` or its translator")
    return bin_dir


_PLAN_LINE = re.compile(r"^\((.+)\)$")
# Greedy best-first search with h^FF and preferred operators: satisficing, seconds on each AgentBoard problem.
SEARCH = "lazy_greedy([ff()], preferred=[ff()])"


_CONSTANTS = re.compile(r"\(:constants([^()]*)\)\s*", re.IGNORECASE)
_OBJECTS = re.compile(r"\(:objects([^()]*)\)", re.IGNORECASE)


def _names(typed_list: str) -> list[str]:
    tokens = typed_list.split()
    return [t for i, t in enumerate(tokens) if t != "-" and (i == 0 or tokens[i - 1] != "-")]


def fd_compatible(domain_text: str, problem_text: str) -> tuple[str, str]:
    """Rewrite what pddlgym accepts but Fast Downward's stricter parser does not (tyreworld): a
    `:constants` block after `:predicates` moves before it; problem objects repeating a constant go."""
    m = _CONSTANTS.search(domain_text)
    if m is None:
        return domain_text, problem_text
    constants = set(_names(m.group(1)))
    domain_text = domain_text[: m.start()] + domain_text[m.end() :]
    at = domain_text.lower().find("(:predicates")
    domain_text = domain_text[:at] + m.group(0).strip() + "\n" + domain_text[at:]

    def drop_constants(obj: re.Match) -> str:
        tokens, kept, names = obj.group(1).split(), [], []
        i = 0
        while i < len(tokens):
            if tokens[i] == "-" and i + 1 < len(tokens):
                if names:
                    kept.append(" ".join(names) + " - " + tokens[i + 1])
                names, i = [], i + 2
                continue
            if tokens[i] not in constants:
                names.append(tokens[i])
            i += 1
        if names:
            kept.append(" ".join(names))
        return "(:objects " + "\n".join(kept) + ")"

    return domain_text, _OBJECTS.sub(drop_constants, problem_text, count=1)


def plan(domain: str, problem: str, timeout_s: float = PLANNER_TIMEOUT_S) -> list[str]:
    """A satisficing plan by Fast Downward as `op arg1 arg2` lines.

    up-fast-downward ships its translator as `fast_downward.translate` inside its build folder, a name that
    textworld's `fast_downward_textworld` also installs at top level; so the translator runs from a scratch
    package that points at up-fast-downward's copy, and the search binary is called directly.
    """
    bin_dir = fast_downward_bin()
    with tempfile.TemporaryDirectory(prefix="agentboard-fd-") as tmp:
        pkg = os.path.join(tmp, "fast_downward")
        os.mkdir(pkg)
        pathlib.Path(pkg, "__init__.py").write_text("")
        os.symlink(bin_dir / "fast_downward" / "translate", os.path.join(pkg, "translate"))
        sas, plan_file = os.path.join(tmp, "output.sas"), os.path.join(tmp, "plan")
        texts = fd_compatible(pathlib.Path(domain).read_text(), pathlib.Path(problem).read_text())
        domain, problem = os.path.join(tmp, "domain.pddl"), os.path.join(tmp, "problem.pddl")
        pathlib.Path(domain).write_text(texts[0])
        pathlib.Path(problem).write_text(texts[1])
        env = dict(os.environ, PYTHONPATH=tmp)
        translate = [sys.executable, "-m", "fast_downward.translate", domain, problem, "--sas-file", sas]
        search = [str(bin_dir / "downward"), "--search", SEARCH, "--internal-plan-file", plan_file]
        try:
            done = subprocess.run(
                translate, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout_s
            )
            if done.returncode == 0:
                with open(sas) as stdin:
                    done = subprocess.run(
                        search, cwd=tmp, stdin=stdin, capture_output=True, text=True, timeout=timeout_s
                    )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"Fast Downward found no plan for {problem} within {timeout_s:.0f} s"
            ) from None
        if done.returncode != 0 or not os.path.exists(plan_file):
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"Fast Downward failed on {problem} (exit {done.returncode}): {tail[0]}")
        steps = []
        for line in pathlib.Path(plan_file).read_text().splitlines():
            m = _PLAN_LINE.match(line.strip())
            if m:  # the last line is a `; cost = ...` comment
                steps.append(m.group(1).strip().lower())
        return steps
