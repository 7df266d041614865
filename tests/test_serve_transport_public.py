"""Why inference/http_transport.py subclasses uvicorn's h11 protocol (issue 41): what uvicorn's public
configuration cannot do, shown on a plain `uvicorn.Server` beside ours, both serving the same ASGI app.

uvicorn's public knobs (`uvicorn.Config`: `limit_concurrency`, `timeout_keep_alive`,
`h11_max_incomplete_event_size`, a protocol class by name) and any ASGI middleware act only once a
request head has been parsed; an ASGI app never sees a connection before that, nor a request h11
refused. Each case below is one the subclass handles and public uvicorn does not: if a uvicorn
release adds a public hook for one, its assertion here fails, and the subclass can give that part up.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from agentrefine_jax.inference.http_transport import HTTPServer, ServerLimits

LIMIT = 2  # connections (ours) / concurrency (uvicorn's limit_concurrency)
TIMEOUT = 1  # seconds: our read deadline / uvicorn's keep-alive timeout


async def app(scope, receive, send):  # the smallest ASGI app: 200 "ok"
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module", params=["public uvicorn", "ours"])
def served(request):
    """(kind, port) of a server running `app` in a thread."""
    if request.param == "ours":
        srv = HTTPServer(
            app, "127.0.0.1", 0, ServerLimits(max_connections=LIMIT, read_timeout=TIMEOUT), print
        )
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        thread.start()
        yield request.param, srv.server_address[1]
        srv.shutdown(timeout=30)
        srv.server_close()
        return
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, limit_concurrency=LIMIT, timeout_keep_alive=TIMEOUT, log_config=None, lifespan="off", http="h11"
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # older uvicorn; newer ones skip it off the main thread
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield request.param, sock.getsockname()[1]
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def _outcome(s: socket.socket, wait: float) -> bytes | None:
    """What the server sent before closing within `wait` s (b"" = closed silently), None = still open."""
    s.settimeout(wait)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return None if not data else data
    return data


def test_a_request_head_that_never_ends_is_cut_off(served):
    """Public uvicorn has no deadline for a request head (its keep-alive timeout runs only between
    requests): a slow-header client holds its connection for ever. Ours closes it at the deadline."""
    kind, port = served
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        got = _outcome(s, 3 * TIMEOUT + 2)
    if kind == "ours":
        assert got == b"", got
    else:
        assert got is None, got  # still open


def test_connections_beyond_the_limit_are_answered_at_once(served):
    """uvicorn's limit_concurrency answers 503 only to a request, so idle connections beyond it
    are all held open; ours answers each one beyond the limit 503 (Retry-After) on connecting."""
    kind, port = served
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMIT + 3)]
    try:
        got = [_outcome(s, 0.5) for s in socks[LIMIT:]]
    finally:
        for s in socks:
            s.close()
    if kind == "ours":
        assert all(g is not None and g.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in g for g in got), (
            got
        )
    else:
        assert got == [None] * 3, got


def test_a_malformed_request_is_answered_in_the_api_s_error_format(served):
    """h11 refuses it before any ASGI app runs: public uvicorn answers plain text; ours answers
    OpenAI's JSON error body (what the clients parse)."""
    kind, port = served
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        got = _outcome(s, 10) or b""
    assert got.startswith(b"HTTP/1.1 400"), got
    body = got.split(b"\r\n\r\n", 1)[1]
    if kind == "ours":
        assert body.startswith(b'{"error": {"message": "malformed HTTP request'), body
    else:
        assert body == b"Invalid HTTP request received.", body
