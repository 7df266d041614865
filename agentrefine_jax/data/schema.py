"""Trajectory schema: canonical rows, other layouts mapped onto it, validation, turn categories.

Canonical row::

    {"id": str, "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, "loss": bool}],
     "tools": [...]}  # optional

Tool-call conversations (OpenAI's layout) are canonical rows too: an assistant message may carry
`tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}]) beside or instead
of `content`, each call is answered by a `tool` message (`tool_call_id`), and the row's `tools`
list (function definitions) travels on the conversation's FIRST message under the key `tools`
(so every layer that passes message lists carries it). ShareGPT's `function_call` turns become
assistant tool calls and `observation` turns tool messages. An assistant message may also carry
`reasoning_content` (its thinking); a `<think>...</think>` block in content is split into it.

`loss` matters only on assistant messages (default true); `loss: false` marks an *erroneous*
turn. An assistant message may instead carry `"train": false`: a turn that is context only
(AgentInstruct's "Ok." acknowledgement, in-context demonstrations) - never trained, and not a
mistake. Every assistant turn falls in exactly one category:

* ``untrained``  - ``train: false`` (no loss whatever `loss_on` says; transparent for the rules below);
* ``erroneous``  - ``loss: false``;
* ``refinement`` - the next assistant turn after an erroneous one, itself not erroneous;
* ``correct``    - every other assistant turn.

`loss_on` (a subset of correct/refinement/erroneous) says which categories carry loss. The
default ``correct,refinement`` is the paper's Equation 1.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from agentrefine_jax.config_checks import CATEGORIES  # what `loss_on` may name (re-exported)
from agentrefine_jax.unicode_text import lone_surrogate

ROLES = ("system", "user", "assistant", "tool")
# What a file's role value may map onto: ROLES, or ShareGPT's function_call (an assistant turn
# whose value is the call(s) as JSON).
FUNCTION_CALL = "function_call"
_ROLE_TARGETS = (*ROLES, FUNCTION_CALL)
UNTRAINED = "untrained"  # category of `train: false` turns; never in loss_on
FLAG_MEANINGS = ("loss", "error", "train")
DEFAULT_LOSS_ON: tuple[str, ...] = ("correct", "refinement")

Message = dict[str, Any]


TOO_DEEP = "nested too deeply"  # skip reason: JSON deeper than Python's parser recursion limit
INVALID_UNICODE = "invalid unicode"  # skip reason: a lone surrogate no tokenizer or writer accepts


class RowError(ValueError):
    """A row that cannot be trained on. `reason` is a short stable key used for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Where a row keeps its turns, and how to read each turn.

    `flag` names the per-turn boolean; `flag_means` gives its polarity: "loss" (true = train
    on this turn, false = erroneous), "error" (true = erroneous turn), or "train" (true =
    train on it, false = context only: not trained and NOT erroneous - AgentInstruct /
    AgentTraj-L). A missing flag means "trained, not erroneous". `roles` maps the file's role
    values onto system/user/assistant.
    """

    turns: str
    role: str
    content: str
    flag: str | None = "loss"
    flag_means: str = "loss"
    roles: Mapping[str, str] = dataclasses.field(default_factory=lambda: {r: r for r in ROLES})
    id: str | None = "id"
    tools: str | None = "tools"  # the row's function definitions (a list, or a JSON string of one)

    def __post_init__(self) -> None:
        if self.flag_means not in FLAG_MEANINGS:
            raise ValueError(f"field_map.flag_means must be one of {FLAG_MEANINGS}, got {self.flag_means!r}")
        bad = {k: v for k, v in self.roles.items() if v not in _ROLE_TARGETS}
        if bad:
            raise ValueError(f"field_map.roles must map onto {_ROLE_TARGETS}; bad entries: {bad}")


_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    # LLaMA-Factory's tool layout: the call(s) as JSON, then the tool's answer.
    "function_call": FUNCTION_CALL,
    "observation": "tool",
    "tool": "tool",
}
PRESETS: dict[str, FieldMap] = {
    "canonical": FieldMap(turns="messages", role="role", content="content"),
    # ShareGPT, as in fudayuan/AgentRefine-* (columns id, conversations[{from, value, loss}]).
    "sharegpt": FieldMap(turns="conversations", role="from", content="value", roles=_SHAREGPT_ROLES),
    # Agent-FLAN's layout: conversation[{role, content, loss}].
    "agentflan": FieldMap(turns="conversation", role="role", content="content"),
    # THUDM/AgentInstruct and AgentGym/AgentTraj-L: ShareGPT columns, but `loss: false` marks
    # turns that are simply not trained (the "Ok." ack, in-context demo turns), not mistakes.
    "agentinstruct": FieldMap(
        turns="conversations", role="from", content="value", flag_means="train", roles=_SHAREGPT_ROLES
    ),
    "agenttraj": FieldMap(
        turns="conversations",
        role="from",
        content="value",
        flag_means="train",
        roles=_SHAREGPT_ROLES,
        id="item_id",
    ),
}
FORMATS = ("auto", "custom", *PRESETS)
_FIELD_MAP_KEYS = {f.name for f in dataclasses.fields(FieldMap)} | {"loss"}


def resolve_field_map(fmt: str, overrides: Mapping[str, Any] | None = None) -> FieldMap | None:
    """The FieldMap for `fmt` with `overrides` applied; None means "auto-detect per row".

    `custom` starts from the canonical keys, so a custom map only names what differs.
    A `roles` override extends the preset's role map (a value may also remap a preset key).
    """
    overrides = dict(overrides or {})
    unknown = set(overrides) - _FIELD_MAP_KEYS
    if unknown:
        raise ValueError(f"unknown field_map keys {sorted(unknown)}; allowed: {sorted(_FIELD_MAP_KEYS)}")
    if "loss" in overrides:  # friendlier alias for the flag column
        overrides.setdefault("flag", overrides.pop("loss"))
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; choose from {FORMATS}")
    if fmt == "auto":
        if overrides:
            raise ValueError("field_map overrides need an explicit format (e.g. format=custom)")
        return None
    base = PRESETS["canonical" if fmt == "custom" else fmt]
    if "roles" in overrides and not isinstance(overrides["roles"], Mapping):
        raise ValueError("field_map.roles must be an object mapping file values to system/user/assistant")
    if "roles" in overrides:
        overrides["roles"] = {**base.roles, **overrides["roles"]}
    return dataclasses.replace(base, **overrides)


def detect_field_map(row: Mapping[str, Any]) -> FieldMap:
    for name in ("canonical", "sharegpt", "agentflan"):
        if PRESETS[name].turns in row:
            return PRESETS[name]
    raise RowError(
        "unknown layout",
        f"no 'messages', 'conversations' or 'conversation' field (keys: {sorted(row)[:10]}); "
        "set data.format / data.field_map",
    )


def _read_flag(value: Any, where: int) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_ from parquet/pandas
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    raise RowError("bad loss flag", f"turn {where}: flag must be a boolean (or 0/1), got {value!r}")


def _json_value(value: Any, what: str) -> Any:
    """A field that some exports store as a JSON string (tools, function_call values, arguments)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RowError("bad tool call", f"{what} is a string but not JSON: {e}") from None
    except RecursionError:
        raise RowError(TOO_DEEP, f"{what} is a JSON string nested too deeply") from None


