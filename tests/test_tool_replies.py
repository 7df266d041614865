"""A model's reply read back as OpenAI tool calls, per family, on exactly the text the vendors render.

Oracles: Meta's ChatFormat (llama_models) renders the Llama-3.1 call turn and its
`decode_assistant_message_from_content` reads a call-only reply; mistral-common's v3 instruct tokenizer
renders the [TOOL_CALLS] turn and its `experimental.tools` decoder reads it back; transformers'
apply_chat_template(tools=...) with the Qwen2.5 template renders the Hermes turn and
`tokenizer.parse_response` with transformers' own Qwen response schema reads it back. Our parser must
give the calls the oracle rendered and the oracle reads. The response assembly on top is
tests/test_serve_tools.py.
"""

from __future__ import annotations

import json

import pytest
import transformers
from hf_fixtures import QWEN25_TEMPLATE, qwen_tokenizer
from llama_models.datatypes import RawMessage, StopReason, ToolCall, ToolPromptFormat
from llama_models.llama3.chat_format import ChatFormat
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from mistral_common.experimental.tools import _decode_tool_calls, _split_content_and_tool_calls
from mistral_common.protocol.instruct.messages import AssistantMessage
from mistral_common.protocol.instruct.tool_calls import FunctionCall
from mistral_common.protocol.instruct.tool_calls import ToolCall as MistralToolCall
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from agentrefine_jax.data.react_tools import ACT_TOOL
from agentrefine_jax.data.templates import get_template
from agentrefine_jax.data.tokenizers import load_tokenizer, mistral_v3_model_path
from agentrefine_jax.data.tool_replies import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL_V3,
    ToolReply,
    parse_tool_reply,
    tool_format,
)

# Two calls, one with a list, a number and non-ASCII arguments (as deep as Meta's ToolCall allows):
# what the parsers must give back exactly.
CALLS = [
    {"name": "act", "arguments": {"command": "go to kitchen"}},
    {"name": "search", "arguments": {"query": 'mug 😀 "blue"', "rooms": ["kitchen", "hall"], "n": 2}},
]
OFFERED = {"act", "search"}
CONTENT = "The mug is in the kitchen."


