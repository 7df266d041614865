"""The chat-completions backend against a real local HTTP server replaying recorded replies."""

from __future__ import annotations

import io
import json

import pytest
from test_synth_common import good_turns, persona_rules, read_jsonl, reply, script_reply

from agentrefine_jax.synth.generate import GenerateConfig, run_generate
from agentrefine_jax.synth.llm import (
    APIFatalError,
    APITransientError,
    ChatClient,
    JSONExtractError,
    LLMSettings,
    extract_json,
)
from agentrefine_jax.synth.replay_server import ReplayServer

SECRET = "sk-test-DO-NOT-LOG-4f9a2c"
MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv("SYNTH_TEST_KEY", SECRET)
    return "SYNTH_TEST_KEY"


def _client(server, key_env, logs, **kw):
    settings = LLMSettings(
        base_url=server.url, model="m", api_key_env=key_env, backoff_base=0.001, backoff_max=0.01, **kw
    )
    return ChatClient(settings, log=logs.append)


def test_429_with_retry_after_then_success_records_usage(key_env):
    rules = [
        {
            "name": "r",
            "match": ["hello"],
            "replies": [
                {
                    "status": 429,
                    "headers": {"retry-after": "0.05"},
                    "body": {"error": {"message": "slow down"}},
                },
                reply('{"ok": 1}', prompt_tokens=11, completion_tokens=7),
            ],
        }
    ]
    logs: list[str] = []
    slept: list[float] = []
    with ReplayServer(rules) as server:
        client = _client(server, key_env, logs)
        client._sleep = slept.append
        out = client.complete(MSG)
    assert extract_json(out.text) == {"ok": 1}
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (11, 7)
    want = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18, "calls": 1}
    assert client.usage.as_dict() == want
    assert len(server.requests) == 2 and client.retries == 1
    assert slept and slept[0] >= 0.01  # Retry-After (capped at backoff_max) beats the tiny base delay
    assert any("HTTP 429" in line for line in logs)
    # The key is sent, and never logged.
    assert all(r["authorization"] == f"Bearer {SECRET}" for r in server.requests)
    assert not any(SECRET in line for line in logs)


def test_5xx_and_timeouts_are_retried(key_env):
    rules = [
        {
            "name": "r",
            "match": ["hello"],
            "replies": [{"status": 500}, {"status": 502}, {"hang": True}, reply("done")],
        }
    ]
    logs: list[str] = []
    with ReplayServer(rules) as server:
        out = _client(server, key_env, logs, timeout=0.3).complete(MSG)
    assert out.text == "done"
    assert [r["rule"] for r in server.requests] == ["r"] * 4
    assert sum("retry" in line for line in logs) == 3
    assert any("timed out: no complete reply" in line and "0.3 s deadline" in line for line in logs)


def test_persistent_5xx_gives_up_after_max_api_retries(key_env):
    rules = [{"name": "r", "match": ["hello"], "replies": [{"status": 503}], "repeat_last": True}]
    with ReplayServer(rules) as server:
        with pytest.raises(APITransientError, match="HTTP 503"):
            _client(server, key_env, [], max_api_retries=3).complete(MSG)
    assert len(server.requests) == 4


def test_auth_error_is_fatal_at_once_and_the_key_is_redacted(key_env):
    # A server that echoes the key back in its error must not make us print it.
    rules = [
        {
            "name": "r",
            "match": ["hello"],
            "replies": [{"status": 401, "body": {"error": {"message": f"invalid key {SECRET}"}}}],
        }
    ]
    with ReplayServer(rules) as server:
        with pytest.raises(APIFatalError) as e:
            _client(server, key_env, []).complete(MSG)
    assert len(server.requests) == 1
    assert "HTTP 401" in str(e.value) and SECRET not in str(e.value) and "***" in str(e.value)


def test_missing_key_sends_placeholder_and_warns(monkeypatch):
    monkeypatch.delenv("SYNTH_ABSENT_KEY", raising=False)
    logs: list[str] = []
    with ReplayServer([{"match": ["hello"], "replies": [reply("x")]}]) as server:
        _client(server, "SYNTH_ABSENT_KEY", logs).complete(MSG)
    assert server.requests[0]["authorization"] == "Bearer EMPTY"
    assert any("$SYNTH_ABSENT_KEY is not set" in line for line in logs)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"a": 1}', {"a": 1}),
        ('```json\n{"a": [1, 2]}\n```', {"a": [1, 2]}),
        ('Sure! Here it is:\n```\n{"a": "}{"}\n```\nHope this helps.', {"a": "}{"}),
        ('JSON: {"turns": [{"x": "{not a brace}"}]} -- done', {"turns": [{"x": "{not a brace}"}]}),
        ('<think>maybe {"wrong": true}</think>\n{"right": true}', {"right": True}),
        ('[{"role": "dm"}]', [{"role": "dm"}]),
    ],
)
def test_extract_json(text, value):
    assert extract_json(text) == value


