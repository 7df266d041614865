"""Raw DM/Player trajectories -> the canonical chat schema the data stage trains on.

Canonical row: {"id": str, "messages": [{"role", "content", "loss"?}, ...]}, `loss` only on
assistant messages (false = an erroneous turn: trained on as context, never as a target).

Mapping (documented in docs/synth.md):
- system: environment, task and the action list with descriptions (prompts.training_system_prompt).
- The first DM turn's observation is the first user message.  A trajectory that starts with a
  Player turn gets a first user message stating the task instead.
- Every DM observation between two Player turns is a user message, error feedback included.
- Every Player turn is an assistant message "Thought: ...\\nAction: ..."; `loss` is false on
  exactly the Player turns whose next DM turn has `error: true`.
- The final DM turn (task success) is dropped: nothing is trained after it, and the canonical
  schema ends with an assistant turn.
Only trajectories that pass Algorithm 1 are converted.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from collections.abc import Iterable
from typing import Any

from agentrefine_jax.synth import jsonl
from agentrefine_jax.synth.prompts import training_system_prompt
from agentrefine_jax.synth.verify import DM, PLAYER, verify_trajectory

BAD_ID = "bad_id"
DUPLICATE_ID = "duplicate_id"
BAD_TURN_ORDER = "bad_turn_order"


class ConversionError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def assistant_content(turn: dict[str, Any]) -> str:
    return f"Thought: {turn['thought']}\nAction: {turn['action']}"


def to_chat(raw: dict[str, Any]) -> dict[str, Any]:
    """Convert one verified raw trajectory; raise ConversionError(reason) if it cannot be."""
    result = verify_trajectory(raw)
    if not result.ok:
        raise ConversionError(result.reason, result.detail)
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid:
        raise ConversionError(BAD_ID, f"id must be a non-empty string, got {rid!r}")
    script, turns = raw["script"], raw["turns"]

    messages: list[dict[str, Any]] = [{"role": "system", "content": training_system_prompt(script)}]
    start = 0
    if turns[0]["role"] == DM:
        messages.append({"role": "user", "content": turns[0]["observation"]})
        start = 1
    else:
        messages.append({"role": "user", "content": f"Your task: {script['task']}"})
    # After the opening, turns must alternate Player, DM, ..., Player, DM(final).
    body = turns[start:]
    for j, turn in enumerate(body):
        expected = PLAYER if j % 2 == 0 else DM
        if turn["role"] != expected:
            raise ConversionError(
                BAD_TURN_ORDER, f"turn {start + j} is a {turn['role']} turn, expected {expected}"
            )
    for j in range(0, len(body), 2):
        player, dm = body[j], body[j + 1]  # Algorithm 1 guarantees the last turn is a DM turn.
        messages.append({"role": "assistant", "content": assistant_content(player), "loss": not dm["error"]})
        if j + 2 < len(body):
            messages.append({"role": "user", "content": dm["observation"]})
    if messages[-1]["role"] != "assistant":
        raise ConversionError(BAD_TURN_ORDER, "no Player turn to train on")
    return {"id": rid, "messages": messages}


@dataclasses.dataclass
class ConvertSummary:
    read: int = 0
    written: int = 0
    dropped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Assistant turns written, and how many of them are erroneous (loss false).
    assistant_turns: int = 0
    error_turns: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "written": self.written,
            "dropped": dict(sorted(self.dropped.items())),
            "assistant_turns": self.assistant_turns,
            "error_turns": self.error_turns,
        }


def convert_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], ConvertSummary]:
    """Convert raw JSONL lines; every line is either written or counted under a drop reason."""
    summary = ConvertSummary()
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for line in lines:
        summary.read += 1
        if not line.strip():
            summary.dropped["blank_line"] += 1
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            summary.dropped["invalid_json"] += 1
            continue
        try:
            row = to_chat(raw)
        except ConversionError as e:
            summary.dropped[e.reason] += 1
            continue
        if row["id"] in seen:
            summary.dropped[DUPLICATE_ID] += 1
            continue
        seen.add(row["id"])
        rows.append(row)
        summary.written += 1
        for m in row["messages"]:
            if m["role"] == "assistant":
                summary.assistant_turns += 1
                summary.error_turns += not m["loss"]
    return rows, summary


def convert_file(src: str | pathlib.Path, dst: str | pathlib.Path) -> ConvertSummary:
    """RAW.jsonl -> TRAIN.jsonl, written atomically (a crash never leaves a half file)."""
    rows, summary = convert_lines(jsonl.iter_lines(src))
    jsonl.write_atomic(dst, rows)
    return summary
