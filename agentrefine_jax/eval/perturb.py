"""Action vocabularies and their rewordings (the paper's robustness study).

Every environment declares its actions as `ActionWord`s: a canonical verb phrase the simulator
understands, a usage pattern and a description, plus reworded variants. A `Vocabulary` picks one
variant per word; the agent only ever sees the surface wording, and its commands are mapped back to
the canonical phrase before they reach the simulator. Under a perturbation the canonical wording
of a renamed action is rejected, so a model that ignores the stated action names is caught.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

ORIGINAL = 0


@dataclasses.dataclass(frozen=True)
class ActionWord:
    canonical: str
    # Usage pattern with a `{verb}` slot, e.g. "{verb} OBJ to OBJ".
    usage: str
    description: str
    # (surface verb phrase, description) for perturbation 1, 2, ...
    variants: tuple[tuple[str, str], ...] = ()


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

    def to_canonical(self, command: str) -> str | None:
        """Map an agent command back to the simulator's wording.

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


def variant_name(perturbation: int) -> str:
    return "original" if perturbation == ORIGINAL else f"perturbation_{perturbation}"


def _starts_with_phrase(text: str, phrase: str) -> bool:
    return text == phrase or text.startswith(phrase + " ")
