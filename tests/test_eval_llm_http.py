"""The OpenAI-compatible backend against a real HTTP server (stdlib, 127.0.0.1) that speaks
/v1/chat/completions: the CLI drives the `openai` client, episodes are batched into concurrent
requests, transcripts are what the server saw, a failing request fails only its episode, and the
API key is sent but never printed or saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from openai_fixture import chat_completion, send_json

from agentrefine_jax.eval.react import FORMAT_ERROR

SECRET = "sk-test-DO-NOT-LEAK-4f9a2c"


class ScriptedAgent(BaseHTTPRequestHandler):
    """A tiny deterministic 'model': a malformed first turn, then check valid actions, then the first one.

    Episodes whose rules mention Towers of Hanoi get a 400, like an over-long prompt would."""

    requests: list[dict] = []
    lock = threading.Lock()
    in_flight = 0
    max_in_flight = 0

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with cls.lock:
                cls.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
            time.sleep(0.05)  # long enough for concurrent requests to overlap
            msgs = body["messages"]
            if "Towers of Hanoi" in msgs[1]["content"]:
                return self._send(
                    400,
                    {
                        "error": {
                            "message": "prompt exceeds the context length",
                            "type": "invalid_request_error",
                            "code": None,
                        }
                    },
                )
            turns = sum(m["role"] == "assistant" for m in msgs)
            last = msgs[-1]["content"]
            if turns == 0:
                reply = "Let me think about the blocks first."
            elif "Valid actions now:" in last:
                first = next(line[2:] for line in last.splitlines() if line.startswith("- "))
                reply = f"Thought: I take the first valid action.\nAction: {first}"
            else:
                reply = "Thought: I need the options.\nAction: check valid actions"
            self._send(200, chat_completion(body["model"], reply))
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def _send(self, status: int, payload: dict) -> None:
        send_json(self, status, payload)


@pytest.fixture
def server():
    ScriptedAgent.requests = []
    ScriptedAgent.max_in_flight = 0
    srv = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedAgent)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def _cli(args, tmp_path, extra_env=None):
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_openai_backend_end_to_end(server, tmp_path):
    out = tmp_path / "results.json"
    proc = _cli(
        [
            "--base-url",
            server,
            "--model",
            "scripted-agent",
            "--tasks",
            "pddl",
            "--episodes",
            "4",
            "--max-steps",
            "5",
            "--batch-size",
            "4",
            "--temperature",
            "0.3",
            "--max-new-tokens",
            "64",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        tmp_path,
        {"OPENAI_API_KEY": ""},
    )
    assert proc.returncode == 0, proc.stderr
    # Key from --api-key-env default (OPENAI_API_KEY) is empty here: a placeholder is sent.
    assert {r["auth"] for r in ScriptedAgent.requests} == {"Bearer EMPTY"}

    doc = json.loads(out.read_text())
    assert "PDDL" in proc.stdout and "Held-out avg" in proc.stdout
    reqs = [r["body"] for r in ScriptedAgent.requests]
    assert {r["path"] for r in ScriptedAgent.requests} == {"/v1/chat/completions"}
    assert all(
        b["model"] == "scripted-agent"
        and b["temperature"] == 0.3
        and b["max_tokens"] == 64
        and b["stop"] == ["\nObservation:"]
        for b in reqs
    )
    assert ScriptedAgent.max_in_flight >= 2, "episodes were not batched into concurrent requests"

    eps = {e["spec"]["domain"]: e for e in doc["episodes"]}
    assert set(eps) == {"blocks", "elevator", "gripper", "hanoi"}
    bad = eps.pop("hanoi")
    assert bad["termination"] == "error" and "context length" in bad["error"] and not bad["success"]
    m = doc["variants"]["original"]["tasks"]["pddl"]
    assert m["errors"] == 1 and m["episodes"] == 4
    assert "errors (counted as failures)" in proc.stdout
    for e in eps.values():
        assert e["termination"] in ("max_steps", "success")
        msgs = e["messages"]
        assert e["format_errors"] == 1 and msgs[3]["content"] == "Observation: " + FORMAT_ERROR
        assert e["trace"][1]["action"] == "check valid actions" and e["trace"][2]["executed"]
        # The transcript is exactly the conversation the server was sent, plus its last reply.
        assert any(b["messages"] == msgs[:-2] for b in reqs)
        assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user"


def test_api_key_is_sent_but_never_printed_or_saved(server, tmp_path):
    out = tmp_path / "r.json"
    proc = _cli(
        [
            "--base-url",
            server,
            "--model",
            "m",
            "--api-key-env",
            "EVAL_TEST_KEY",
            "--tasks",
            "babyai",
            "--episodes",
            "1",
            "--max-steps",
            "2",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        tmp_path,
        {"EVAL_TEST_KEY": SECRET},
    )
    assert proc.returncode == 0, proc.stderr
    assert {r["auth"] for r in ScriptedAgent.requests} == {f"Bearer {SECRET}"}
    assert SECRET not in proc.stdout + proc.stderr + out.read_text()


def test_cli_rejects_bad_arguments(tmp_path):
    proc = _cli(["--base-url", "http://127.0.0.1:9/v1", "--tasks", "pddl"], tmp_path)
    assert proc.returncode == 2 and "--base-url needs --model" in proc.stderr
    proc = _cli(["--policy", "oracle", "--tasks", "alfworld"], tmp_path)
    assert proc.returncode == 2 and "unknown task" in proc.stderr and "alfworld" in proc.stderr
    proc = _cli(
        ["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--best-of", "2", "--temperature", "0"],
        tmp_path,
    )
    assert proc.returncode == 2 and "greedy" in proc.stderr
