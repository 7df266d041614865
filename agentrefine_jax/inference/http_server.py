"""The HTTP layer under the OpenAI-compatible server: a fixed thread pool, deadlines, request bodies.

Why not `ThreadingHTTPServer`: it starts a thread per connection and reads without any timeout,
so idle or slow-header connections each hold a thread for ever, and its listen backlog of 5
resets bursts of concurrent clients. Here:

- `limits.workers` threads serve connections; up to `limits.queue` more wait for one; beyond that
  a connection is answered `503` with `Retry-After` at once, and one linger thread reads the
  request away before closing (so the client gets the 503 rather than a reset). The listen
  backlog is sized to hold a burst of all of these. The thread count never grows with the clients.
- `limits.read_timeout`: a request (line, headers and body) must arrive in full within this many
  seconds of the connection opening, or of the previous response on a kept-alive connection.
  Each read gets only the time left, so trickling a byte at a time does not extend it. A late
  body gets `408`; a connection that never finishes its headers is closed.
- Bodies: `Content-Length`, or `Transfer-Encoding: chunked` decoded here (a body is read exactly
  once; any request whose body is not read to its end closes the connection, so leftover bytes
  are never parsed as a next request). Both headers at once → 400; another transfer coding → 501.
- A waiting connection is served as soon as possible: while others queue, responses carry
  `Connection: close` instead of keeping the worker on an idle keep-alive connection.
"""

from __future__ import annotations

import dataclasses
import io
import json
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

LINGER_S = 1.0  # how long an ended connection may take to finish sending (then it is closed)
MAX_LINGERING = 1024  # rejected connections being read away at once; more wait their turn
_MAX_CHUNK_LINE = 1024
_MAX_TRAILERS = 64


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    workers: int = 8  # connections served at once (the model itself runs one request at a time)
    queue: int = 64  # accepted connections waiting for a worker; more are answered 503
    read_timeout: float = 30.0  # seconds for a whole request to arrive (see the module docstring)
    retry_after: int = 1  # seconds, in the 503's Retry-After header

    def __post_init__(self) -> None:
        if self.workers < 1 or self.queue < 1 or not self.read_timeout > 0 or self.retry_after < 0:
            raise ValueError(f"bad server limits: {self}")

    @property
    def backlog(self) -> int:
        """Listen backlog: a burst of every connection we would serve, queue or reject at once."""
        return max(128, 2 * (self.workers + self.queue))


class HTTPBodyError(Exception):
    """A request body that cannot be read; answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _DeadlineReader(io.RawIOBase):
    """The connection's read side: each receive waits at most until the handler's deadline."""

    def __init__(self, handler: BoundedRequestHandler):
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        h = self._handler
        late = TimeoutError(f"request not received within {h.server.limits.read_timeout:g} s")
        left = h.read_deadline - time.monotonic()
        if left <= 0:
            raise late
        h.connection.settimeout(left)
        try:
            return h.connection.recv_into(buffer)
        except TimeoutError:
            raise late from None
        finally:
            h.connection.settimeout(h.server.limits.read_timeout)  # for the writes that follow


class BoundedRequestHandler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler with the read deadline and `read_body` (for PooledHTTPServer)."""

    protocol_version = "HTTP/1.1"
    server: PooledHTTPServer
    read_deadline = 0.0
    _keep_alive = False
    _connection_sent = False

    def setup(self) -> None:
        self.timeout = self.server.limits.read_timeout  # the socket's timeout for writes
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle(self) -> None:
        self.close_connection = True
        while True:
            self.read_deadline = time.monotonic() + self.server.limits.read_timeout
            self.handle_one_request()
            if self.close_connection:
                return

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() == "connection":
            self._connection_sent = True
        super().send_header(keyword, value)

    def end_headers(self) -> None:
        # Say when we close (the client must not reuse the connection), and close when others
        # queue: the worker goes to a waiting connection rather than to this one's next request.
        if not self._connection_sent and (self.close_connection or self.server.has_waiting()):
            self.send_header("Connection", "close")
        self._connection_sent = False
        super().end_headers()

    def read_body(self, max_bytes: int) -> bytes:
        """The request body, read exactly once (Content-Length or chunked); raises HTTPBodyError
        or TimeoutError, after which the connection is closed (its stream is out of step)."""
        self.close_connection = True  # until the body has been read to its end
        codings = [
            c.strip().lower() for v in self.headers.get_all("Transfer-Encoding") or [] for c in v.split(",")
        ]
        length = self.headers.get_all("Content-Length") or []
        if codings and length:
            raise HTTPBodyError(400, "both Transfer-Encoding and Content-Length: ambiguous request length")
        if codings:
            if codings != ["chunked"]:
                raise HTTPBodyError(
                    501, f"Transfer-Encoding {', '.join(codings)!r} is not supported (only chunked)"
                )
            body = self._read_chunked(max_bytes)
        else:
            if len(set(length)) > 1 or not all(v.strip().isdigit() for v in length):
                raise HTTPBodyError(400, "invalid Content-Length header")
            n = int(length[0]) if length else 0
            if n > max_bytes:
                raise HTTPBodyError(413, f"request body over {max_bytes} bytes")
            body = self.rfile.read(n)
            if len(body) < n:
                raise HTTPBodyError(400, f"connection closed after {len(body)} of {n} body bytes")
        self.close_connection = not self._keep_alive
        return body

    def _read_chunked(self, max_bytes: int) -> bytes:
        parts, total = [], 0
        while True:
            line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            if not line.endswith(b"\n"):
                raise HTTPBodyError(400, "malformed chunked body: chunk-size line missing or too long")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPBodyError(400, f"malformed chunked body: bad chunk size {line[:40]!r}") from None
            if size < 0:
                raise HTTPBodyError(400, "malformed chunked body: negative chunk size")
            if size == 0:
                break
            total += size
            if total > max_bytes:
                raise HTTPBodyError(413, f"request body over {max_bytes} bytes")
            data = self.rfile.read(size)
            if len(data) < size or self.rfile.read(2) != b"\r\n":
                raise HTTPBodyError(400, "malformed chunked body: a chunk is shorter than its size")
            parts.append(data)
        for _ in range(_MAX_TRAILERS):  # trailer fields (ignored) up to the blank line
            line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            if line in (b"\r\n", b"\n"):
                return b"".join(parts)
            if not line.endswith(b"\n"):
                break
        raise HTTPBodyError(400, "malformed chunked body: unterminated trailer")

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._keep_alive = not self.close_connection  # what the client asked for
        if ok and self.command not in ("POST", "PUT", "PATCH"):
            # A body we will not read must not be parsed as the next request.
            if (
                self.headers.get("Transfer-Encoding")
                or (self.headers.get("Content-Length") or "0").strip() != "0"
            ):
                self.close_connection = True
        return ok


