"""Tool-call rows and Qwen3 thinking turns, token for token against the vendors.

Oracles: Meta's ChatFormat (llama_models) for Llama-3.1's JSON tool calls, mistral-common's v3
instruct tokenizer for [TOOL_CALLS], transformers' apply_chat_template with a Qwen2.5 / Qwen3
template (tests/hf_fixtures.py) for Hermes <tool_call> and thinking. Expected masks come from the
oracles' per-message encodings (Llama, Mistral) or from rendering turn by turn (Qwen): what
inference produces after the prompt apply_chat_template renders for messages[:k].
"""

from __future__ import annotations

import copy
import json

import pytest
import transformers
from hf_fixtures import DEMO, QWEN3_TEMPLATE, QWEN25_TEMPLATE, demo_conversations, qwen_tokenizer
from llama_models.datatypes import RawMessage, StopReason, ToolCall, ToolPromptFormat
from llama_models.llama3.chat_format import ChatFormat
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool
from mistral_common.protocol.instruct.tool_calls import ToolCall as MistralToolCall
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from agentrefine_jax.data.examples import build_examples
from agentrefine_jax.data.preference import CHOSEN, REJECTED, PairReport, build_pairs, trajectory_pairs
from agentrefine_jax.data.react_tools import ACT_TOOL, react_to_tool_row, tool_row_to_react
from agentrefine_jax.data.report import DataReport
from agentrefine_jax.data.schema import RowError, normalize_row, resolve_field_map
from agentrefine_jax.data.templates import get_template, llama3_tools_system
from agentrefine_jax.data.tokenizers import load_tokenizer, mistral_v3_model_path

SYSTEM = "You are an agent in a household. Act with the act function."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "act",
            "description": "Run one command in the environment (e.g. 'go to kitchen').",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command"}},
                "required": ["command"],
            },
        },
    }
]


def call(cid: str, command: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "act", "arguments": {"command": command}}}


# An OpenAI tool-call trajectory; categories written out by hand: 2 correct, 4 erroneous, 6 refinement,
# 8 correct. Turn 2 has content AND a call (they train together).
TRAJ = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Task: take the mug 😀 from the kitchen table."},
    {
        "role": "assistant",
        "content": "The mug is in the kitchen.",
        "tool_calls": [call("c0a1b2c3d", "go to kitchen")],
    },
    {"role": "tool", "tool_call_id": "c0a1b2c3d", "content": "You arrive at the kitchen. You see a mug 1."},
    {"role": "assistant", "content": "", "tool_calls": [call("c1a1b2c3d", "grab mug")], "loss": False},
    {"role": "tool", "tool_call_id": "c1a1b2c3d", "content": "Nothing happens. 'grab mug' is not valid."},
    {"role": "assistant", "content": "", "tool_calls": [call("c2a1b2c3d", "take mug 1 from table 1")]},
    {"role": "tool", "tool_call_id": "c2a1b2c3d", "content": '{"observation": "You pick up the mug 1."}'},
    {"role": "assistant", "content": "Done: I hold the mug."},
]
CATEGORIES = {2: "correct", 4: "erroneous", 6: "refinement", 8: "correct"}
MODES = {
    "eq1": ("correct", "refinement"),
    "no_refinement_loss": ("correct",),
    "erroneous_loss": ("correct", "refinement", "erroneous"),
}
ALL = MODES["erroneous_loss"]


def row(messages=TRAJ, tools=TOOLS) -> list[dict]:
    """The trajectory as the data pipeline reads it: arguments as JSON strings (OpenAI's wire
    format), content null beside calls, the tools at the row level."""
    msgs = copy.deepcopy(messages)
    for m in msgs:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        if m.get("tool_calls") and not m["content"]:
            m["content"] = None
    return normalize_row({"messages": msgs, "tools": tools}, None, "r")["messages"]


# ------------------------------------------------------------------ Llama-3.1


@pytest.fixture(scope="module")
def llama():
    return get_template("llama3", load_tokenizer("llama3"))


