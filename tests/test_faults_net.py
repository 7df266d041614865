"""Network faults (issue 23): slow and hostile peers on 127.0.0.1, real sockets, real CLIs.

Clients (synth generate, eval --base-url, agentrefine_jax.http_client): a server that trickles one
byte every half second never trips a per-read timeout; the request deadline must end each attempt
at `timeout` seconds. A provider that echoes the API key back mangled (upper-cased, one character
short) must not get it into stderr or any saved file.

Oracles: the wall clock of each attempt as the server saw it (accept -> the client's close), the
exact bytes on the wire, and the files the CLIs wrote.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from agentrefine_jax.http_client import RequestTimeout, redact, request

SECRET = "sk-test-DO-NOT-LEAK-4f9a2c"
DEADLINE = 2.0  # the client timeout under test
TRICKLE = 0.5  # seconds between bytes: far below DEADLINE, so per-read timeouts never fire
MARGIN = 1.0  # scheduling noise allowed past the deadline on a loaded 2-core box


class RawServer:
    """A one-thread-per-connection raw-socket HTTP peer on 127.0.0.1.

    `reply(conn)` writes whatever it wants; each connection's accept time and the time the client
    was seen to close it are recorded in `closed` (seconds after accept)."""

    def __init__(self, reply):
        self._reply = reply
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.closed: list[float] = []
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        t0 = time.monotonic()
        with conn:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                body += conn.recv(65536)
            self.requests.append(head + b"\r\n\r\n" + body)
            self._reply(conn, self)
            self.closed.append(time.monotonic() - t0)

    def client_gone(self, conn: socket.socket, wait: float) -> bool:
        """Wait up to `wait` s; True once the client has closed (or reset) the connection."""
        if not select.select([conn], [], [], wait)[0]:
            return False
        try:
            return conn.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


def trickle(conn: socket.socket, server: RawServer) -> None:
    """A 200 whose status line, headers and body arrive one byte every TRICKLE seconds (~50 min)."""
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "x" * 6000}}]}).encode()
    wire = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    for i in range(len(wire)):
        try:
            conn.sendall(wire[i : i + 1])
        except OSError:
            return
        if server.client_gone(conn, TRICKLE):
            return


def echo_key_401(conn: socket.socket, server: RawServer) -> None:
    """A provider that rejects the key and echoes it back mangled (and the header it came in)."""
    message = (
        f"Incorrect API key {SECRET.upper()}; did you mean {SECRET[:-1]} or {SECRET[1:]}? "
        f"(Authorization: Bearer {SECRET[:9]}{SECRET[10:]})"
    )
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}}
    )
    conn.sendall(
        b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )


@pytest.fixture
def trickler():
    server = RawServer(trickle)
    yield server
    server.close()


def _leaks(text: str) -> bool:
    """Whether any recognisable piece of SECRET survives: its middle, in any case."""
    return SECRET[2:-2].lower() in text.lower()


def _run(module: str, args: list[str], tmp_path: pathlib.Path, env: dict[str, str], timeout: float = 120):
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), **env}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    return proc, time.monotonic() - t0


def _saved_text(root: pathlib.Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------ the shared client


@pytest.mark.timeout(60)
def test_request_deadline_is_overall_not_per_read(trickler):
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match=rf"127\.0\.0\.1:{trickler.port} within the 2 s deadline"):
        request("POST", trickler.url + "/chat/completions", json_body={"x": 1}, timeout=DEADLINE)
    elapsed = time.monotonic() - t0
    assert DEADLINE - 0.05 <= elapsed <= DEADLINE + MARGIN, elapsed
    time.sleep(0.2)  # the server notices the close on its next select
    assert len(trickler.closed) == 1 and trickler.closed[0] <= DEADLINE + MARGIN


@pytest.mark.timeout(60)
def test_request_returns_a_prompt_reply_with_params_and_json():
    def answer(conn, server):
        body = json.dumps({"ok": True}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    server = RawServer(answer)
    try:
        reply = request("GET", server.url + "/search", params={"q": "a b", "n": 2}, timeout=5)
    finally:
        server.close()
    assert reply.status == 200 and reply.json() == {"ok": True}
    line = server.requests[0].split(b"\r\n")[0]
    assert line == b"GET /v1/search?q=a+b&n=2 HTTP/1.1"
    assert b"Connection: close" in server.requests[0]


@pytest.mark.timeout(60)
def test_request_reads_a_will_close_body_that_arrives_after_the_headers():
    # http.client closes a "Connection: close" (or HTTP/1.0) reply's socket once its headers are parsed;
    # a body still on the way must be read all the same (HTTP/1.0 servers such as http.server do this).
    def late_body(conn, server):
        conn.sendall(b"HTTP/1.0 200 OK\r\nConnection: close\r\nContent-Length: 11\r\n\r\n")
        time.sleep(0.3)
        conn.sendall(b'{"ok": "x"}')

    server = RawServer(late_body)
    try:
        reply = request("GET", server.url + "/late", timeout=5)
    finally:
        server.close()
    assert reply.status == 200 and reply.json() == {"ok": "x"}


def test_redact_catches_case_and_near_miss_echoes_only():
    text = (
        f"key {SECRET.upper()} / {SECRET[:-1]} / {SECRET[1:]} / {SECRET[:7]}X{SECRET[8:]} / "
        f"'{SECRET}'. Bearer abc.def sk-other-key-1234567890 for model meta-llama-3.1-8b-instruct"
    )
    out = redact(text, SECRET)
    assert not _leaks(out) and "abc.def" not in out and "sk-other" not in out
    assert "meta-llama-3.1-8b-instruct" in out and out.count("***") == 7
    # A short key is matched exactly (any case) only: ordinary words must survive.
    assert redact("the Token token tokens", "token") == "the *** *** ***s"


# ------------------------------------------------------------------ synth generate and eval


@pytest.mark.timeout(120)
def test_synth_generate_timeout_is_a_deadline(trickler, tmp_path):
    personas = tmp_path / "p.txt"
    personas.write_text("A baker who trickles.\n")
    args = [
        "generate",
        "--personas",
        str(personas),
        "--out",
        str(tmp_path / "out"),
        "--base-url",
        trickler.url,
    ]
    args += ["--model", "m", "--timeout", str(DEADLINE), "--max-api-retries", "0", "--concurrency", "1"]
    proc, _ = _run("agentrefine_jax.synth", args, tmp_path, {"OPENAI_API_KEY": SECRET})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "within the 2 s deadline" in line]
    assert len(lines) == 1 and "left in-flight" in lines[0], proc.stderr
    assert len(trickler.closed) == 1 and DEADLINE - 0.05 <= trickler.closed[0] <= DEADLINE + MARGIN


@pytest.mark.timeout(180)
def test_eval_request_timeout_is_a_deadline(trickler, tmp_path):
    out = tmp_path / "r.json"
    args = ["--base-url", trickler.url, "--model", "m", "--tasks", "babyai", "--episodes", "1"]
    args += ["--max-steps", "1", "--request-timeout", str(DEADLINE), "--workdir", str(tmp_path / "w")]
    proc, _ = _run("agentrefine_jax.eval", [*args, "--out", str(out)], tmp_path, {"OPENAI_API_KEY": SECRET})
    assert proc.returncode == 0, proc.stderr
    (episode,) = json.loads(out.read_text())["episodes"]
    assert episode["termination"] == "error"
    assert episode["error"].startswith("timed out: no complete reply from 127.0.0.1:"), episode["error"]
    # The openai client's own 2 retries: three attempts, each ended by the deadline.
    assert len(trickler.closed) == 3, trickler.closed
    assert all(DEADLINE - 0.05 <= t <= DEADLINE + MARGIN for t in trickler.closed), trickler.closed


@pytest.mark.timeout(180)
def test_a_mangled_key_echo_reaches_neither_stderr_nor_saved_files(tmp_path):
    server = RawServer(echo_key_401)
    try:
        personas = tmp_path / "p.txt"
        personas.write_text("A baker with a bad key.\n")
        synth_out = tmp_path / "synth"
        args = ["generate", "--personas", str(personas), "--out", str(synth_out), "--base-url", server.url]
        synth, _ = _run(
            "agentrefine_jax.synth", [*args, "--model", "m"], tmp_path, {"OPENAI_API_KEY": SECRET}
        )
        eval_out = tmp_path / "eval"
        args = [
            "--base-url",
            server.url,
            "--model",
            "m",
            "--tasks",
            "babyai",
            "--episodes",
            "1",
            "--max-steps",
            "1",
        ]
        args += ["--workdir", str(eval_out / "w"), "--out", str(eval_out / "r.json")]
        evaluation, _ = _run("agentrefine_jax.eval", args, tmp_path, {"OPENAI_API_KEY": SECRET})
    finally:
        server.close()
    # The key did go out (so the echo is a real echo of what was sent) ...
    assert all(f"Bearer {SECRET}".encode() in r for r in server.requests) and len(server.requests) >= 2
    # ... and came back in no form: not on stderr/stdout, not in summary.json or the results.
    assert synth.returncode == 2 and "HTTP 401 (invalid_api_key)" in synth.stderr, synth.stderr
    summary = json.loads((synth_out / "summary.json").read_text())
    assert summary["fatal"].startswith("HTTP 401 (invalid_api_key): Incorrect API key ***")
    (episode,) = json.loads((eval_out / "r.json").read_text())["episodes"]
    assert episode["error"].startswith("HTTP 401 (invalid_api_key): Incorrect API key ***"), episode
    for text in (synth.stdout, synth.stderr, evaluation.stdout, evaluation.stderr, _saved_text(tmp_path)):
        assert not _leaks(text)
