"""The chat-completions backend against a real local HTTP server replaying recorded replies."""

from __future__ import annotations

import pytest
from test_synth_common import reply

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
    assert any("APITimeoutError" in line for line in logs)


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
