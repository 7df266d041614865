"""Algorithm 1 of the AgentRefine paper: verify a synthesized DM/Player trajectory.

The walk keeps a *verified prefix*: every turn that passes joins it, the first turn that
fails stops the walk. The generator regenerates from that prefix, so the prefix length is
as important as the verdict.

Raw trajectory schema (one JSON object per line)::

    {"id": str, "persona": str,
     "script": {"environment": str, "task": str, "available_actions": [str, ...]},
     "turns": [{"role": "player", "thought": str, "action": str},
               {"role": "dm", "observation": str, "error": bool, "task_success": bool}, ...]}

`{name}` slots in an available action match any non-empty text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from agentrefine_jax.unicode_text import lone_surrogate

PLAYER = "player"
DM = "dm"
# Required keys and their types per role; a wrong type counts as a missing key because the
# converter and the regenerator could not use the turn either.
REQUIRED_KEYS: dict[str, dict[str, type]] = {
    PLAYER: {"thought": str, "action": str},
    DM: {"observation": str, "error": bool, "task_success": bool},
}

# Reason codes (stable: reports and drop summaries are grouped by them).
OK = "ok"
INVALID_JSON = "invalid_json"
JSON_TOO_DEEP = "json_too_deep"  # nested past the parser's recursion limit
INVALID_UNICODE = "invalid_unicode"  # a lone surrogate: no tokenizer or UTF-8 writer accepts it
UNPARSED = (INVALID_JSON, JSON_TOO_DEEP)  # reasons for which there is no parsed object
BAD_SCHEMA = "bad_schema"
NO_TURNS = "no_turns"
MISSING_KEYS = "missing_keys"
INVALID_ACTION = "invalid_action"
ERROR_ON_LAST_TURN = "error_on_last_turn"
TASK_NOT_FINISHED = "task_not_finished"
NO_ERROR = "no_error"


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    ok: bool
    # Number of leading turns that passed (== len(turns) when ok).
    verified_turns: int
    # One of the reason codes above.
    reason: str
    # Human-readable explanation (which turn, what was wrong).
    detail: str = ""


# ------------------------------------------------------------------ action matching

_SLOT = re.compile(r"\{[^{}]*\}")
_WS = re.compile(r"\s+")


def _normalize(text: str) -> str:
    return _WS.sub(" ", text).strip()


@functools.lru_cache(maxsize=4096)
def _template_regex(template: str) -> re.Pattern[str]:
    """`take {object} from {place}` -> a case-insensitive regex; each slot is non-empty text."""
    template = _normalize(template)
    parts: list[str] = []
    pos = 0
    for m in _SLOT.finditer(template):
        parts.append(re.escape(template[pos : m.start()]))
        # Non-empty and not padded with whitespace (whitespace is normalized beforehand).
        parts.append(r"\S(?:.*?\S)?")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts), re.IGNORECASE | re.DOTALL)


def action_matches(action: str, available_actions: Sequence[str]) -> bool:
    """True if `action` instantiates one of the templates (whitespace- and case-insensitive)."""
    action = _normalize(action)
    if not action:
        return False
    return any(_template_regex(t).fullmatch(action) for t in available_actions)


def action_templates(script: dict[str, Any]) -> list[str]:
    """The action templates of a script (items may be strings or {"action": ..., ...} objects)."""
    out = []
    for item in script.get("available_actions", []):
        out.append(item["action"] if isinstance(item, dict) else item)
    return out


# ------------------------------------------------------------------ Algorithm 1


def _schema_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return f"top level is {type(obj).__name__}, expected an object"
    script = obj.get("script")
    if not isinstance(script, dict):
        return "missing or non-object 'script'"
    actions = script.get("available_actions")
    if not isinstance(actions, list) or not actions:
        return "script.available_actions must be a non-empty list"
    for a in actions:
        ok = isinstance(a, str) or (isinstance(a, dict) and isinstance(a.get("action"), str))
        if not ok:
            return f"script.available_actions item {a!r} is not an action template string"
    if not isinstance(obj.get("turns"), list):
        return "missing or non-list 'turns'"
    return None


def _missing_keys(turn: Any) -> str | None:
    if not isinstance(turn, dict):
        return f"turn is {type(turn).__name__}, expected an object"
    role = turn.get("role")
    if role not in REQUIRED_KEYS:
        return f"role {role!r} is not {PLAYER!r} or {DM!r}"
    bad = [k for k, t in REQUIRED_KEYS[role].items() if not isinstance(turn.get(k), t)]
    if bad:
        return f"{role} turn lacks (or mistypes) {', '.join(bad)}"
    return None


class LineError(ValueError):
    """A JSONL line that does not parse: `reason` is INVALID_JSON or JSON_TOO_DEEP."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def parse_line(text: str | bytes) -> Any:
    """json.loads of one raw line; a line the parser rejects or cannot recurse through raises LineError."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LineError(INVALID_JSON, f"not valid JSON: {e}") from None
    except RecursionError:  # e.g. 100k nested brackets: a bad line, not a crash
        raise LineError(JSON_TOO_DEEP, "JSON nested deeper than the parser allows") from None


def verify_trajectory(obj_or_text: dict[str, Any] | str | bytes) -> VerifyResult:
    """Algorithm 1: the verdict, the verified-prefix length and the reason.

    Accepts a parsed raw trajectory or its JSON text.
    """
    if isinstance(obj_or_text, (str, bytes)):
        try:
            obj = parse_line(obj_or_text)
        except LineError as e:
            return VerifyResult(False, 0, e.reason, e.detail)
    else:
        obj = obj_or_text
    bad_text = lone_surrogate(obj)
    if bad_text:
        return VerifyResult(False, 0, INVALID_UNICODE, bad_text)
    problem = _schema_problem(obj)
    if problem:
        return VerifyResult(False, 0, BAD_SCHEMA, problem)
    turns: list[Any] = obj["turns"]
    if not turns:
        return VerifyResult(False, 0, NO_TURNS, "trajectory has no turns")
    templates = action_templates(obj["script"])

    error_count = 0
    last = len(turns) - 1
    for i, turn in enumerate(turns):
        missing = _missing_keys(turn)
        if missing:
            return VerifyResult(False, i, MISSING_KEYS, f"turn {i}: {missing}")
        if turn["role"] == PLAYER and not action_matches(turn["action"], templates):
            nxt = turns[i + 1] if i < last else None
            flagged = isinstance(nxt, dict) and nxt.get("role") == DM and nxt.get("error") is True
            if not flagged:
                return VerifyResult(
                    False,
                    i,
                    INVALID_ACTION,
                    f"turn {i}: action {turn['action']!r} matches no available action "
                    "and the next DM turn does not flag an error",
                )
        if turn["role"] == DM and turn["error"]:
            error_count += 1
        if i == last:
            if turn.get("error") is True:
                return VerifyResult(False, i, ERROR_ON_LAST_TURN, f"turn {i}: the last DM turn is an error")
            if turn.get("task_success") is not True:
                what = "a player turn" if turn["role"] == PLAYER else "a DM turn without task_success"
                return VerifyResult(False, i, TASK_NOT_FINISHED, f"turn {i}: trajectory ends with {what}")
            if error_count < 1:
                return VerifyResult(
                    False, i, NO_ERROR, "no DM turn flags an error: nothing to learn refinement from"
                )
    return VerifyResult(True, len(turns), OK, f"{len(turns)} turns, {error_count} flagged error(s)")


def turn_verdicts(obj: Any) -> list[dict[str, Any]]:
    """The judge's verdict on every player turn: `{"turn": i, "needs_refinement": bool}`.

    The DM (the synthesis LLM) judges a player's action by flagging its reply as an error; that
    flag is the turn's verdict (the paper's Figure 10 compares it with a human's). `i` indexes the
    raw `turns` list. A player turn without a well-formed DM reply after it has no verdict.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("turns"), list):
        return []
    turns = obj["turns"]
    out = []
    for i, turn in enumerate(turns[:-1]):
        nxt = turns[i + 1]
        if (
            isinstance(turn, dict)
            and turn.get("role") == PLAYER
            and isinstance(nxt, dict)
            and nxt.get("role") == DM
            and isinstance(nxt.get("error"), bool)
        ):
            out.append({"turn": i, "needs_refinement": nxt["error"]})
    return out