def openai_calls(calls, ids=("c0a1b2c3d", "c1a1b2c3d")):
    return [
        {"id": i, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for i, c in zip(ids, calls, strict=False)
    ]


def names_args(calls):
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


# ------------------------------------------------------------------ Llama-3.1 JSON


@pytest.fixture(scope="module")
def llama():
    return get_template("llama3", load_tokenizer("llama3"))


def _meta_turn(calls, content=""):
    """The assistant turn's generated ids as Meta's ChatFormat renders it: after the header, up to
    (without) <|eom_id|>."""
    cf = ChatFormat(MetaTokenizer.get_instance())
    raw = RawMessage(
        role="assistant",
        content=content,
        tool_calls=[
            ToolCall(call_id=f"c{i}", tool_name=c["name"], arguments=c["arguments"])
            for i, c in enumerate(calls)
        ],  # fmt: skip
        stop_reason=StopReason.end_of_message,
    )
    toks, _ = cf.encode_message(raw, ToolPromptFormat.json)
    header = len(cf._encode_header("assistant"))
    assert toks[-1] == cf.tokenizer.special_tokens["<|eom_id|>"]
    return cf, toks[header:-1]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("content", ["", CONTENT])
def test_llama31_reads_the_calls_meta_renders(llama, n, content):
    cf, ids = _meta_turn(CALLS[:n], content)
    text = llama.decode(ids)
    reply = parse_tool_reply(LLAMA3_JSON, text, ids, llama, OFFERED)
    assert reply.error is None
    assert reply.calls == CALLS[:n] and reply.content == content
    if n == 1 and not content:  # what Meta's own decoder reads of a call-only reply
        meta = cf.decode_assistant_message_from_content(text, StopReason.end_of_message)
        assert [(c.tool_name, c.arguments) for c in meta.tool_calls] == [
            (c["name"], c["arguments"]) for c in reply.calls
        ]


def test_llama31_text_and_malformed_calls(llama):
    plain = 'I think {"a": 1} is JSON, but no call.'
    assert parse_tool_reply(LLAMA3_JSON, plain, [], llama, OFFERED) == ToolReply(plain, [])
    broken = 'Going. {"type": "function", "name": "act", "parameters": {"command": "go"}'
    reply = parse_tool_reply(LLAMA3_JSON, broken, [], llama, OFFERED)
    assert reply.calls == [] and reply.content == broken and "not a JSON call" in reply.error
    other = '{"type": "function", "name": "rm", "parameters": {}}'
    reply = parse_tool_reply(LLAMA3_JSON, other, [], llama, OFFERED)
    assert reply.calls == [] and reply.content == other and "'rm'" in reply.error


# ------------------------------------------------------------------ Mistral v3


@pytest.fixture(scope="module")
def mistral():
    return get_template("mistral", load_tokenizer("mistral"))


@pytest.fixture(scope="module")
def vendor():
    return MistralTokenizer.from_file(str(mistral_v3_model_path()), mode=ValidationMode.finetuning)


@pytest.mark.parametrize("n", [1, 2])
def test_mistral_v3_reads_the_calls_mistral_common_renders(mistral, vendor, n):
    message = AssistantMessage(
        tool_calls=[
            MistralToolCall(
                id=c["id"],
                function=FunctionCall(
                    name=c["function"]["name"], arguments=json.dumps(c["function"]["arguments"])
                ),
            )  # fmt: skip
            for c in openai_calls(CALLS[:n])
        ]
    )
    toks = vendor.instruct_tokenizer.encode_assistant_message(message, False)
    assert toks[-1] == mistral.eos
    ids = toks[:-1]
    reply = parse_tool_reply(MISTRAL_V3, mistral.decode(ids), ids, mistral, OFFERED)
    assert reply.error is None and reply.content == ""
    assert names_args(reply.calls) == CALLS[:n]
    assert [c["id"] for c in reply.calls] == ["c0a1b2c3d", "c1a1b2c3d"][:n]  # the model's ids, kept
    # mistral-common's own decoder on the same tokens
    tc = vendor.instruct_tokenizer.tokenizer.get_special_token("[TOOL_CALLS]")
    content, segments = _split_content_and_tool_calls(ids, tc)
    theirs = _decode_tool_calls(segments, vendor.instruct_tokenizer.tokenizer)
    assert content == [] and [(c.id, c.function.name, json.loads(c.function.arguments)) for c in theirs] == [
        (c["id"], c["name"], c["arguments"]) for c in reply.calls
    ]


def test_mistral_content_beside_calls_and_malformed(mistral):
    """Our renderer's content-then-[TOOL_CALLS] turn (mistral-common's order from v7 on) reads back whole."""
    row = [
        {"role": "user", "content": "Task: take the mug.", "tools": [ACT_TOOL]},
        {"role": "assistant", "content": CONTENT, "tool_calls": openai_calls(CALLS[:1])},
    ]
    ids, mask = mistral.encode(row)
    turn = [t for t, m in zip(ids, mask, strict=True) if m][:-1]  # the trained turn, without </s>
    reply = parse_tool_reply(MISTRAL_V3, mistral.decode(turn), turn, mistral, {"act"})
    assert reply.error is None and reply.content == CONTENT and names_args(reply.calls) == CALLS[:1]
    tc = mistral.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    bad = [tc, *mistral.encode_text(['[{"name": "act", "arguments": {"command": "go"}'])[0]]
    reply = parse_tool_reply(MISTRAL_V3, mistral.decode(bad), bad, mistral, {"act"})
    assert reply.calls == [] and reply.content == mistral.decode(bad) and "JSON list" in reply.error


# ------------------------------------------------------------------ Hermes (Qwen2.5)


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen25")
    qwen_tokenizer(out, [CONTENT, json.dumps(CALLS), "Task: take the mug."], QWEN25_TEMPLATE)
    return out


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("content", ["", CONTENT])
def test_hermes_reads_the_calls_apply_chat_template_renders(qwen25_dir, n, content):
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    tok = transformers.AutoTokenizer.from_pretrained(qwen25_dir)
    ours = get_template("hf", load_tokenizer(str(qwen25_dir)))
    assert tool_format(ours) == HERMES
    tools = [ACT_TOOL]
    prompt = [{"role": "user", "content": "Task: take the mug."}]
    turn = {"role": "assistant", "content": content, "tool_calls": openai_calls(CALLS[:n])}
    before = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template([*prompt, turn], tools=tools, tokenize=False)
    assert full.startswith(before)
    text = full[len(before) : full.index("<|im_end|>", len(before))]  # what the model generates
    reply = parse_tool_reply(HERMES, text, [], ours, OFFERED)
    assert reply.error is None and reply.calls == CALLS[:n] and reply.content == content
    schema = next(v for k, v in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen2" in k)
    theirs = tok.parse_response(text + "<|im_end|>", schema, prefix=before)
    assert [c["function"] for c in theirs["tool_calls"]] == reply.calls
    assert theirs.get("content", "") == reply.content


def test_hermes_malformed_call_text(qwen25_dir):
    ours = get_template("hf", load_tokenizer(str(qwen25_dir)))
    for text, why in [
        ('<tool_call>\n{"name": "act", "arguments": {"command": "go"}\n</tool_call>', "not JSON"),
        ('<tool_call>\n{"name": "act", "arguments": {"command": "go"}}', "unclosed"),
        ('<tool_call>\n{"name": "act", "arguments": ["go"]}\n</tool_call>', "not {"),
        ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', "'rm'"),
    ]:
        reply = parse_tool_reply(HERMES, text, [], ours, OFFERED)
        assert reply.calls == [] and reply.content == text and why in reply.error, (text, reply)