def _meta_reference(messages, loss_on, cats=CATEGORIES):
    cf = ChatFormat(MetaTokenizer.get_instance())
    ids, mask = [cf.tokenizer.special_tokens["<|begin_of_text|>"]], [0]
    for i, m in enumerate(messages):
        content = llama3_tools_system(m["content"], TOOLS) if i == 0 else m["content"]
        calls = [
            ToolCall(call_id=c["id"], tool_name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in m.get("tool_calls", [])
        ]
        stop = StopReason.end_of_message if calls else StopReason.end_of_turn
        raw = RawMessage(role=m["role"], content=content, tool_calls=calls, stop_reason=stop)
        toks, _ = cf.encode_message(raw, ToolPromptFormat.json)
        header = len(cf._encode_header(m["role"]))
        ids += toks
        mask += [0] * header + [int(cats.get(i) in loss_on)] * (len(toks) - header)
    return ids, mask


@pytest.mark.parametrize("mode", MODES)
def test_llama31_tool_calls_match_chat_format_with_masks(llama, mode):
    ids, mask = llama.encode(row(), MODES[mode])
    want_ids, want_mask = _meta_reference(TRAJ, MODES[mode])
    assert ids == want_ids
    assert mask == want_mask
    eom = llama.tokenizer.convert_tokens_to_ids("<|eom_id|>")
    assert ids.count(eom) == 3  # one per tool-calling turn; the final answer ends with <|eot_id|>
    ipython = llama.encode_text(["ipython"])[0]
    assert sum(ids[i : i + len(ipython)] == ipython for i in range(len(ids))) == 3
    # The prompt after a tool result is what training saw before the next turn.
    prompt = llama.encode_prompt(row()[:4])
    assert prompt == want_ids[: len(prompt)]


def test_preference_pairs_on_tool_rows(llama):
    """The erroneous call against the refined one, each after the same prompt (the call and its
    error result are not in it): exactly the vendor's encoding of prompt + reply."""
    report = PairReport()
    pairs = trajectory_pairs(row(), "r", report)
    assert len(pairs) == 1 and pairs[0].prompt == row()[:4]
    assert pairs[0].rejected_extra["tool_calls"][0]["function"]["arguments"] == {"command": "grab mug"}
    store = build_pairs(pairs, llama, 4096, report)
    for example, reply, bit in ((0, 6, CHOSEN), (1, 4, REJECTED)):
        ids, mask = store.example(example)
        want_ids, want_mask = _meta_reference(TRAJ[:4] + [TRAJ[reply]], ("correct",), {4: "correct"})
        assert ids.tolist() == want_ids
        assert mask.tolist() == [bit * b for b in want_mask]


# ------------------------------------------------------------------ Mistral v3


@pytest.fixture(scope="module")
def mistral():
    return get_template("mistral", load_tokenizer("mistral"))


def _mistral_traj():
    """v3 refuses content beside calls: the calling turns here carry calls only."""
    return [{**m, "content": ""} if m.get("tool_calls") else m for m in TRAJ]


def _mistral_reference(messages, loss_on):
    vendor = MistralTokenizer.from_file(str(mistral_v3_model_path()), mode=ValidationMode.finetuning)
    chat = []
    for m in messages:
        if m["role"] == "system":
            chat.append(SystemMessage(content=m["content"]))
        elif m["role"] == "user":
            chat.append(UserMessage(content=m["content"]))
        elif m["role"] == "tool":
            chat.append(ToolMessage(content=m["content"], tool_call_id=m["tool_call_id"]))
        elif m.get("tool_calls"):
            calls = [
                MistralToolCall(
                    id=c["id"],
                    function=FunctionCall(
                        name=c["function"]["name"], arguments=json.dumps(c["function"]["arguments"])
                    ),
                )
                for c in m["tool_calls"]
            ]
            chat.append(AssistantMessage(tool_calls=calls))
        else:
            chat.append(AssistantMessage(content=m["content"]))
    tools = [Tool(function=Function(**t["function"])) for t in TOOLS]
    full = vendor.encode_chat_completion(ChatCompletionRequest(messages=chat, tools=tools)).tokens
    # Each assistant message's own vendor encoding, found in order in the full encoding.
    mask, pos = [0] * len(full), 0
    it = vendor.instruct_tokenizer
    for i, (m, msg) in enumerate(zip(messages, chat, strict=True)):
        if m["role"] != "assistant":
            continue
        toks = it.encode_assistant_message(msg, False)
        start = next(p for p in range(pos, len(full)) if full[p : p + len(toks)] == toks)
        mask[start : start + len(toks)] = [int(CATEGORIES.get(i) in loss_on)] * len(toks)
        pos = start + len(toks)
    return full, mask


@pytest.mark.parametrize("mode", MODES)
def test_mistral_v3_tool_calls_match_mistral_common_with_masks(mistral, mode):
    traj = _mistral_traj()
    ids, mask = mistral.encode(row(traj), MODES[mode])
    want_ids, want_mask = _mistral_reference(traj, MODES[mode])
    assert ids == want_ids
    assert mask == want_mask
    assert ids.count(mistral.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")) == 3


def test_mistral_content_beside_calls_keeps_the_content(mistral):
    """Content and calls of one turn train together: content, then [TOOL_CALLS] (mistral-common's
    order from v7 on; v3 itself refuses the pair)."""
    with_content, calls_only = mistral.encode(row(), ALL), mistral.encode(row(_mistral_traj()), ALL)
    text = mistral.encode_text(["The mug is in the kitchen."])[0]
    tc = mistral.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    at = calls_only[0].index(tc)
    assert with_content[0] == calls_only[0][:at] + text + calls_only[0][at:]
    assert with_content[1] == calls_only[1][:at] + [1] * len(text) + calls_only[1][at:]


# ------------------------------------------------------------------ Qwen (Hermes <tool_call>, thinking)


def _qwen_dir(tmp_path_factory, name, template):
    out = tmp_path_factory.mktemp(name)
    texts = [m["content"] for c in demo_conversations() for m in c] + [json.dumps(TOOLS), json.dumps(TRAJ)]
    qwen_tokenizer(out, texts, template)
    return out


@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory):
    return _qwen_dir(tmp_path_factory, "qwen25", QWEN25_TEMPLATE)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return _qwen_dir(tmp_path_factory, "qwen3", QWEN3_TEMPLATE)


def _apply(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)


def check_turn_by_turn(ours, tok, messages, oracle_messages, loss_on=ALL, **kw):
    """Every trained turn k, in the example `contexts` puts it in: the tokens before it are the
    prompt apply_chat_template renders for messages[:k] (add_generation_prompt), and its trained
    tokens are what rendering messages[:k+1] adds after that prompt, up to the end token.
    Returns the number of examples."""
    examples = ours.encode_contexts(messages, loss_on)
    runs = []  # (example, start, end) of each run of trained tokens, in order
    for e, (_, mask) in enumerate(examples):
        j = 0
        while j < len(mask):
            if mask[j]:
                start = j
                while j < len(mask) and mask[j]:
                    j += 1
                runs.append((e, start, j))
            j += 1
    trained = [k for k, c in sorted(CATEGORIES.items()) if c in loss_on and k < len(messages)]
    assert len(runs) == len(trained)
    for k, (e, start, end) in zip(trained, runs, strict=True):
        prompt = _apply(tok, oracle_messages[:k], add_generation_prompt=True, **kw)
        upto = _apply(tok, oracle_messages[: k + 1], **kw)
        assert upto[: len(prompt)] == prompt
        completion = upto[len(prompt) : upto.index(tok.eos_token_id, len(prompt)) + 1]
        ids = examples[e][0]
        assert ids[:start] == prompt, f"turn {k}: the context is not the inference prompt"
        assert ids[start:end] == completion, f"turn {k}: trained ids differ from what inference produces"
    return len(examples)


def test_qwen25_hermes_tool_calls_match_apply_chat_template(qwen25_dir):
    tok = transformers.AutoTokenizer.from_pretrained(qwen25_dir)
    ours = get_template("hf", load_tokenizer(str(qwen25_dir)))
    for mode in MODES.values():
        ids, mask = ours.encode(row(), mode)
        assert ids == _apply(tok, TRAJ, tools=TOOLS)  # the whole trajectory in one render
        assert check_turn_by_turn(ours, tok, row(), TRAJ, mode, tools=TOOLS) == 1  # append-only: one example
        assert sum(mask) > 0
    assert ours.tokenizer.decode(ids).count('<tool_call>\n{"name": "act"') == 3
    assert ours.encode_prompt(row()[:4]) == _apply(tok, TRAJ[:4], tools=TOOLS, add_generation_prompt=True)


def test_qwen3_tool_calls_turn_by_turn(qwen3_dir):
    """Qwen3 shows a think block on the last turn only when it has no thoughts: a calling turn
    without reasoning renders differently once the trajectory goes on, so it gets its own example."""
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    ours = get_template("hf", load_tokenizer(str(qwen3_dir)))
    for mode in MODES.values():
        n = check_turn_by_turn(ours, tok, row(), TRAJ, mode, tools=TOOLS)
        assert n == sum(c in mode for c in CATEGORIES.values())


# A ReAct trajectory with thoughts: every user turn is a new query, so Qwen3 drops the thoughts of
# all earlier turns. Turn 4 (erroneous) thinks in <think> inside its content.
THINKING = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Task: take the mug.\nObservation: You are in the hall."},
    {
        "role": "assistant",
        "content": "Action: go to kitchen",
        "reasoning_content": "The mug is likely in the kitchen.",
    },
    {"role": "user", "content": "Observation: You see a mug 1 on the table 1."},
    {"role": "assistant", "content": "<think>\nI can grab it.\n</think>\n\nAction: grab mug", "loss": False},
    {"role": "user", "content": "Observation: Nothing happens."},
    {"role": "assistant", "content": "Action: take mug 1 from table 1", "reasoning_content": "\nUse take.\n"},
    {"role": "user", "content": "Observation: You pick up the mug 1."},
    {"role": "assistant", "content": "Action: finish", "reasoning_content": "Done."},
]


