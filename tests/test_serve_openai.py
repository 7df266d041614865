"""The OpenAI-compatible server answers the real `openai` client, in-process and via the CLI.

Oracle for reply content: the in-process ChatGenerator on the same checkpoint (greedy),
which is itself checked against transformers in test_generate_hf_parity.py.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

import jax
import openai
import pytest
from test_generate_chat import CFG, CONVERSATION, numpy_model

from agentrefine_jax.checkpoint import save_model
from agentrefine_jax.inference.chat import ChatGenerator
from agentrefine_jax.inference.server import ChatService, make_server

KEY = "test-key-123"
# Same model, weights and prompt shapes as test_generate_chat, so one pytest session compiles once.
MESSAGES = CONVERSATION


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "demo-model"
    save_model(path, numpy_model(CFG, seed=0, std=0.1), CFG, step=0, tokenizer="llama3", template="llama3")
    return path


@pytest.fixture(scope="module")
def generator(checkpoint):
    return ChatGenerator.from_checkpoint(str(checkpoint))


@pytest.fixture(scope="module")
def server(generator):
    """In-process server (requires KEY) on a free port; yields the base URL."""
    srv = make_server(ChatService(generator, api_key=KEY, log=lambda _: None), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def test_chat_completion_matches_in_process_generation(server, generator):
    resp = client(server).chat.completions.create(
        model="demo-model", messages=MESSAGES, max_tokens=64, temperature=0
    )
    (expected,) = generator.complete([MESSAGES], max_new_tokens=64)
    assert resp.object == "chat.completion" and resp.model == "demo-model"
    assert len(resp.choices) == 1
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(generator.encode(MESSAGES))
    assert resp.usage.completion_tokens == expected.completion_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_n_samples_are_seeded_and_distinct(server):
    c = client(server)
    kw = dict(model="demo-model", messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0.95, n=3, seed=7)
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in b.choices]
    assert len(set(texts)) == 3
    assert a.usage.completion_tokens == 3 * 8


def _streamed(stream) -> tuple[list, dict[int, str], dict[int, str]]:
    """(chunks, text per choice, finish_reason per choice) of an openai stream."""
    chunks = list(stream)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for ch in chunks:
        assert ch.object == "chat.completion.chunk" and ch.model == "demo-model"
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in reasons  # once per choice
                reasons[choice.index] = choice.finish_reason
    return chunks, texts, reasons


def test_stream_deltas_concatenate_to_the_non_stream_reply(server):
    """Issue 44: stream=True was refused (400); OpenAI's clients and chat front ends stream."""
    c = client(server)
    kw = dict(model="demo-model", messages=MESSAGES, max_tokens=64, temperature=0)
    whole = c.chat.completions.create(**kw)
    chunks, texts, reasons = _streamed(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({ch.id for ch in chunks}) == 1
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}
    # Streamed as it is generated (16-token decode chunks), not as one piece at the end.
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2, chunks
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # A stop string is cut from the stream as from the reply, even when it spans two deltas.
    stop = whole.choices[0].message.content[20:23]
    cut = c.chat.completions.create(**kw, stop=[stop])
    _, texts, reasons = _streamed(c.chat.completions.create(**kw, stop=[stop], stream=True))
    assert cut.choices[0].finish_reason == "stop"
    assert texts == {0: cut.choices[0].message.content} and reasons == {0: "stop"}


def test_stream_of_n_samples_equals_their_replies(server):
    c = client(server)
    kw = dict(model="demo-model", messages=MESSAGES, max_tokens=24, temperature=1.0, n=2, seed=3)
    whole = c.chat.completions.create(**kw)
    _, texts, reasons = _streamed(c.chat.completions.create(**kw, stream=True))
    assert texts == {ch.index: ch.message.content for ch in whole.choices}
    assert reasons == {ch.index: ch.finish_reason for ch in whole.choices}


def test_stream_wire_format_is_server_sent_events(server):
    """What any SSE client reads: `data: {json}` events, the last one `data: [DONE]`."""
    import http.client
    import json

    port = int(server.rsplit(":", 1)[1].split("/")[0])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "demo-model", "messages": MESSAGES, "max_tokens": 20, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", raw[-200:]
    assert all(e.startswith("data: {") for e in events[:-2]), raw
    last = json.loads(events[-3][len("data: ") :])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["choices"][0]["delta"] == {}


