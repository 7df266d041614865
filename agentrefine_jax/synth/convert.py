"""Raw DM/Player trajectories -> the canonical chat schema the data stage trains on.

Canonical row: {"id": str, "messages": [{"role", "content", "loss"?}, ...]}, `loss` only on
assistant messages (false = an erroneous turn: trained on as context, never as a target).

Mapping (documented in docs/synth.md); the layout itself is agentrefine_jax.layout's, shared with `eval`:
- `chat` style: system = the agent's answer-format rules; the first user message = the script's environment
  and action list (prompts.script_instruction), the "check valid actions" hint, the task as goal and the
  first DM observation (`Observation: ...`; none when the trajectory starts with a Player turn).
- Every DM observation between two Player turns is a user message `Observation: ...`, error feedback included.
- Every Player turn is an assistant message "Thought: ...\\nAction: ..."; `loss` is false on
  exactly the Player turns whose next DM turn has `error: true`.
- The final DM turn (task success) is dropped: nothing is trained after it, and the canonical
  schema ends with an assistant turn.
- `agentboard` style: one row per trained (loss true) Player turn, id `<id>#<k>`: system, AgentBoard's single
  user message (instruction, goal, help line, the Observation/Action history before that turn) and the turn.
  Erroneous turns stay in later rows' histories as context and are never targets.
Only trajectories that pass Algorithm 1 are converted.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
from collections.abc import Iterable
from typing import Any

from agentrefine_jax.layout import (
    SYSTEM_PROMPT,
    agentboard_messages,
    assistant_turn,
    check_style,
    first_user_turn,
    observation_turn,
)
from agentrefine_jax.synth import jsonl
from agentrefine_jax.synth.prompts import script_instruction
from agentrefine_jax.synth.verify import DM, PLAYER, LineError, parse_line, verify_trajectory

BAD_ID = "bad_id"
DUPLICATE_ID = "duplicate_id"
BAD_TURN_ORDER = "bad_turn_order"


class ConversionError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def assistant_content(turn: dict[str, Any]) -> str:
    return assistant_turn(turn["thought"], turn["action"])


def _checked(raw: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]], int]:
    """Verify a raw trajectory; returns (id, script, turns, index of the first Player turn)."""
    result = verify_trajectory(raw)
    if not result.ok:
        raise ConversionError(result.reason, result.detail)
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid:
        raise ConversionError(BAD_ID, f"id must be a non-empty string, got {rid!r}")
    script, turns = raw["script"], raw["turns"]
    start = 1 if turns[0]["role"] == DM else 0
    # After the opening, turns must alternate Player, DM, ..., Player, DM(final).
    for j, turn in enumerate(turns[start:]):
        expected = PLAYER if j % 2 == 0 else DM
        if turn["role"] != expected:
            raise ConversionError(
                BAD_TURN_ORDER, f"turn {start + j} is a {turn['role']} turn, expected {expected}"
            )
    if len(turns) <= start:
        raise ConversionError(BAD_TURN_ORDER, "no Player turn to train on")
    return rid, script, turns, start


def to_chat(raw: dict[str, Any]) -> dict[str, Any]:
    """Convert one verified raw trajectory to one `chat`-style row; raise ConversionError(reason)."""
    rid, script, turns, start = _checked(raw)
    first_obs = turns[0]["observation"] if start else None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": first_user_turn(script_instruction(script), script["task"], first_obs)},
    ]
    body = turns[start:]
    for j in range(0, len(body), 2):
        player, dm = body[j], body[j + 1]  # Algorithm 1 guarantees the last turn is a DM turn.
        messages.append({"role": "assistant", "content": assistant_content(player), "loss": not dm["error"]})
        if j + 2 < len(body):
            messages.append({"role": "user", "content": observation_turn(dm["observation"])})
    return {"id": rid, "messages": messages}


def to_agentboard_rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Convert one verified raw trajectory to `agentboard`-style rows, one per trained Player turn."""
    rid, script, turns, start = _checked(raw)
    instruction = script_instruction(script)
    history: list[tuple[str, str]] = [("Observation", turns[0]["observation"])] if start else []
    rows = []
    body = turns[start:]
    for j in range(0, len(body), 2):
        player, dm = body[j], body[j + 1]
        if not dm["error"]:
            messages: list[dict[str, Any]] = list(
                agentboard_messages(SYSTEM_PROMPT, instruction, script["task"], history)
            )
            messages.append({"role": "assistant", "content": assistant_content(player), "loss": True})
            rows.append({"id": f"{rid}#{j // 2}", "messages": messages})
        history += [("Action", player["action"]), ("Observation", dm["observation"])]
    return rows


@dataclasses.dataclass
class ConvertSummary:
    read: int = 0
    written: int = 0
    dropped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Assistant turns written, and how many of them are erroneous (loss false).
    assistant_turns: int = 0
    error_turns: int = 0
    rows: int = 0  # rows in the output file (= written for `chat`; one per trained turn for `agentboard`)

    def as_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "written": self.written,
            "dropped": dict(sorted(self.dropped.items())),
            "assistant_turns": self.assistant_turns,
            "error_turns": self.error_turns,
            "rows": self.rows,
        }


def convert_lines(lines: Iterable[str], style: str = "chat") -> tuple[list[dict[str, Any]], ConvertSummary]:
    """Convert raw JSONL lines; every line is either written or counted under a drop reason."""
    check_style(style)
    summary = ConvertSummary()
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for line in lines:
        summary.read += 1
        if not line.strip():
            summary.dropped["blank_line"] += 1
            continue
        try:
            raw = parse_line(line)
        except LineError as e:
            summary.dropped[e.reason] += 1
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
        # agentboard style: the same trajectory, one row per trained turn (same checks, same counts).
        rows.extend(to_agentboard_rows(raw) if style == "agentboard" else [row])
        summary.written += 1
        for m in row["messages"]:
            if m["role"] == "assistant":
                summary.assistant_turns += 1
                summary.error_turns += not m["loss"]
    return rows, summary


def convert_file(src: str | pathlib.Path, dst: str | pathlib.Path, style: str = "chat") -> ConvertSummary:
    """RAW.jsonl -> TRAIN.jsonl, written atomically (a crash never leaves a half file)."""
    rows, summary = convert_lines(jsonl.iter_lines(src), style)
    summary.rows = len(rows)
    jsonl.write_atomic(dst, rows)
    return summary
