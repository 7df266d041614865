"""The server takes OpenAI's `tools` and answers `tool_calls` to the real `openai` client; eval drives a
tool-calling endpoint with `--tool-calls`.

End to end: the real model (SmolLM2-135M-Instruct, tests/real_model.py) behind the real server
(`make_server`, the one `serve` runs, on 127.0.0.1; in this process so the model loads once), with
Qwen2.5's Hermes template over SmolLM2's own tokenizer (both ChatML). Asked to repeat a <tool_call>
block, the model itself generates the call (greedy, float32), and the server must read it back as
OpenAI's `tool_calls`. The rendering oracle is transformers' apply_chat_template(tools=...) with the same
directory (the prompt's token count, which the server reports as usage). The parsers of the three
families against the vendors' own renderers and decoders are tests/test_tool_replies.py.

Cost: two compiled shapes serve every request (40 new tokens; prompt buckets 256 and 512: a first
turn, then follow-ups and the eval task's prompts).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import openai
import pytest
import transformers
from hf_fixtures import QWEN25_TEMPLATE

from agentrefine_jax.data.react_tools import ACT_TOOL
from agentrefine_jax.eval.react import parse_action

MODEL = "smol-hermes"
CALL = '<tool_call>\n{"name": "act", "arguments": {"command": "look"}}\n</tool_call>'
# SmolLM2 repeats the text it is asked to repeat (checked: greedy, float32).
REPEAT = "Repeat exactly this text and nothing else:\n"
ASK = [
    {"role": "system", "content": "You are an agent in a text world."},
    {"role": "user", "content": REPEAT + CALL},
]
OTHER_TOOL = {"type": "function", "function": {"name": "wait", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def hermes_dir(smollm2_dir, tmp_path_factory) -> pathlib.Path:
    """SmolLM2's tokenizer with Qwen2.5's Hermes tool template (tests/hf_fixtures.py)."""
    out = tmp_path_factory.mktemp("smol-hermes")
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = QWEN25_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def generator(smollm2_dir, hermes_dir):
    from agentrefine_jax.inference.chat import ChatGenerator

    return ChatGenerator.from_checkpoint(
        str(smollm2_dir), template="hf", tokenizer=str(hermes_dir), dtype="float32"
    )


@pytest.fixture(scope="module")
def server(generator):
    """The server on a free loopback port (in this process: the model loads once); yields (base URL,
    the server's log lines)."""
    from agentrefine_jax.inference.server import ChatService, make_server

    lines: list[str] = []
    srv = make_server(ChatService(generator, model_name=MODEL, log=lines.append), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", lines
    srv.shutdown()
    srv.server_close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)


def prompt_tokens(hermes_dir, messages, tools) -> int:
    """transformers' render of the prompt, in tokens (arguments as objects, as templates take them)."""
    tok = transformers.AutoTokenizer.from_pretrained(hermes_dir)

    def parsed(c: dict) -> dict:
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    msgs = [
        {**m, "tool_calls": [parsed(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages
    ]
    return len(
        tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def test_server_returns_tool_calls_to_the_openai_client(server, hermes_dir):
    url, log = server
    c = client(url)
    kw = dict(model=MODEL, max_tokens=40, temperature=0)
    resp = c.chat.completions.create(messages=ASK, tools=[ACT_TOOL], **kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "act" and call.id
    assert json.loads(call.function.arguments) == {"command": "look"}
    assert resp.usage.prompt_tokens == prompt_tokens(hermes_dir, ASK, [ACT_TOOL])

    # The next turn carries the call and its result (multi-turn): rendered as the template renders them.
    turn = choice.message.model_dump(exclude_none=True)
    follow = [*ASK, turn, {"role": "tool", "tool_call_id": call.id, "content": "You see a mug."}]
    again = c.chat.completions.create(messages=follow, tools=[ACT_TOOL], **kw)
    assert again.usage.prompt_tokens == prompt_tokens(hermes_dir, follow, [ACT_TOOL])

    # A named function: only it is offered (the prompt is rendered with it alone), and it is read back.
    act = {"type": "function", "function": {"name": "act"}}
    named = c.chat.completions.create(messages=ASK, tools=[OTHER_TOOL, ACT_TOOL], tool_choice=act, **kw)
    assert named.usage.prompt_tokens == resp.usage.prompt_tokens
    assert [t.function.name for t in named.choices[0].message.tool_calls] == ["act"]

    # tool_choice "none": the same reply, as text (the server reads no calls).
    none = c.chat.completions.create(messages=ASK, tools=[ACT_TOOL], tool_choice="none", **kw)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == CALL


def test_malformed_call_text_comes_back_as_content(server):
    """Call text that does not parse is answered as content (the reply tool_choice "none" gets: the
    same greedy generation, unread), counted in the log, never an error."""
    url, log = server
    messages = [ASK[0], {"role": "user", "content": REPEAT + CALL.replace("}}", "}")}]  # broken JSON
    kw = dict(model=MODEL, messages=messages, tools=[ACT_TOOL], max_tokens=40, temperature=0)
    resp = client(url).chat.completions.create(**kw)
    unread = client(url).chat.completions.create(**kw, tool_choice="none")
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == unread.choices[0].message.content
    assert choice.message.content.startswith("<tool_call>\n{")
    assert any("answered as content (1 such replies so far)" in line for line in log), log


def test_tool_requests_refused_in_one_line(server):
    c = client(server[0])
    kw = dict(model=MODEL, messages=ASK, max_tokens=4)
    for extra, match in [
        (dict(tools=[ACT_TOOL], tool_choice="required"), "tool_choice 'required' is not supported"),
        (dict(tools=[ACT_TOOL], stream=True), "stream=true with tools is not supported"),
        (
            dict(tools=[ACT_TOOL], tool_choice={"type": "function", "function": {"name": "x"}}),
            "not in 'tools'",
        ),
        (dict(tool_choice="auto"), "'tool_choice' needs 'tools'"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "unique name of 1-64"),
        (dict(tools=[ACT_TOOL, ACT_TOOL]), "unique name"),
        (dict(extra_body={"functions": [ACT_TOOL["function"]]}), "legacy form"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match) as e:
            c.chat.completions.create(**kw, **extra)
        assert "\n" not in e.value.body["message"]
    broken = {"id": "c1", "type": "function", "function": {"name": "act", "arguments": "{not json"}}
    bad_args = [*ASK, {"role": "assistant", "tool_calls": [broken]}]
    with pytest.raises(
        openai.BadRequestError, match=r"messages\[2\].tool_calls\[0\].arguments is not a JSON"
    ):
        c.chat.completions.create(model=MODEL, messages=bad_args, tools=[ACT_TOOL])
    unanswered = [*ASK, {"role": "tool", "tool_call_id": "c9", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="answers no tool call"):
        c.chat.completions.create(model=MODEL, messages=unanswered, tools=[ACT_TOOL], max_tokens=4)


def test_a_template_without_tools_refuses_them(generator, smollm2_dir):
    """SmolLM2's own ChatML template ignores `tools`: the request is refused, never silently dropped."""
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer
    from agentrefine_jax.inference.chat import ChatGenerator
    from agentrefine_jax.inference.server import APIError, ChatService

    chatml = ChatGenerator(generator.model, get_template("hf", load_tokenizer(str(smollm2_dir))), name="m")
    service = ChatService(chatml, log=lambda _: None)
    body = {"model": "m", "messages": ASK, "tools": [ACT_TOOL]}
    with pytest.raises(APIError, match=r"chat template \(hf\) renders no tools") as e:
        service.parse(json.dumps(body).encode())
    assert e.value.status == 400
    assert service.parse(json.dumps({"model": "m", "messages": ASK}).encode()).tool_names is None


def test_eval_actor_turns_the_call_into_the_react_action(server, hermes_dir):
    """eval's endpoint actor with tool_calls: the model's `act` call comes back as the ReAct turn; a
    history of ReAct turns goes out as the tool's calls and results (rendered as transformers renders
    them: the server's prompt size is apply_chat_template's)."""
    from agentrefine_jax.data.react_tools import react_tool_messages
    from agentrefine_jax.eval.policies import ActRequest, OpenAIChatPolicy, SamplingParams, _wire

    policy = OpenAIChatPolicy(
        server[0], MODEL, SamplingParams(max_new_tokens=40), tool_calls=True, max_retries=0
    )
    try:
        history = [*ASK, {"role": "assistant", "content": "Action: look"},
                   {"role": "user", "content": "Observation: " + REPEAT + CALL}]  # fmt: skip
        first, second = policy.act([ActRequest(messages=ASK), ActRequest(messages=history)])
    finally:
        policy.close()
    assert first.text == "Action: look"
    assert isinstance(second.text, str)  # answered (a refused request is a PolicyError)
    wire = [_wire(m) for m in react_tool_messages(history)]
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "tool"]
    assert wire[2]["tool_calls"][0]["function"] == {"name": "act", "arguments": '{"command": "look"}'}
    assert wire[3]["tool_call_id"] == wire[2]["tool_calls"][0]["id"]
    prompts = [line for line in server[1] if line.startswith("chat.completions n=1")][-2:]
    sizes = {int(line.split("prompt=")[1].split()[0]) for line in prompts}
    assert sizes == {prompt_tokens(hermes_dir, ASK, [ACT_TOOL]), prompt_tokens(hermes_dir, wire, [ACT_TOOL])}


@pytest.mark.timeout(900)
def test_eval_cli_with_tool_calls_completes_and_records_the_actions(server, tmp_path):
    """`eval --base-url ... --tool-calls` on a cheap built-in task, against this server: the episodes
    complete (no request refused: before this, eval's client sent two Host headers, which this server's
    HTTP parser refuses) and every turn is recorded. SmolLM2 does not call the tool in the task's own
    prompt: its turns are format errors, as a reply without a call is."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = ["--tasks", "demo_world", "--episodes", "2", "--max-steps", "1", "--base-url", server[0],
            "--model", MODEL, "--tool-calls", "--max-new-tokens", "40", "--batch-size", "2",
            "--workdir", str(tmp_path / "w"), "--out", str(out)]  # fmt: skip
    cmd = [sys.executable, "-m", "agentrefine_jax.eval", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["policy"] == f"openai:{MODEL} (tool calls)"
    assert len(doc["episodes"]) == 2
    for e in doc["episodes"]:
        assert e["termination"] == "max_steps" and e["error"] is None, e
        (reply,) = [m["content"] for m in e["messages"] if m["role"] == "assistant"]
        (step,) = e["trace"]
        assert step["action"] == parse_action(reply)  # the recorded turn is what the protocol read
    cmd = [
        sys.executable,
        "-m",
        "agentrefine_jax.eval",
        "--policy",
        "oracle",
        "--tool-calls",
        "--tasks",
        "demo_world",
    ]
    bad = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--tool-calls needs --base-url" in bad.stderr