def test_models_and_errors(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["demo-model"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    # (Streaming is served since issue 44: see the stream tests; its options are checked.)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        c.chat.completions.create(
            model="demo-model", messages=MESSAGES, stream_options={"include_usage": True}
        )
    with pytest.raises(openai.BadRequestError, match="role order"):
        c.chat.completions.create(
            model="demo-model", messages=MESSAGES[:1] + [{"role": "assistant", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="demo-model", messages=MESSAGES, temperature=5)
    with pytest.raises(openai.BadRequestError, match="unsupported parameter"):
        c.chat.completions.create(model="demo-model", messages=MESSAGES, extra_body={"best_of": 2})
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").chat.completions.create(model="demo-model", messages=MESSAGES)


def _idle_flood(port: int, n: int, wait: float) -> list[str]:
    """Open n connections that never send a byte; what the server did with each within `wait` s:
    '503' (answered busy at once), 'closed' (its read deadline), or 'open'."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    outcome = ["open"] * n
    end = time.monotonic() + wait
    while "open" in outcome and time.monotonic() < end:
        for i in [i for i, o in enumerate(outcome) if o == "open"]:
            if select.select([socks[i]], [], [], 0)[0]:
                data = socks[i].recv(4096)
                outcome[i] = (
                    "closed" if not data else ("503" if data.startswith(b"HTTP/1.1 503") else repr(data))
                )
        time.sleep(0.05)
    for s in socks:
        s.close()
    return outcome


@pytest.mark.timeout(300)
def test_cli_server_answers_openai_client(checkpoint, generator):
    """Also (issue 23): 60 idle connections add no thread to the serve process (its /proc task
    count) and each ends at once (503) or at the 1 s read deadline."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.pop("AGENTREFINE_SERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "agentrefine_jax.inference", "serve", "--checkpoint", str(checkpoint)]
    cmd += ["--port", "0", "--workers", "2", "--queue", "2", "--read-timeout", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # blocks until the server is listening (or exits)
        assert line.startswith("serving 'demo-model' on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" on ", 1)[1].strip()
        resp = client(url, key="unused").chat.completions.create(
            model="demo-model", messages=MESSAGES, max_tokens=6, temperature=0
        )
        assert resp.choices[0].message.content == generator.chat([MESSAGES], max_new_tokens=6)[0]
        tasks_before = len(os.listdir(f"/proc/{proc.pid}/task"))
        outcome = _idle_flood(int(url.rsplit(":", 1)[1].split("/")[0]), 60, wait=10)
        tasks_after = len(os.listdir(f"/proc/{proc.pid}/task"))
        again = client(url, key="unused").models.list()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    stderr = proc.stderr.read()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert set(outcome) <= {"503", "closed"} and outcome.count("503") >= 56, outcome
    # Before the fix each idle connection held a thread (60 connections: +60 threads).
    assert tasks_after <= tasks_before + 2, (tasks_before, tasks_after)
    assert [m.id for m in again.data] == ["demo-model"]


def test_compiled_programs_are_bounded_by_request_shapes(generator):
    """Issue 44: RSS grew 0.9 -> 1.4 GB over ~350 requests of varied shapes, one compiled prefill and
    decode program kept per shape for good. With max_program_shapes=2, a third shape clears them
    (jax's caches: the executables are freed), and replies are still the generator's. RSS over
    1,000 varied requests: benchmarks/serve_memory.py (docs/inference.md)."""
    from agentrefine_jax.inference import engine

    service = ChatService(generator, log=lambda _: None, max_program_shapes=2)
    jax.clear_caches()
    held = []
    for max_tokens, n in ((3, 1), (3, 2), (20, 1), (3, 1)):
        body = {
            "model": "demo-model",
            "messages": MESSAGES,
            "max_tokens": max_tokens,
            "temperature": 0,
            "n": n,
        }
        reply = service.complete(service.parse(json.dumps(body).encode()))
        expected = generator.chat([MESSAGES] * n, max_new_tokens=max_tokens)
        assert [c["message"]["content"] for c in reply["choices"]] == expected
        held.append(sum(f._cache_size() for f in engine._compiled()))  # jit's own count (private)
    assert service.program_clears == 1 and len(service.shapes) == 2
    # Two programs (prefill, decode) per shape: 2, 4; the third shape finds both shapes' programs
    # cleared (2); the first shape again is compiled again (4). Never more than 2 shapes' worth.
    assert held == [2, 4, 2, 4], held