@pytest.mark.parametrize("text", ["", "no json here", '{"turns": [1, 2', "```json\n{'a': 1}\n```"])
def test_extract_json_rejects_malformed_replies(text):
    with pytest.raises(JSONExtractError):
        extract_json(text)


# A 200 that is not a chat completion: a proxy's HTML error page, an empty choice list, a choice
# without a message. These are transport faults, retried like a 5xx.
NOT_JSON = {"status": 200, "body": "<html><body>502 Bad Gateway</body></html>"}
NO_CHOICES = {"status": 200, "body": {"id": "x", "object": "chat.completion", "choices": []}}
NO_MESSAGE = {"status": 200, "body": {"id": "x", "object": "chat.completion", "choices": [{"index": 0}]}}


@pytest.mark.parametrize(
    ("bad", "logged"),
    [
        (NOT_JSON, "HTTP 200 with a body that is not JSON"),
        (NO_CHOICES, "HTTP 200 without choices"),
        (NO_MESSAGE, "HTTP 200 with a choice that has no message"),
    ],
)
def test_a_malformed_200_is_retried_like_a_5xx(key_env, bad, logged):
    rules = [{"name": "r", "match": ["hello"], "replies": [bad, bad, reply('{"ok": 1}', 11, 7)]}]
    logs: list[str] = []
    slept: list[float] = []
    with ReplayServer(rules) as server:
        client = _client(server, key_env, logs)
        client._sleep = slept.append
        out = client.complete(MSG)
    assert extract_json(out.text) == {"ok": 1}
    assert len(server.requests) == 3 and client.retries == 2 and len(slept) == 2
    assert sum(logged in line and "retry" in line for line in logs) == 2
    assert (client.usage.prompt_tokens, client.usage.completion_tokens) == (11, 7)


def test_a_persistent_malformed_200_gives_up_after_max_api_retries(key_env):
    rules = [{"name": "r", "match": ["hello"], "replies": [NOT_JSON], "repeat_last": True}]
    with ReplayServer(rules) as server:
        with pytest.raises(APITransientError, match="not JSON.*through 2 retries"):
            _client(server, key_env, [], max_api_retries=2).complete(MSG)
    assert len(server.requests) == 3


def test_generate_retries_malformed_200s_and_fails_only_the_persona_they_persist_for(tmp_path, key_env):
    """One persona's endpoint keeps answering HTML with status 200: that persona is left unfinished
    (resumable, like a persistent 5xx) while the others finish; a malformed 200 in between costs
    no regeneration attempt."""
    personas = tmp_path / "personas.jsonl"
    personas.write_text(
        "".join(
            json.dumps({"id": i, "persona": f"QQ-{i.upper()}, a cook."}) + "\n" for i in ("ok", "gap", "bad")
        )
    )
    rules = (
        persona_rules("QQ-OK", script=[script_reply()], fresh=[reply({"turns": good_turns()})])
        + persona_rules(
            "QQ-GAP",
            script=[NOT_JSON, script_reply()],
            fresh=[NO_CHOICES, NO_MESSAGE, reply({"turns": good_turns()})],
        )
        + [dict(r, repeat_last=True) for r in persona_rules("QQ-BAD", script=[NOT_JSON])]
    )
    llm = LLMSettings(
        base_url="", model="m", api_key_env=key_env, backoff_base=0.001, backoff_max=0.01, max_api_retries=3
    )
    with ReplayServer(rules) as server:
        llm.base_url = server.url
        cfg = GenerateConfig(
            personas=personas,
            out_dir=tmp_path / "out",
            script_llm=llm,
            trajectory_llm=llm,
            concurrency=3,
            max_retries=0,  # no regeneration to spare: a malformed 200 must not consume one
        )
        report = run_generate(cfg, progress_stream=io.StringIO())
        bad_requests = [r for r in server.requests if r["rule"] == "QQ-BAD/script"]
    assert report.fatal is None and not report.interrupted
    assert (report.succeeded, report.failed, report.unfinished, report.exit_code) == (2, 0, 1, 1)
    done = {r["id"]: r for r in read_jsonl(tmp_path / "out" / "trajectories.jsonl")}
    assert set(done) == {"ok", "gap"}
    assert done["gap"]["meta"]["script_attempts"] == 1 and done["gap"]["meta"]["attempts"] == 1
    assert len(bad_requests) == 1 + 3  # the first try and max_api_retries retries, then it stops
    assert (tmp_path / "out" / "state" / "bad.json").exists()  # resumable on the next run
