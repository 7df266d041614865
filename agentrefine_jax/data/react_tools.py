"""AgentRefine ReAct trajectories <-> OpenAI tool-call rows, losslessly.

A ReAct assistant turn ``THOUGHT\\nAction: COMMAND`` becomes an assistant message with content
``THOUGHT`` and one call of the `act` function, ``{"command": COMMAND}``; the user turn that
answers it (the observation) becomes the `tool` message answering that call. The task (the first
user turn), the system prompt and every loss / train flag stay as they are; the row gains
`tools: [ACT_TOOL]`. A turn whose text is not exactly ``[THOUGHT\\n]Action: COMMAND`` (no
action, text after the action line, an action on several lines) stays a text turn, and so does
the user turn after it: converting back must give the original text byte for byte
(`tool_row_to_react(react_to_tool_row(row)) == row`, tests/test_data_tool_calls.py).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from agentrefine_jax.data.schema import FieldMap, normalize_row

ACT = "act"
ACT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": ACT,
        "description": "Run one action in the environment; its observation comes back as the result.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the action, e.g. 'go to kitchen'"}},
            "required": ["command"],
        },
    },
}
# THOUGHT (any text, possibly empty) then a last line "Action: COMMAND" with nothing after it.
_TURN = re.compile(r"(?:(?P<thought>.*)\n)?Action: (?P<command>[^\n]+)", re.DOTALL)


def split_react(text: str) -> tuple[str, str] | None:
    """(thought, command) of a ReAct turn, or None when the text would not come back unchanged."""
    match = _TURN.fullmatch(text)
    if match is None:
        return None
    thought, command = match.group("thought") or "", match.group("command")
    return (thought, command) if join_react(thought, command) == text else None


def join_react(thought: str, command: str) -> str:
    return f"{thought}\nAction: {command}" if thought else f"Action: {command}"


def react_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ReAct turns as tool-call turns (deep copies; no validation, so an agent's prompt that has no
    assistant turn yet converts too): each ``[THOUGHT\\n]Action: COMMAND`` turn becomes content THOUGHT
    and one `act` call (id ``callNNNNN``, numbered as data/schema.py numbers calls without one), the
    user turn after it the `tool` message answering that call."""
    out: list[dict[str, Any]] = []
    answering: str | None = None  # the id of the last assistant turn's call: the next user turn answers it
    n_calls = 0
    for m in messages:
        m = copy.deepcopy(m)
        if m["role"] == "assistant":
            parsed = split_react(m["content"]) if not m.get("tool_calls") else None
            answering = None
            n_calls += len(m.get("tool_calls") or ())  # numbered after the calls already there
            if parsed is not None:
                answering = f"call{n_calls:05d}"
                n_calls += 1
                m["content"] = parsed[0]
                m["tool_calls"] = [
                    {
                        "id": answering,
                        "type": "function",
                        "function": {"name": ACT, "arguments": {"command": parsed[1]}},
                    }
                ]
        elif m["role"] == "user" and answering is not None:
            m = {"role": "tool", "tool_call_id": answering, "content": m["content"]}
            answering = None
        out.append(m)
    return out


def react_to_tool_row(row: Mapping[str, Any], field_map: FieldMap | None = None) -> dict[str, Any]:
    """A ReAct row (any layout the schema reads) as a canonical tool-call row
    {"id", "messages", "tools"} (raises RowError for a row the schema refuses)."""
    conv = normalize_row(row, field_map, "row")
    messages = react_tool_messages(conv["messages"])
    tools = [copy.deepcopy(ACT_TOOL)]
    out = normalize_row({"id": conv["id"], "messages": messages, "tools": tools}, None, conv["id"])  # ids set
    return {"id": out["id"], "messages": _plain(out["messages"]), "tools": out["messages"][0]["tools"]}


def react_action(content: str, calls: list[Mapping[str, Any]], where: str = "the reply") -> str:
    """A turn's content and calls as the ReAct text they stand for (`join_react`); raises ValueError
    unless the calls are exactly one `act` call with a `command`."""
    args = calls[0]["function"]["arguments"] if len(calls) == 1 else None
    if (
        args is None
        or calls[0]["function"]["name"] != ACT
        or not isinstance(args, Mapping)
        or set(args) != {"command"}
    ):
        raise ValueError(f"{where}: only one `act` call with a `command` is a ReAct action")
    return join_react(content, str(args["command"]))


def tool_row_to_react(row: Mapping[str, Any], field_map: FieldMap | None = None) -> dict[str, Any]:
    """A tool-call row whose calls are all single `act` calls, back as a canonical ReAct row
    {"id", "messages"}: each call becomes the ``Action:`` line of its turn, each result the user
    turn. Raises ValueError for a call it cannot write as one action."""
    conv = normalize_row(row, field_map, "row")
    messages = []
    for i, m in enumerate(conv["messages"]):
        m = {k: v for k, v in m.items() if k not in ("tools", "tool_call_id", "name")}
        calls = m.pop("tool_calls", None)
        if calls is not None:
            m["content"] = react_action(m["content"], calls, f"message {i}")
        if m["role"] == "tool":
            m["role"] = "user"
        messages.append(m)
    return {"id": conv["id"], "messages": messages}


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages as a row holds them: the tools at the row level, the tool name on a
    result implied by its call."""
    return [
        {k: v for k, v in m.items() if k != "tools" and not (m["role"] == "tool" and k == "name")}
        for m in messages
    ]
