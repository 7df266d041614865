"""Reworded actions, the paper's robustness study (Table 3), for both episode sources.

Built-in tasks: every environment declares its actions as `ActionWord`s: a canonical verb phrase the simulator
understands, a usage pattern and a description, plus reworded variants. A `Vocabulary` picks one
variant per word; the agent only ever sees the surface wording, and its commands are mapped back to
the canonical phrase before they reach the simulator. Under a perturbation the canonical wording
of a renamed action is rejected, so a model that ignores the stated action names is caught.

AgentBoard's ALFWorld: reworded candidate actions.

Each rewording changes how some ALFWorld commands are written -- other tokens or another token order, the
same meaning -- everywhere the agent sees commands: the action list of the instruction (its quoted
templates), the `Action:` lines of the in-context example, and the `check valid actions` listing. The
agent's command is mapped back to the game's own wording before it reaches TextWorld, by looking it up among
the reworded forms of the commands admissible now; a command still in the original wording of a reworded
action is not accepted (the game answers `Nothing happens.`), so a model that ignores the stated actions is
caught. Observations, goals and progress (computed on the game's side) are untouched.

The five variants (rules on whole commands; `{o}`/`{r}` are the object and receptacle):
  1 go-to-move:   `go to {r}` -> `move to {r}`
  2 take-pickup:  `take {o} from {r}` -> `pick up {o} from {r}`
  3 put-place:    `put {o} in/on {r}` -> `place {o} in/on {r}`
  4 use-to:       `clean|heat|cool {o} with|using {r}` -> `use {r} to clean|heat|cool {o}` (token order)
  5 all:          rules 1-4 together
Report: the original run beside the five, their mean and population standard deviation (`summary`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from agentrefine_jax.eval.core import StepResult, variant_name
from agentrefine_jax.layout import CHECK_VALID_ACTIONS as HELP

ORIGINAL = 0


class Wording(Protocol):
    """How one perturbation variant writes commands, under either source: `to_surface` rewrites the
    simulator's command into what the agent sees; `to_canonical` maps the agent's command back (looked up
    among `candidates`, the commands admissible now, where the wording needs them), None for a command
    still in the original wording of a renamed action. `Vocabulary` (built-in tasks, phrase by phrase) and
    `Rewording` (AgentBoard's ALFWorld, whole commands) are the two kinds."""

    name: str

    def to_surface(self, command: str) -> str: ...

    def to_canonical(self, command: str, candidates: Iterable[str] = ()) -> str | None: ...


@dataclasses.dataclass(frozen=True)
class ActionWord:
    canonical: str
    # Usage pattern with a `{verb}` slot, e.g. "{verb} OBJ to OBJ".
    usage: str
    description: str
    # (surface verb phrase, description) for perturbation 1, 2, ...
    variants: tuple[tuple[str, str], ...] = ()


def action_words(table: str) -> tuple[ActionWord, ...]:
    """Words from a table: a line `canonical | usage | description`, then `|| surface | description` for each
    reworded variant (perturbation 1, 2, ...); an indented line continues the line above."""
    text = re.sub(r"\n[ \t]+", " ", textwrap.dedent(table).strip())
    words = []
    for line in text.splitlines():
        (canonical, usage, description), *variants = (part.split(" | ") for part in line.split(" || "))
        words.append(ActionWord(canonical, usage, description, tuple((s, d) for s, d in variants)))
    return tuple(words)


class Vocabulary:
    """Maps commands between the surface wording shown to the agent and the canonical one."""

    def __init__(self, words: Sequence[ActionWord], perturbation: int = ORIGINAL):
        if perturbation < 0:
            raise ValueError(f"perturbation must be >= 0, got {perturbation}")
        self.words = tuple(words)
        self.perturbation = perturbation
        self._surface: dict[str, str] = {}  # canonical -> surface
        self._desc: dict[str, str] = {}
        for w in self.words:
            if perturbation == ORIGINAL or not w.variants:
                surface, desc = w.canonical, w.description
            else:
                surface, desc = w.variants[(perturbation - 1) % len(w.variants)]
            self._surface[w.canonical] = surface.lower()
            self._desc[w.canonical] = desc
        surfaces = list(self._surface.values())
        if len(set(surfaces)) != len(surfaces):
            raise ValueError(f"perturbation {perturbation}: two actions share a surface name: {surfaces}")
        canon = set(self._surface)
        for c, s in self._surface.items():
            if s != c and s in canon:
                raise ValueError(f"perturbation {perturbation}: {s!r} renames {c!r} but is itself an action")
        # Longest phrases first so "look at" wins over "look".
        self._by_surface = sorted(((s, c) for c, s in self._surface.items()), key=lambda t: -len(t[0]))
        self._renamed = sorted((c for c, s in self._surface.items() if s != c), key=len, reverse=True)

    @property
    def name(self) -> str:
        return variant_name(self.perturbation)

    @staticmethod
    def num_variants(words: Sequence[ActionWord]) -> int:
        return max((len(w.variants) for w in words), default=0)

    def to_surface(self, command: str) -> str:
        """Rewrite a canonical command (e.g. from an oracle) into the wording the agent sees."""
        low = command.strip()
        for c in sorted(self._surface, key=len, reverse=True):
            if _starts_with_phrase(low.lower(), c):
                return self._surface[c] + low[len(c) :]
        return low

    def to_canonical(self, command: str, candidates: Iterable[str] = ()) -> str | None:
        """Map an agent command back to the simulator's wording (phrase by phrase: `candidates` unused).

        Returns None when the command uses the canonical name of an action this vocabulary renamed.
        Commands that match no known phrase pass through unchanged: the simulator judges them.
        """
        text = " ".join(command.strip().split())
        low = text.lower()
        for s, c in self._by_surface:
            if _starts_with_phrase(low, s):
                return c + text[len(s) :]
        for c in self._renamed:
            if _starts_with_phrase(low, c):
                return None
        return text

    def surface(self, canonical: str) -> str:
        return self._surface[canonical]

    def describe(self) -> str:
        """One line per action: usage with the surface verb, then its description."""
        return "\n".join(
            f"- {w.usage.format(verb=self._surface[w.canonical])}: {self._desc[w.canonical]}"
            for w in self.words
        )


def _starts_with_phrase(text: str, phrase: str) -> bool:
    return text == phrase or text.startswith(phrase + " ")


# ----------------------------------------------------------------------------------------- ALFWorld


_RULES: dict[str, tuple[str, str]] = {
    "go-to-move": (r"go to (?P<r>.+)", "move to {r}"),
    "take-pickup": (r"take (?P<o>.+?) from (?P<r>.+)", "pick up {o} from {r}"),
    "put-place": (r"put (?P<o>.+?) in/on (?P<r>.+)", "place {o} in/on {r}"),
    "use-to": (r"(?P<v>clean|heat|cool) (?P<o>.+?) (?:with|using) (?P<r>.+)", "use {r} to {v} {o}"),
}


@dataclasses.dataclass(frozen=True)
class Rewording:
    index: int  # 1..5 (0 is the original wording)
    name: str
    rules: tuple[str, ...]  # keys of _RULES

    def to_surface(self, command: str) -> str:
        """The command as the agent sees it under this rewording."""
        for key in self.rules:
            pattern, template = _RULES[key]
            m = re.fullmatch(pattern, command)
            if m:
                return template.format(**m.groupdict())
        return command

    surface = to_surface

    def to_canonical(self, command: str, candidates: Iterable[str] = ()) -> str | None:
        """The game's command whose rewording is `command`, among `candidates` (admissible now); None for a
        command still in the original wording of a reworded action; anything else unchanged (the game
        judges it). A reworded command cannot be mapped back without the candidates: the rules rewrite
        whole commands, not phrases."""
        table = {self.to_surface(c): c for c in candidates}
        if command in table:
            return table[command]
        return None if self.to_surface(command) != command else command


REWORDINGS: tuple[Rewording, ...] = (
    Rewording(1, "go-to-move", ("go-to-move",)),
    Rewording(2, "take-pickup", ("take-pickup",)),
    Rewording(3, "put-place", ("put-place",)),
    Rewording(4, "use-to", ("use-to",)),
    Rewording(5, "all", ("go-to-move", "take-pickup", "put-place", "use-to")),
)


def rewording(index: int) -> Rewording:
    if not 1 <= index <= len(REWORDINGS):
        raise ValueError(f"perturbation must be 1..{len(REWORDINGS)}, got {index}")
    return REWORDINGS[index - 1]


def reword_prompt(rw: Wording, instruction: str, examples: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """The instruction's quoted command templates and the examples' `Action:` lines, reworded."""
    instruction = re.sub(r"'([^'\n]+)'", lambda m: f"'{rw.to_surface(m[1])}'", instruction)
    reworded = tuple(
        re.sub(r"(?m)^(Action: )(.+)$", lambda m: m[1] + rw.to_surface(m[2]), example) for example in examples
    )
    return instruction, reworded


class RewordedEnv:
    """An ALFWorld episode whose commands are shown and accepted in a rewording's wording."""

    def __init__(self, env: Any, rw: Wording):
        self.env, self.rw = env, rw

    def _table(self) -> dict[str, str]:
        return {self.rw.to_surface(c): c for c in self.env.valid_actions()}

    def valid_actions(self) -> list[str]:
        return list(self._table())

    def step(self, action: str) -> StepResult:
        # The game's own reply rewrite (AgentBoard ALFWorld's `parse_action`), asked of the env: perturb sits
        # below the episode sources and never imports one.
        parse = getattr(self.env, "parse_action", None)
        action = parse(action) if parse is not None else action
        table = self._table()
        valid = action in table
        if action == HELP:
            result = self.env.step(HELP)  # progress regexes see the game's own listing
            text = "Choose an action from these valid actions: " + ", ".join(table)
            return StepResult(text, result.done, result.progress, True, action=action)
        command = self.rw.to_canonical(action, table.values())
        if command is None:
            command = action + " [original wording]"  # never admissible: the game says `Nothing happens.`
        result = self.env.step(command)
        return StepResult(result.observation, result.done, result.progress, valid, action=action)

    def __getattr__(
        self, name: str
    ) -> Any:  # goal, success, reset, close, expert plan... of the wrapped episode
        return getattr(self.env, name)


def summary(original: float | None, variants: Sequence[float | None]) -> dict[str, Any]:
    """Table 3's layout: the original score, each variant, their mean and population standard deviation.
    Without variants (or with a variant that has no score) mean and std are null and `missing` says why."""
    out: dict[str, Any] = {"original": original, "perturbations": list(variants)}
    if not variants or any(v is None for v in variants):
        return out | {"mean": None, "std": None, "missing": "no perturbed score to average"}
    values = [float(v) for v in variants if v is not None]
    mean = sum(values) / len(values)
    return out | {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))}
