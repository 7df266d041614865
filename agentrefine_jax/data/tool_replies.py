"""A model's reply read back as OpenAI tool calls, one parser per family's tool format, each the
inverse of the renderer in templates.py that trained it (inference reads exactly what training taught).

`llama3_json` - Llama-3.1's JSON tool calls (`templates.llama3_tool_call`): the turn's content, then
                each call as {"type": "function", "name", "parameters"}; a reply that is only a call
                reads as Meta's `ChatFormat.decode_assistant_message_from_content` reads it.
`mistral_v3`  - v3's [TOOL_CALLS] (`templates.mistral_tool_call`): the content, then the control
                token and a JSON list of {"name", "arguments"[, "id"]}; split on the token's id as
                mistral-common's `experimental.tools` does (the token is special: decoded text loses it).
`hermes`      - Qwen's <tool_call> (the directory's chat template, rendered by `HFDirTemplate`):
                <tool_call>\\n{"name", "arguments"}\\n</tool_call> blocks after the content, read as
                transformers' response schema for Qwen reads them (whitespace before a block is markup).

A reply whose call text does not parse (broken JSON, an unclosed block, a call of a function the
request did not offer) is returned whole as content with the reason in `error`: the caller counts
it and answers plain text, never an error of its own.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

LLAMA3_JSON, MISTRAL_V3, HERMES = "llama3_json", "mistral_v3", "hermes"
TOOL_FORMATS = (LLAMA3_JSON, MISTRAL_V3, HERMES)


@dataclasses.dataclass(frozen=True)
class ToolReply:
    """`content`: the reply's text outside its calls; `calls`: [{"name", "arguments": dict, "id"?}]
    ("id" only where the format carries one); `error`: why call text was not read (then `content` is
    the whole reply and `calls` is empty)."""

    content: str
    calls: list[dict[str, Any]]
    error: str | None = None


def tool_format(template: Any) -> str | None:
    """The tool format a chat template (templates.get_template) renders, or None when it renders none
    (an `hf` directory whose template ignores `tools`, as SmolLM2's does)."""
    if template.name == "llama3":
        return LLAMA3_JSON
    if template.name == "mistral":
        return MISTRAL_V3
    source = getattr(template.tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("default")
    if isinstance(source, str) and "<tool_call>" in source and "tools" in source:
        return HERMES
    return None


def parse_tool_reply(
    fmt: str, text: str, ids: Sequence[int], template: Any, offered: Collection[str]
) -> ToolReply:
    """Read the reply (`text` as decoded, `ids` the generated ids without the end token) in `fmt`;
    `offered`: the function names the request offered (a call of another is malformed)."""
    if fmt == MISTRAL_V3:
        reply = _mistral(text, ids, template)
    elif fmt == LLAMA3_JSON:
        reply = _llama3(text)
    elif fmt == HERMES:
        reply = _hermes(text)
    else:
        raise ValueError(f"unknown tool format {fmt!r}; choose from {TOOL_FORMATS}")
    unknown = [c["name"] for c in reply.calls if c["name"] not in offered]
    if unknown:
        return ToolReply(text, [], f"a call of {unknown[0]!r}, a function the request did not offer")
    return reply


def _call(value: Any, args_key: str) -> dict[str, Any] | None:
    """{"name", "arguments"} of one call object, or None when it is not one."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get(args_key, {})
    if not isinstance(args, Mapping):
        return None
    call = {"name": value["name"], "arguments": dict(args)}
    if isinstance(value.get("id"), str) and value["id"] and value["id"] != "null":
        call["id"] = value["id"]
    return call


# ------------------------------------------------------------------ Llama-3.1 JSON

# Where a call object may start: {"type": ... or {"name": ... (Meta's decoder accepts either).
_LLAMA_START = re.compile(r'\{\s*"(?:type|name)"\s*:')
_DECODER = json.JSONDecoder()


def _llama3_calls(text: str, start: int) -> list[dict[str, Any]] | None:
    """The call objects that make up text[start:] (whitespace between and after), or None."""
    calls, pos = [], start
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        if isinstance(value, Mapping) and value.get("type", "function") != "function":
            return None
        call = _call(value, "parameters")
        if call is None:
            return None
        calls.append(call)


def _llama3(text: str) -> ToolReply:
    # The content is everything before the first position from which the rest is calls only:
    # the renderer writes content and calls back to back, with nothing between.
    starts = [m.start() for m in _LLAMA_START.finditer(text)]
    for start in starts:
        calls = _llama3_calls(text, start)
        if calls is not None:
            return ToolReply(text[:start], calls)
    if starts and '"parameters"' in text[starts[-1] :]:
        return ToolReply(text, [], "call text that is not a JSON call object")
    return ToolReply(text, [])


# ------------------------------------------------------------------ Mistral v3


def _mistral(text: str, ids: Sequence[int], template: Any) -> ToolReply:
    marker = template.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    if marker not in ids:
        return ToolReply(text, [])
    first = list(ids).index(marker)
    content = template.decode(ids[:first])
    segments: list[list[int]] = []
    for t in ids[first:]:
        if t == marker:
            segments.append([])
        else:
            segments[-1].append(t)
    calls = []
    for seg in segments:  # each [TOOL_CALLS] opens a JSON list of calls (mistral-common v2-v7)
        body = template.decode(seg)
        try:
            values = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return ToolReply(text, [], "[TOOL_CALLS] is not followed by a JSON list")
        if not isinstance(values, list) or not values:
            return ToolReply(text, [], "[TOOL_CALLS] is not followed by a list of calls")
        for value in values:
            call = _call(value, "arguments")
            if call is None:
                return ToolReply(text, [], "a [TOOL_CALLS] entry is not {name, arguments: object}")
            calls.append(call)
    return ToolReply(content, calls)


# ------------------------------------------------------------------ Hermes (Qwen)

_HERMES_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes(text: str) -> ToolReply:
    if "<tool_call>" not in text:
        return ToolReply(text, [])
    calls = []
    for m in _HERMES_BLOCK.finditer(text):
        try:
            value = json.loads(m.group(1))
        except (json.JSONDecodeError, RecursionError):
            return ToolReply(text, [], "a <tool_call> block that is not JSON")
        if isinstance(value, Mapping) and isinstance(value.get("arguments"), str):
            try:  # some models write the arguments as a JSON string, as OpenAI's wire does
                value = {**value, "arguments": json.loads(value["arguments"])}
            except (json.JSONDecodeError, RecursionError):
                return ToolReply(text, [], "a <tool_call> whose arguments string is not JSON")
        call = _call(value, "arguments")
        if call is None:
            return ToolReply(text, [], 'a <tool_call> block that is not {"name", "arguments": object}')
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in content or "</tool_call>" in content:
        return ToolReply(text, [], "an unclosed <tool_call> block")
    return ToolReply(content, calls)