class PooledHTTPServer(HTTPServer):
    """An HTTPServer with a fixed pool of worker threads, a bounded queue and 503s beyond it."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedRequestHandler],
        limits: ServerLimits,
        log: Callable[[str], None],
    ):
        self.limits = limits
        self.log = log
        self.request_queue_size = limits.backlog  # read by server_activate (listen)
        # Capacity: `workers` connections in service (taken off this queue) + `queue` waiting in it.
        self._pending: queue.Queue[tuple[socket.socket, Any]] = queue.Queue(maxsize=limits.queue)
        self._lingering: queue.Queue[socket.socket] = queue.Queue()
        self._stopping = threading.Event()
        self.rejected = 0
        self._busy = _busy_response(limits)
        super().__init__(address, handler)
        self.threads = [
            threading.Thread(target=self._work, daemon=True, name=f"serve-worker-{i}")
            for i in range(limits.workers)
        ] + [threading.Thread(target=self._linger, daemon=True, name="serve-linger")]
        for t in self.threads:
            t.start()

    def has_waiting(self) -> bool:
        return not self._pending.empty()

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            self._pending.put_nowait((request, client_address))
        except queue.Full:
            self._reject(request)

    def _reject(self, sock: socket.socket) -> None:
        """Answer 503 at once (a few hundred bytes: the fresh socket's send buffer takes them
        without blocking the accept loop), then let the linger thread read the request away."""
        self.rejected += 1
        try:
            sock.setblocking(False)
            sock.send(self._busy)
        except OSError:
            sock.close()
            return
        self.shutdown_request(sock)

    def shutdown_request(self, request: Any) -> None:
        """Close gracefully (every connection ends here): our side first, then the linger thread
        reads what the client still sends before the socket is closed."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.setblocking(False)
        except OSError:
            request.close()
            return
        if self._stopping.is_set():  # the linger thread is gone
            request.close()
        else:
            self._lingering.put(request)

    def _linger(self) -> None:
        """Read ended connections to their end before closing them: closing with unread input
        (a rejected request, a body we refused) would reset the connection, and the client could
        lose the 503 / 4xx it has not read yet. One thread for all (non-blocking), each given at
        most LINGER_S."""
        sel = selectors.DefaultSelector()
        ends: dict[socket.socket, float] = {}

        def drop(sock: socket.socket) -> None:
            sel.unregister(sock)
            del ends[sock]
            sock.close()

        while not self._stopping.is_set():
            while len(ends) < MAX_LINGERING:
                try:
                    sock = self._lingering.get(timeout=0.5 if not ends else 0)
                except queue.Empty:
                    break
                sel.register(sock, selectors.EVENT_READ)
                ends[sock] = time.monotonic() + LINGER_S
            if not ends:
                continue
            for key, _ in sel.select(timeout=0.05):
                try:
                    done = not key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    done = True
                if done:
                    drop(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for sock in [s for s, end in ends.items() if end <= now]:
                drop(sock)
        for sock in list(ends):
            drop(sock)
        sel.close()

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                request, address = self._pending.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.finish_request(request, address)
            except Exception:  # noqa: BLE001 - one line, the worker serves on
                self.handle_error(request, address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        self.log(f"{client_address[0]}: connection ended: {type(err).__name__}: {err}")

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()
        for q in (self._pending, self._lingering):
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                (item[0] if isinstance(item, tuple) else item).close()
        end = time.monotonic() + 2.0  # a worker mid-generation is left to finish on its own
        for t in self.threads:
            t.join(timeout=max(0.0, end - time.monotonic()))


def _busy_response(limits: ServerLimits) -> bytes:
    payload = {
        "error": {
            "message": f"server busy ({limits.workers} workers, {limits.queue} queued); retry",
            "type": "server_error",
            "param": None,
            "code": "server_busy",
        }
    }
    body = json.dumps(payload).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Retry-After: {limits.retry_after}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