def normalize_row(row: Any, field_map: FieldMap | None, fallback_id: str) -> dict[str, Any]:
    """Map one raw row onto the canonical schema and validate it (raises RowError)."""
    if not isinstance(row, Mapping):
        raise RowError("not an object", f"row is {type(row).__name__}, expected a JSON object")
    bad_text = lone_surrogate(row)
    if bad_text:
        raise RowError(INVALID_UNICODE, bad_text)
    fm = field_map or detect_field_map(row)
    if fm.turns not in row:
        raise RowError("missing turns field", f"no {fm.turns!r} field (keys: {sorted(row)[:10]})")
    turns = row[fm.turns]
    if isinstance(turns, str):  # some parquet exports store the turn list as a JSON string
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as e:
            raise RowError("bad turns field", f"{fm.turns!r} is a string but not JSON: {e}") from None
        except RecursionError:
            raise RowError(TOO_DEEP, f"{fm.turns!r} is a JSON string nested too deeply") from None
    if not isinstance(turns, Sequence) or isinstance(turns, (str, bytes)):
        raise RowError("bad turns field", f"{fm.turns!r} must be a list, got {type(turns).__name__}")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise RowError("bad turn", f"turn {i} is {type(turn).__name__}, expected an object")
        raw_role = turn.get(fm.role)
        if raw_role not in fm.roles:
            raise RowError("unknown role", f"turn {i}: role {raw_role!r} (known: {sorted(fm.roles)})")
        role = fm.roles[raw_role]
        content = turn.get(fm.content)
        msg: Message
        if role == FUNCTION_CALL:  # ShareGPT: the value is the call (or a list of calls) as JSON
            calls = _json_value(content, f"turn {i} (function_call)")
            msg = {
                "role": "assistant",
                "content": "",
                "tool_calls": calls if isinstance(calls, list) else [calls],
            }
            role = "assistant"
        else:
            if content is None and role == "assistant" and turn.get("tool_calls"):
                content = ""  # OpenAI: content null beside tool calls
            if not isinstance(content, str):
                raise RowError(
                    "non-string content", f"turn {i} ({role}): content is {type(content).__name__}"
                )
            msg = {"role": role, "content": content}
            for key in ("tool_calls", "reasoning_content", "tool_call_id", "name"):
                if turn.get(key) is not None:
                    msg[key] = turn[key]
        if role == "assistant":
            flag = _read_flag(turn.get(fm.flag), i) if fm.flag else None
            msg["loss"] = True
            if flag is not None:
                if fm.flag_means == "train":
                    msg["train"] = flag
                else:
                    msg["loss"] = flag if fm.flag_means == "loss" else not flag
        messages.append(msg)
    tools = row.get(fm.tools) if fm.tools else None
    if tools is not None and messages and isinstance(messages[0], dict):
        messages[0]["tools"] = _json_value(tools, f"{fm.tools!r}")
    rid = row.get(fm.id) if fm.id else None
    return {"id": str(rid) if rid is not None else fallback_id, "messages": validate_messages(messages)}


