"""The HTTP transport under the OpenAI-compatible server: uvicorn (its h11 protocol) with our limits.

uvicorn serves every connection from one asyncio event loop, so an idle or slow connection is a
little state on that loop, never a thread: it cannot delay another request (the thread-pool server
this replaces stalled every request, `/health` included, behind `--workers` idle sockets). What
uvicorn leaves to its users, this module adds, as subclasses of its protocol and server (its
request parsing, keep-alive, pipelining and flow control are used as they are):

- A connection limit. Beyond `limits.max_connections` open connections a new one is answered
  `503` with `Retry-After` at once (before it sends anything), never reset: open connections are
  bounded, and a flood of idle ones costs neither a thread nor a connection that is served.
- A read deadline. A request -- head and body -- must arrive in full within `limits.read_timeout`
  seconds of the connection opening or of the previous response, however it trickles: a connection
  whose head is late is closed, one whose body is late is answered `408`.
- Graceful closes. Every close shuts our side first and reads what the client still sends for up
  to `LINGER_S` before closing, so a client never loses the response it has not read yet to a
  reset (closing a socket with unread input resets the connection).
- Malformed HTTP (h11's verdict: 400, 431, 501) answered in OpenAI's error format.
- A drain (`HTTPServer.drain`, what SIGTERM asks for): stop accepting, let every request in flight
  finish within `limits.grace_period`, then ask the app to stop what is left (`on_expiry`) and
  report how many requests that was (`Drained`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentrefine_jax.inference.api_errors import error_bytes

LINGER_S = 1.0  # how long an ended connection may take to finish sending (then it is closed)
STOP_WAIT_S = 10.0  # after the grace period: how long the app has to answer what it stopped
MAX_HEAD_BYTES = 64 * 1024  # request line + headers (h11 answers 431 beyond)
SERVER_NAME = "agentrefine-serve/0.2"


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 72  # open connections; a new one beyond them is answered 503 at once
    read_timeout: float = 30.0  # seconds for a whole request to arrive (see the module docstring)
    retry_after: int = 1  # seconds, in the 503's Retry-After header
    grace_period: float = 30.0  # seconds a drain (SIGTERM) waits for the requests in flight

    def __post_init__(self) -> None:
        if (
            self.max_connections < 1
            or not self.read_timeout > 0
            or self.retry_after < 0
            or not self.grace_period >= 0
        ):
            raise ValueError(f"bad server limits: {self}")

    @property
    def backlog(self) -> int:
        """Listen backlog: a burst of every connection we would serve or reject at once."""
        return max(128, 2 * self.max_connections)


@dataclasses.dataclass(frozen=True)
class Drained:
    """How serving ended: `unfinished` requests were still in flight when the grace period ended
    (the app was asked to stop them); `interrupted`: Ctrl-C, nothing waited for."""

    unfinished: int = 0
    interrupted: bool = False

    @property
    def clean(self) -> bool:
        return not self.unfinished and not self.interrupted


class _GracefulTransport:
    """The connection's transport as the protocol sees it: `close()` is a graceful close."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_gracefully()

    def is_closing(self) -> bool:
        return self._protocol.closing or self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.is_closing():
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol plus the connection limit, the read deadline and graceful closes."""

    def __init__(self, *args: Any, owner: HTTPServer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._owner = owner
        self._limits = owner.limits
        self.closing = False
        self._rejected = False
        self._raw: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._linger_end = 0.0
        self._linger: asyncio.TimerHandle | None = None
        self._protocol_error: h11.RemoteProtocolError | None = None
        next_event = self.conn.next_event

        def next_event_noting_errors() -> Any:  # send_400_response answers with h11's status hint
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise

        self.conn.next_event = next_event_noting_errors  # type: ignore[method-assign]

    # ------------------------------------------------------------------ connection life

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        if len(self.connections) >= self._limits.max_connections:
            self._rejected = True
            self._owner.rejected += 1
            transport.write(self._owner.busy_response)
            self.close_gracefully()
            return
        super().connection_made(_GracefulTransport(transport, self))  # type: ignore[arg-type]
        self._watch_deadline(restart=True)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # read away: see close_gracefully
        super().data_received(data)
        self._watch_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._deadline, self._linger):
            if timer is not None:
                timer.cancel()
        self._deadline = self._linger = None
        if self._rejected:
            return
        self.closing = True  # nothing more can be written
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._rejected:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self._rejected:
            super().resume_writing()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_deadline(restart=True)  # the next request's clock starts now

    def shutdown(self) -> None:
        """The server drains: close an idle connection now, the others after their response."""
        if self.closing:
            return
        try:
            super().shutdown()
        except h11.LocalProtocolError:  # mid-way through a request head: nothing to finish
            self.close_gracefully()

    def close_gracefully(self) -> None:
        """Shut our side (after what is buffered is sent), then read what the client still sends
        until it closes or LINGER_S have passed, then close: never a reset under unread input."""
        if self.closing or self._raw is None:
            return
        self.closing = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        raw = self._raw
        if raw.is_closing():
            return
        try:
            raw.resume_reading()
            if raw.can_write_eof():
                raw.write_eof()
        except (OSError, RuntimeError):
            raw.abort()
            return
        self._linger_end = time.monotonic() + LINGER_S
        self._linger = self.loop.call_later(LINGER_S, self._linger_over)

    def _linger_over(self) -> None:
        # A response still being sent to a slow reader gets up to the read timeout before the abort.
        raw = self._raw
        if raw is None or raw.is_closing():
            return
        if raw.get_write_buffer_size() and time.monotonic() < self._linger_end + self._limits.read_timeout:
            self._linger = self.loop.call_later(LINGER_S, self._linger_over)
            return
        raw.abort()

    # ------------------------------------------------------------------ the read deadline

    def _waiting_for_client(self) -> bool:
        """True while a request (head or body) is owed by the client, False while we owe a response."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def _watch_deadline(self, restart: bool = False) -> None:
        if self.closing:
            return
        waiting = self._waiting_for_client()
        if self._deadline is not None and (restart or not waiting):
            self._deadline.cancel()
            self._deadline = None
        if waiting and self._deadline is None:
            self._deadline = self.loop.call_later(self._limits.read_timeout, self._late)

    def _late(self) -> None:
        self._deadline = None
        if self.closing:
            return
        message = f"request not received within {self._limits.read_timeout:g} s"
        who = f"{self.client[0]}:{self.client[1]}" if self.client else "client"
        cycle = self.cycle
        body_late = cycle is not None and cycle.more_body and not cycle.response_started
        if body_late and not cycle.response_complete:
            # The head is in, the body is late: 408. The app reading the body is told the client
            # is gone (it answers nothing more); the connection is closed after the 408.
            cycle.disconnected = True
            cycle.message_event.set()
            self._send_error(408, message)
            self._owner.log(f'{who} "{cycle.scope["method"]} {cycle.scope["path"]}" 408 ({message})')
        else:
            self._owner.log(f"{who}: {message}; connection closed")
        self.close_gracefully()

    # ------------------------------------------------------------------ errors

    def send_400_response(self, msg: str) -> None:
        """h11 found the request malformed: its status (400, 431, 501) and reason, as JSON."""
        err = self._protocol_error
        status = getattr(err, "error_status_hint", 400) or 400
        reason = f"malformed HTTP request: {err}" if err is not None else msg
        self._owner.log(f"{self.client[0] if self.client else 'client'}: {status} {reason}")
        self._send_error(status, reason)
        self.close_gracefully()

    def _send_error(self, status: int, message: str) -> None:
        body = error_bytes(status, message)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"server", SERVER_NAME.encode()),
        ]
        try:
            out = self.conn.send(h11.Response(status_code=status, headers=headers))
            out += self.conn.send(h11.Data(data=body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # a response already begun: the close must say it
            return
        if self._raw is not None and not self._raw.is_closing():
            self._raw.write(out)


class _Server(uvicorn.Server):
    """uvicorn's server with our drain instead of its shutdown, and no signal handling of its own
    (the CLI installs SIGTERM -> drain and SIGINT -> interrupt; tests run it in a thread)."""

    def __init__(self, config: uvicorn.Config, owner: HTTPServer):
        super().__init__(config)
        self._owner = owner
        self.outcome = Drained()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        owner = self._owner
        for server in self.servers:  # stop accepting
            server.close()
        state = self.server_state
        if owner.interrupted:  # Ctrl-C: stop everything now
            owner.on_expiry()
            await self._settle(1.0)
            self.outcome = Drained(interrupted=True)
            return
        for connection in list(state.connections):
            connection.shutdown()
        end = time.monotonic() + owner.limits.grace_period
        while (state.connections or state.tasks) and time.monotonic() < end and not owner.interrupted:
            await asyncio.sleep(0.05)
        unfinished = owner.in_flight()
        if state.tasks or unfinished:
            owner.on_expiry()  # the app answers (503) or drops what is left
            await self._settle(STOP_WAIT_S)
            self.outcome = Drained(unfinished=max(unfinished, 1), interrupted=owner.interrupted)
        else:
            await self._settle(LINGER_S)
            self.outcome = Drained(interrupted=owner.interrupted)

    async def _settle(self, wait: float) -> None:
        """Let the request tasks end (up to `wait` s), then close whatever connection is left."""
        state = self.server_state
        end = time.monotonic() + wait
        while state.tasks and time.monotonic() < end:
            await asyncio.sleep(0.02)
        for connection in list(state.connections):
            raw = getattr(connection, "_raw", None)
            if raw is not None and not raw.is_closing():
                raw.abort()
        await asyncio.sleep(0)


class HTTPServer:
    """An ASGI app served by uvicorn on a socket bound now (port 0 picks a free one: see
    `server_address`). `serve_forever()` runs the event loop in the calling thread until `drain()`,
    `interrupt()` or `shutdown()`; it returns a `Drained`. `server_close()` releases the socket."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        limits: ServerLimits,
        log: Callable[[str], None],
        *,
        in_flight: Callable[[], int] = lambda: 0,
        on_expiry: Callable[[], None] = lambda: None,
    ):
        self.limits = limits
        self.log = log
        self.in_flight = in_flight
        self.on_expiry = on_expiry
        self.rejected = 0  # connections answered 503 (the connection limit)
        self.interrupted = False
        self.busy_response = _busy_response(limits)
        self.socket = _bind(host, port, limits.backlog)
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app,
            http=functools.partial(_Protocol, owner=self),
            loop="asyncio",
            ws="none",
            lifespan="off",
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            headers=[("server", SERVER_NAME)],
            timeout_keep_alive=limits.read_timeout,  # type: ignore[arg-type]
            backlog=limits.backlog,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        )
        # uvicorn's own lines ("Started server process", "Waiting for connections") are not ours.
        # Its warnings restate what we answer and log ourselves (a malformed request, an upgrade
        # we do not speak); an error would be a bug, and still shows.
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        self._server = _Server(config, self)
        self._stopped = threading.Event()

    def serve_forever(self) -> Drained:
        self._stopped.clear()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()
        return self._server.outcome

    def drain(self) -> None:
        """Stop accepting and finish the requests in flight (within the grace period); signal-safe."""
        self._server.should_exit = True

    def interrupt(self) -> None:
        """Stop now: the app stops what is in flight, nothing is waited for; signal-safe."""
        self.interrupted = True
        self._server.should_exit = True

    def shutdown(self, timeout: float | None = None) -> None:
        """Drain (from another thread) and wait until serve_forever has returned."""
        self.drain()
        self._stopped.wait(timeout)

    def server_close(self) -> None:
        self.socket.close()


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog)
    sock.set_inheritable(False)
    return sock


def _busy_response(limits: ServerLimits) -> bytes:
    message = f"server busy ({limits.max_connections} connections open); retry"
    body = error_bytes(503, message, code="server_busy")
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: {limits.retry_after}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