@pytest.mark.parametrize("mode", MODES)
def test_qwen3_thinking_trajectory_turn_by_turn(qwen3_dir, mode):
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    ours = get_template("hf", load_tokenizer(str(qwen3_dir)))
    n = check_turn_by_turn(ours, tok, THINKING, THINKING, MODES[mode])
    assert n == sum(c in MODES[mode] for c in CATEGORIES.values())  # one example per trained turn
    # Each example holds the thoughts of its own last turn only.
    for ids, _ in ours.encode_contexts(THINKING, MODES[mode]):
        assert tok.decode(ids).count("<think>") == 1


def test_qwen3_thinking_off_and_single_query_tool_thoughts(qwen3_dir):
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    off = get_template("hf", load_tokenizer(str(qwen3_dir)), enable_thinking=False)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in THINKING]
    plain[4] = {**plain[4], "content": "Action: grab mug"}
    check_turn_by_turn(off, tok, plain, plain, ALL, enable_thinking=False)
    with pytest.raises(RowError) as e:
        off.encode_contexts(THINKING)
    assert e.value.reason == "reasoning"
    # One query, thoughts on every calling turn: Qwen3 keeps them all, the render is append-only.
    ours = get_template("hf", load_tokenizer(str(qwen3_dir)))
    thoughtful = [
        {**m, "reasoning_content": f"thought {i}"} if m["role"] == "assistant" else m
        for i, m in enumerate(TRAJ)
    ]
    assert check_turn_by_turn(ours, tok, row(thoughtful), thoughtful, ALL, tools=TOOLS) == 1