def _tools(value: Any) -> list[dict[str, Any]]:
    """Function definitions as OpenAI's [{"type": "function", "function": {"name", ...}}]."""
    value = _json_value(value, "tools")
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise RowError(
            "bad tools", f"tools must be a list of function definitions, got {type(value).__name__}"
        )
    out = []
    for j, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(
                "bad tools", f"tool {j}: expected {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        out.append({"type": "function", "function": dict(fn)})
    return out


def _tool_calls(value: Any, where: int, first_id: int) -> list[dict[str, Any]]:
    """Calls as [{"id", "type": "function", "function": {"name", "arguments": dict}}].

    Arguments given as a JSON string are parsed (every family renders them from the object).
    A call without an id gets `callNNNNN` (9 characters: Mistral v3's id rule), numbered within
    the conversation, so the same row always gets the same ids.
    """
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise RowError("bad tool call", f"message {where}: tool_calls must be a non-empty list")
    out = []
    for j, call in enumerate(value):
        if not isinstance(call, Mapping):
            raise RowError("bad tool call", f"message {where}: call {j} is {type(call).__name__}")
        fn = call.get("function", call)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise RowError("bad tool call", f"message {where}: call {j} has no function name")
        args = _json_value(fn.get("arguments", {}), f"message {where}: call {j}'s arguments")
        if args is None or args == "":
            args = {}
        if not isinstance(args, Mapping):
            raise RowError("bad tool call", f"message {where}: call {j}'s arguments must be a JSON object")
        cid = call.get("id")
        if cid is None:
            cid = f"call{first_id + j:05d}"
        if not isinstance(cid, str) or not cid:
            raise RowError("bad tool call", f"message {where}: call {j}'s id must be a string")
        out.append({"id": cid, "type": "function", "function": {"name": name, "arguments": dict(args)}})
    return out


def split_thinking(content: str, reasoning: Any) -> tuple[str, str]:
    """(content, reasoning) of an assistant turn: `reasoning_content`, or the `<think>...</think>`
    block in content, split as Qwen3's template splits it; the reasoning without its surrounding
    newlines and the content without leading ones when there is reasoning (both are markup in
    the rendered turn, "<think>\\nREASONING\\n</think>\\n\\nCONTENT")."""
    if reasoning is None and "</think>" in content:
        parts = content.split("</think>")
        return parts[-1].lstrip("\n"), parts[0].split("<think>")[-1].strip("\n")
    if reasoning is None:
        return content, ""
    if not isinstance(reasoning, str):
        raise RowError("non-string content", f"reasoning_content is {type(reasoning).__name__}")
    reasoning = reasoning.strip("\n")
    return (content.lstrip("\n") if reasoning else content), reasoning


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Check the structure every template relies on; return the messages in canonical form.

    Allowed: an optional system message first, then user / assistant alternating, starting
    with user, with at least one assistant turn. An assistant turn with `tool_calls` is answered
    by one `tool` message per call (in order; `tool_call_id` filled in where missing), after
    which the assistant or the user speaks. Trailing user / tool turns are legal here (an agent
    loop's final observation); the training path trims them (they carry no loss). Idempotent.
    """
    if not isinstance(messages, Sequence) or not messages:
        raise RowError("empty conversation", "no messages")
    out: list[Message] = []
    expected: tuple[str, ...] = ("user",)
    pending: list[dict[str, Any]] = []  # calls of the last assistant turn not yet answered
    n_calls = 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RowError("bad turn", f"message {i} is {type(m).__name__}, expected an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowError("unknown role", f"message {i}: role {role!r} (expected one of {ROLES})")
        if role == "assistant" and content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise RowError("non-string content", f"message {i} ({role}): content is {type(content).__name__}")
        if role == "tool" and not pending:  # a tool role only exists as the answer to a call
            raise RowError("unknown role", f"message {i}: a tool message that answers no tool call")
        if role == "system":
            if i != 0:
                raise RowError("role order", f"message {i}: a system message may only come first")
        elif role not in expected:
            raise RowError(
                "role order",
                f"message {i}: got {role}, expected {' or '.join(expected)} (roles must alternate; "
                "each tool call is answered by one tool message)",
            )
        msg: Message = {"role": role, "content": content}
        if i == 0 and m.get("tools") is not None:
            msg["tools"] = _tools(m["tools"])
        elif m.get("tools") is not None:
            raise RowError("bad tools", f"message {i}: tools may only be given on the first message")
        if role == "assistant":
            loss = m.get("loss", True)
            if loss is None:
                loss = True
            if not isinstance(loss, bool):
                raise RowError("bad loss flag", f"message {i}: loss must be a boolean, got {loss!r}")
            calls = _tool_calls(m["tool_calls"], i, n_calls) if m.get("tool_calls") else []
            n_calls += len(calls)
            content, reasoning = split_thinking(content, m.get("reasoning_content"))
            msg["content"] = content
            if not content.strip() and not calls:
                raise RowError("empty assistant turn", f"message {i}: assistant content is empty")
            msg["loss"] = loss
            trained = m.get("train", True)
            if not isinstance(trained, bool):
                raise RowError("bad loss flag", f"message {i}: train must be a boolean, got {trained!r}")
            if not trained:
                msg["train"] = False
            if m.get("_context"):  # set by ChatTemplate.contexts: rendered as context, never trained
                msg["_context"] = True
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = calls
            pending = list(calls)
            expected = ("tool",) if calls else ("user",)
        elif role == "tool":
            call = pending.pop(0)
            cid = m.get("tool_call_id", call["id"])
            if cid != call["id"]:
                raise RowError(
                    "bad tool call", f"message {i}: tool_call_id {cid!r} does not answer call {call['id']!r}"
                )
            msg["tool_call_id"] = cid
            msg["name"] = m.get("name") or call["function"]["name"]
            expected = ("tool",) if pending else ("assistant", "user")
        elif role == "user":
            expected = ("assistant",)
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise RowError("no assistant turn", "a trajectory needs at least one assistant turn")
    return out


def trim_trailing_users(messages: list[Message]) -> tuple[list[Message], int]:
    """Drop user / tool turns after the last assistant turn (no loss, nothing to learn)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[: last + 1], len(messages) - last - 1


def assistant_categories(messages: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """Category per message (None for system/user).

    An untrained turn neither is a mistake nor ends one: an error, then an untrained turn,
    then a trained turn makes that trained turn the refinement.
    """
    cats: list[str | None] = []
    after_error = False
    for m in messages:
        if m["role"] != "assistant":
            cats.append(None)
        elif m.get("train", True) is False:
            cats.append(UNTRAINED)
        elif not m.get("loss", True):
            cats.append("erroneous")
            after_error = True
        else:
            cats.append("refinement" if after_error else "correct")
            after_error = False
    return cats


def check_loss_on(loss_on: Collection[str]) -> frozenset[str]:
    if isinstance(loss_on, str):
        loss_on = [s.strip() for s in loss_on.split(",") if s.strip()]
    chosen = frozenset(loss_on)
    bad = chosen - set(CATEGORIES)
    if bad or not chosen:
        raise ValueError(f"loss_on must be a non-empty subset of {CATEGORIES}, got {sorted(loss_on)}")
    return chosen


def drop_refinement_data(messages: list[Message]) -> tuple[list[Message], int]:
    """Table 2's "w/o refinement data": remove every erroneous assistant turn together with the
    user turn right after it, or the tool messages answering its calls (the environment's error
    feedback).

    The refinement turn then directly follows the observation the mistake was made on, i.e.
    the trajectory reads as if the agent had acted correctly first time; it is then an
    ordinary `correct` turn. Returns the new messages and the number of turns removed.
    """
    out: list[Message] = []
    removed = 0
    skip_next_user = False
    skip_tools = False
    for m in messages:
        if m["role"] == "assistant" and not m.get("loss", True) and m.get("train", True) is not False:
            removed += 1
            skip_tools = bool(m.get("tool_calls"))
            skip_next_user = not skip_tools
            continue
        if skip_tools and m["role"] == "tool":
            removed += 1
            continue
        if skip_next_user and m["role"] == "user":
            removed += 1
            skip_next_user = False
            continue
        skip_next_user = skip_tools = False
        out.append(m)
    return out, removed
