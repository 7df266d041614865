"""`analyze judge-agreement` (Figure 10): the synthesis judge's per-turn verdicts against a human's.

Judge side: `synth verify --out` rows, `{"id", ..., "turns": [{"turn": i, "needs_refinement": bool}]}`
(one entry per player turn, i = its index in the raw trajectory's `turns`; the verdict is the
DM's `error` flag on the reply to it). Human side, one JSON object a line::

    {"id": "traj-7", "turn": 4, "needs_refinement": true}

joined on (id, turn). A turn on only one side is unmatched: counted, listed, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

# Figure 10's wording: "right" = the turn needs no refinement.
RIGHT, WRONG = "right", "wrong"


class JudgeError(ValueError):
    """Unusable judge or human file: one line for the CLI."""


@dataclasses.dataclass
class Agreement:
    # (human, judge) -> count, keys from (RIGHT, WRONG)
    table: dict[tuple[str, str], int]
    matched: int
    judge_only: list[tuple[str, int]]
    human_only: list[tuple[str, int]]

    @property
    def accuracy(self) -> float:
        return (self.table[RIGHT, RIGHT] + self.table[WRONG, WRONG]) / self.matched

    @property
    def kappa(self) -> float:
        """Cohen's kappa: (p_o - p_e) / (1 - p_e), p_e from the two raters' marginals."""
        n = self.matched
        p_o = self.accuracy
        p_e = sum(
            (self.table[c, RIGHT] + self.table[c, WRONG]) * (self.table[RIGHT, c] + self.table[WRONG, c])
            for c in (RIGHT, WRONG)
        ) / (n * n)
        return 1.0 if p_e == 1.0 else (p_o - p_e) / (1 - p_e)

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": {f"human_{h}/judge_{j}": c for (h, j), c in self.table.items()},
            "matched": self.matched,
            "accuracy": self.accuracy,
            "kappa": self.kappa,
            "unmatched": {
                "judge_only": len(self.judge_only),
                "human_only": len(self.human_only),
                "judge_only_turns": [list(t) for t in self.judge_only],
                "human_only_turns": [list(t) for t in self.human_only],
            },
        }


def _verdict(value: Any, where: str) -> str:
    if not isinstance(value, bool):
        raise JudgeError(f"{where}: needs_refinement must be true or false, got {value!r}")
    return WRONG if value else RIGHT


def _lines(path: str | os.PathLike[str]) -> Iterable[tuple[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if line.strip():
                    where = f"{path}:{n}"
                    try:
                        yield where, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise JudgeError(f"{where}: not JSON ({e})") from None
    except FileNotFoundError:
        raise JudgeError(f"{path}: no such file") from None


def _add(out: dict[tuple[str, int], str], key: tuple[str, int], verdict: str, where: str) -> None:
    if key in out:
        raise JudgeError(f"{where}: turn {key[1]} of {key[0]!r} is labelled twice")
    out[key] = verdict


def read_judge(path: str | os.PathLike[str]) -> dict[tuple[str, int], str]:
    """(id, turn) -> verdict from `synth verify --out` rows."""
    out: dict[tuple[str, int], str] = {}
    for where, row in _lines(path):
        if not isinstance(row, Mapping) or "turns" not in row or "ok" not in row:
            raise JudgeError(
                f"{where}: not a `synth verify --out` row with per-turn verdicts (needs 'id', 'ok', "
                "'turns'); rerun `python -m agentrefine_jax.synth verify`"
            )
        if row.get("id") is None:
            continue  # an unparsable trajectory line: verify reported it, it has no turns to compare
        for t in row["turns"]:
            _add(out, (str(row["id"]), int(t["turn"])), _verdict(t.get("needs_refinement"), where), where)
    if not out:
        raise JudgeError(f"{path}: no per-turn verdicts")
    return out


def read_human(path: str | os.PathLike[str]) -> dict[tuple[str, int], str]:
    """(id, turn) -> verdict from the human-labelled JSONL (`{"id", "turn", "needs_refinement"}`)."""
    out: dict[tuple[str, int], str] = {}
    for where, row in _lines(path):
        if not isinstance(row, Mapping) or not {"id", "turn", "needs_refinement"} <= set(row):
            raise JudgeError(f'{where}: expected {{"id": ..., "turn": N, "needs_refinement": true|false}}')
        if not isinstance(row["turn"], int) or isinstance(row["turn"], bool):
            raise JudgeError(f"{where}: turn must be an integer, got {row['turn']!r}")
        _add(out, (str(row["id"]), row["turn"]), _verdict(row["needs_refinement"], where), where)
    if not out:
        raise JudgeError(f"{path}: no labelled turns")
    return out


def agreement(judge: Mapping[tuple[str, int], str], human: Mapping[tuple[str, int], str]) -> Agreement:
    matched = sorted(set(judge) & set(human))
    if not matched:
        raise JudgeError(
            f"no turn is in both files ({len(judge)} judged, {len(human)} labelled): "
            "their ids or turn numbers differ"
        )
    table = {(h, j): 0 for h in (RIGHT, WRONG) for j in (RIGHT, WRONG)}
    for key in matched:
        table[human[key], judge[key]] += 1
    return Agreement(table, len(matched), sorted(set(judge) - set(human)), sorted(set(human) - set(judge)))


def markdown(a: Agreement, paper_row: Mapping[tuple[str, str], int] | None = None) -> str:
    """Figure 10's layout: rows human, columns judge; "right" = needs no refinement."""
    lines = [
        "| | judge: right | judge: wrong |",
        "|---|---|---|",
        f"| human: right | {a.table[RIGHT, RIGHT]} | {a.table[RIGHT, WRONG]} |",
        f"| human: wrong | {a.table[WRONG, RIGHT]} | {a.table[WRONG, WRONG]} |",
    ]
    text = "\n".join(lines) + (
        f"\n\n{a.matched} matched turns: accuracy {100 * a.accuracy:.1f}%, Cohen's kappa {a.kappa:.3f}; "
        f"unmatched: {len(a.judge_only)} judged only, {len(a.human_only)} labelled only."
    )
    if paper_row:
        n = sum(paper_row.values())
        ref = Agreement(dict(paper_row), n, [], [])
        text += (
            "\n\npaper (Figure 10, GPT-4 vs human, 100 turns):\n\n"
            "| | GPT-4: right | GPT-4: wrong |\n|---|---|---|\n"
            f"| human: right | {paper_row[RIGHT, RIGHT]} | {paper_row[RIGHT, WRONG]} |\n"
            f"| human: wrong | {paper_row[WRONG, RIGHT]} | {paper_row[WRONG, WRONG]} |\n\n"
            f"accuracy {100 * ref.accuracy:.1f}%, Cohen's kappa {ref.kappa:.3f} "
            "(computed from the paper's counts)"
        )
    return text