def test_templates_without_thinking_refuse_reasoning(llama, mistral):
    for template in (llama, mistral):
        with pytest.raises(RowError) as e:
            template.encode(THINKING)
        assert e.value.reason == "reasoning"


# ------------------------------------------------------------------ schema


def test_sharegpt_function_call_and_observation_rows():
    """LLaMA-Factory's layout: function_call / observation turns, tools as a JSON string."""
    raw = {
        "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": TRAJ[1]["content"]},
            {
                "from": "function_call",
                "value": json.dumps({"name": "act", "arguments": {"command": "grab mug"}}),
                "loss": False,
            },
            {"from": "observation", "value": "Nothing happens."},
            {
                "from": "function_call",
                "value": json.dumps({"name": "act", "arguments": {"command": "take mug"}}),
            },
            {"from": "observation", "value": "You pick up the mug."},
            {"from": "gpt", "value": "Done."},
        ],
        "tools": json.dumps(TOOLS),
    }
    msgs = normalize_row(raw, resolve_field_map("sharegpt"), "r")["messages"]
    assert msgs[0]["tools"] == TOOLS
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert msgs[2]["tool_calls"] == [call("call00000", "grab mug")] and msgs[2]["loss"] is False
    assert msgs[3]["tool_call_id"] == "call00000" and msgs[5]["tool_call_id"] == "call00001"
    assert normalize_row(raw, None, "r")["messages"] == msgs  # auto-detected as sharegpt


ASKS = [
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "", "tool_calls": [call("a", "x")]},
]


@pytest.mark.parametrize(
    "messages, reason",
    [
        (ASKS + [{"role": "user", "content": "u"}], "role order"),  # a call is answered by a tool message
        (ASKS + [{"role": "tool", "content": "o", "tool_call_id": "b"}], "bad tool call"),
        (
            ASKS[:1]
            + [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "act", "arguments": "[1]"}}],
                }
            ],
            "bad tool call",
        ),
        (ASKS[:1] + [{"role": "assistant", "content": "", "tool_calls": []}], "empty assistant turn"),
        ([{"role": "tool", "content": "o"}, *ASKS], "unknown role"),  # a tool message answering no call
    ],
)
def test_bad_tool_rows(messages, reason):
    with pytest.raises(RowError) as e:
        normalize_row({"messages": messages}, None, "r")
    assert e.value.reason == reason


# ------------------------------------------------------------------ ReAct <-> tool-call rows


def test_react_rows_convert_to_tool_rows_and_back():
    rows = [json.loads(line) for line in DEMO.read_text().splitlines()]
    for raw in rows:
        tool_row = react_to_tool_row(raw)
        assert tool_row["tools"] == [ACT_TOOL]
        assert tool_row_to_react(tool_row) == normalize_row(raw, None, "x")  # byte for byte
    raw = next(r for r in rows if any(m.get("loss") is False for m in r["messages"]))
    tool_row = react_to_tool_row(raw)
    msgs = tool_row["messages"]
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        *["assistant", "tool"] * ((len(msgs) - 3) // 2),
        "assistant",
    ]
    for before, after in zip(raw["messages"], msgs, strict=True):
        if before["role"] == "assistant":
            thought, _, command = before["content"].rpartition("\nAction: ")
            assert after["content"] == thought and after["loss"] == before["loss"]
            assert after["tool_calls"][0]["function"] == {"name": "act", "arguments": {"command": command}}
        else:
            assert after["content"] == before["content"]
    # A turn that is not exactly "Thought\nAction: command" stays text, and so does its answer.
    odd = {
        "messages": [
            {"role": "user", "content": "t"},
            {"role": "assistant", "content": "Action: a\nmore"},
            {"role": "user", "content": "o"},
            {"role": "assistant", "content": "Action: b"},
        ]
    }
    converted = react_to_tool_row(odd)["messages"]
    assert [m["role"] for m in converted] == ["user", "assistant", "user", "assistant"]
    assert "tool_calls" not in converted[1] and converted[3]["tool_calls"][0]["function"]["arguments"] == {
        "command": "b"
    }
    assert tool_row_to_react(react_to_tool_row(odd)) == normalize_row(odd, None, "row")


def test_converted_rows_train_the_calls(llama, qwen25_dir):
    """Converted rows go through the pipeline: the trained tokens of a turn are its thought and call."""
    raw = json.loads(DEMO.read_text().splitlines()[0])
    tool_row = react_to_tool_row(raw)
    for template in (llama, get_template("hf", load_tokenizer(str(qwen25_dir)))):
        report = DataReport()
        store = build_examples(
            [("r", tool_row)], template, loss_on=MODES["eq1"], max_length=4096, report=report
        )
        ids, mask = store.example(0)
        trained = template.decode([t for t, b in zip(ids, mask, strict=True) if b], skip_special_tokens=False)
        assert '"command": "go to kitchen"' in trained and "Observation" not in trained
        assert report.turns["correct"] == sum(m["role"] == "assistant" for m in raw["messages"])


def test_pipeline_and_show_expand_thinking_rows(qwen3_dir, tmp_path, capsys):
    """A row the template does not render append-only becomes one example per render context;
    each turn is counted once, in the example that trains it."""
    from agentrefine_jax.data import cli

    tpl = get_template("hf", load_tokenizer(str(qwen3_dir)))
    report = DataReport()
    store = build_examples(
        [("r", {"messages": THINKING})], tpl, loss_on=MODES["eq1"], max_length=4096, report=report
    )
    want = tpl.encode_contexts(THINKING, MODES["eq1"])
    assert len(store) == len(want) == 3  # turns 2, 6 and 8, each after the prompt inference renders
    for i, (ids, mask) in enumerate(want):
        assert [x.tolist() for x in store.example(i)] == [ids, mask]
    assert dict(report.turns) == {"correct": 2, "erroneous": 1, "refinement": 1}
    path = tmp_path / "thinking.jsonl"
    path.write_text(json.dumps({"messages": THINKING}) + "\n")
    argv = [
        "show",
        "--input",
        str(path),
        "--tokenizer",
        str(qwen3_dir),
        "--template",
        "hf",
        "--color",
        "never",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("== example") == 3 and "context (trained in an earlier example)" in out


def test_train_size_counts_examples_of_split_rows(qwen3_dir, tmp_path):
    """data.train_size is a number of examples, also when the template splits rows into several."""
    from agentrefine_jax.config import DataConfig
    from agentrefine_jax.data.pipeline import build_data

    path = tmp_path / "thinking.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "messages": THINKING}) + "\n" for i in range(3)))
    common = dict(train_files=[str(path)], tokenizer=str(qwen3_dir), template="hf", max_length=1024)
    assert len(build_data(DataConfig(**common), "train").store) == 9  # 3 trained turns a row
    built = build_data(DataConfig(**common, train_size=4), "train")
    assert len(built.store) == built.report.examples == 4
