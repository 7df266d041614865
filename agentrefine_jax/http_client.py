"""HTTP requests with one overall deadline, and API-key redaction: the owner for every outbound call.

Why not plain httpx / `openai` timeouts: they bound each socket operation, so a server that trickles
one byte every 2 s never trips a 5 s timeout and the request runs for ever. Here a request's
`timeout` covers everything (sending, the status line, headers and the whole body): every socket
operation gets only the time left, so a call returns or raises `RequestTimeout` within `timeout`
seconds (plus scheduling noise) whatever the server does. Opening the connection (TCP connect,
a proxy's CONNECT, the TLS handshake as a whole) is bounded by the time left when it starts,
and the deadline is checked again once it is open.

Use:
    reply = request("GET", url, params={"q": "x"}, timeout=10)   # -> HTTPReply; reply.json()
    client = openai_client(base_url, api_key, timeout=60, max_retries=0)  # openai.OpenAI on top
    one_line = describe_api_error(err, api_key)  # an openai exception, redacted, never the raw body
    text = redact(text, api_key)                 # the key, any case, and near-miss echoes of it

Errors: `RequestTimeout` (a TimeoutError) when the deadline passes, `RequestFailed` (an OSError)
when the connection cannot be made or breaks, both with a one-line message naming host and port.
Each call opens its own connection and sends `Connection: close` (no pooling: LLM calls are
seconds long, and a server's worker is freed at once). Proxies come from the usual environment
variables (HTTP_PROXY / HTTPS_PROXY / NO_PROXY); loopback hosts never go through a proxy.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import json
import os
import re
import socket
import ssl
import time
import urllib.parse
import urllib.request
from typing import Any

MAX_REPLY_BYTES = 64 * 2**20  # a reply larger than this is refused, not buffered
PLACEHOLDER_KEY = "EMPTY"  # what local servers (vLLM, llama.cpp, ours) accept when no key is set
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


class RequestTimeout(TimeoutError):
    """No complete reply within the request's deadline."""


class RequestFailed(OSError):
    """The connection could not be made, broke, or the reply was not HTTP."""


@dataclasses.dataclass(frozen=True)
class HTTPReply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def json(self) -> Any:
        return json.loads(self.body)


class _Deadline:
    def __init__(self, seconds: float, where: str):
        self.seconds, self.where = seconds, where
        self.at = time.monotonic() + seconds

    def error(self) -> RequestTimeout:
        return RequestTimeout(f"no complete reply from {self.where} within the {self.seconds:g} s deadline")

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.error()
        return left


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """The connected socket as http.client sees it: each send and receive gets only the time left."""

    def __init__(self, sock: socket.socket, deadline: _Deadline):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        """Nothing: http.client closes a will-close reply's connection once the headers are parsed, while
        the body is still to be read through `makefile` (a real socket's makefile keeps the descriptor
        open; ours does not), so `request` closes the real socket itself when the reply is read."""

    def __getattr__(self, name: str) -> Any:  # close, shutdown, ... as the real socket
        return getattr(self._sock, name)


def _tls_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if not os.environ.get("SSL_CERT_FILE"):
        try:  # the CA bundle httpx (and so the openai client) uses, where the system's is missing
            import certifi

            ctx.load_verify_locations(certifi.where())
        except (ImportError, OSError):
            pass
    return ctx


def _proxy_for(scheme: str, host: str) -> urllib.parse.SplitResult | None:
    if host in _LOOPBACK or host.startswith("127.") or urllib.request.proxy_bypass_environment(host):
        return None
    proxy = urllib.request.getproxies_environment().get(scheme)
    return urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}") if proxy else None


def _connection(
    url: urllib.parse.SplitResult, left: float
) -> tuple[http.client.HTTPConnection, str, list[tuple[str, str]]]:
    """An unconnected connection for `url` (through a proxy if the environment names one), the
    request target to send on it, and headers the proxy needs."""
    if url.scheme not in ("http", "https") or not url.hostname:
        raise RequestFailed(f"not an http(s) URL: {urllib.parse.urlunsplit(url)!r}")
    target = urllib.parse.urlunsplit(("", "", url.path or "/", url.query, ""))
    https = url.scheme == "https"
    proxy = _proxy_for(url.scheme, url.hostname)
    host, port = (url.hostname, url.port) if proxy is None else (proxy.hostname, proxy.port)
    if https:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=left, context=_tls_context()
        )
    else:
        conn = http.client.HTTPConnection(host, port, timeout=left)
    if proxy is None:
        return conn, target, []
    auth = []
    if proxy.username:
        cred = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
        auth = [("Proxy-Authorization", "Basic " + base64.b64encode(cred.encode()).decode())]
    if https:  # a CONNECT tunnel through the proxy, TLS end to end
        conn.set_tunnel(url.hostname, url.port, headers=dict(auth))
        return conn, target, []
    return conn, urllib.parse.urlunsplit(url._replace(fragment="")), auth


def request(
    method: str,
    url: str,
    *,
    timeout: float,
    params: dict[str, Any] | None = None,
    headers: dict[str, str] | list[tuple[str, str]] | None = None,
    body: bytes | None = None,
    json_body: Any = None,
    connect_timeout: float | None = None,
    max_bytes: int = MAX_REPLY_BYTES,
) -> HTTPReply:
    """One HTTP request that returns within `timeout` seconds in total, or raises.

    Any status is returned (the caller decides what a 4xx means); `RequestTimeout` when the
    deadline passes, `RequestFailed` when there is no usable HTTP exchange. `connect_timeout`
    (default: `timeout`) bounds the connect alone; it never extends the overall deadline.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    parts = urllib.parse.urlsplit(url)
    if params:
        query = "&".join(q for q in (parts.query, urllib.parse.urlencode(params, doseq=True)) if q)
        parts = parts._replace(query=query)
    where = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    deadline = _Deadline(timeout, where)
    hdrs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    if json_body is not None:
        body = json.dumps(json_body, ensure_ascii=False).encode()
        hdrs.append(("Content-Type", "application/json"))
    # Identity encoding: the byte cap below then bounds what we hold in memory. One request per
    # connection: nothing waits on a pooled socket, and a server frees its worker at once.
    # Host too: http.client writes it (from the URL), and a second Host header is a malformed request
    # that strict servers refuse (h11, under our own server: eval --base-url against it got 400s).
    skip = {"accept-encoding", "connection", "transfer-encoding", "content-length", "host"}
    hdrs = [(k, v) for k, v in hdrs if k.lower() not in skip]
    hdrs += [("Accept-Encoding", "identity"), ("Connection", "close")]
    conn, target, proxy_headers = _connection(parts, min(deadline.left(), connect_timeout or timeout))
    hdrs += proxy_headers
    raw: socket.socket | None = None
    try:
        try:
            conn.connect()
        except TimeoutError:
            raise RequestTimeout(f"could not connect to {where} within the deadline") from None
        raw = conn.sock
        deadline.left()  # a slow TLS handshake may have used it all
        conn.sock = _DeadlineSocket(raw, deadline)  # type: ignore[assignment]
        conn.putrequest(method, target, skip_accept_encoding=True)
        for k, v in hdrs:
            conn.putheader(k, v)
        if body is not None or method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        resp = conn.getresponse()
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise RequestFailed(f"reply from {where} is {int(length):,} bytes, over the {max_bytes:,} limit")
        data = resp.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise RequestFailed(f"reply from {where} is over the {max_bytes:,} byte limit")
        return HTTPReply(resp.status, list(resp.getheaders()), data)
    except RequestTimeout:
        raise
    except TimeoutError:  # a socket timeout: it was set to the time left, so the deadline passed
        raise deadline.error() from None
    except (http.client.HTTPException, ssl.SSLError) as e:
        raise RequestFailed(f"bad HTTP exchange with {where}: {type(e).__name__}: {e}") from None
    except OSError as e:
        if isinstance(e, RequestFailed):
            raise
        raise RequestFailed(f"cannot reach {where}: {e.strerror or e}") from None
    finally:
        conn.close()
        if raw is not None:
            raw.close()


# ------------------------------------------------------------------ the openai client on top


def _httpx_module() -> Any:
    """The httpx flavour the installed `openai` is built on (httpx, or httpx2 in newer releases)."""
    import importlib

    import openai

    base = next(c for c in openai.DefaultHttpxClient.__mro__[1:] if c.__name__ == "Client")
    return importlib.import_module(base.__module__.split(".")[0])


def openai_client(base_url: str, api_key: str, *, timeout: float, max_retries: int) -> Any:
    """An `openai.OpenAI` whose every HTTP request ends within `timeout` seconds in total.

    `max_retries` are the openai client's own retries (each a new request with its own deadline).
    """
    import openai

    if not timeout > 0:
        raise ValueError(f"the request timeout must be > 0 seconds, got {timeout!r}")
    hx = _httpx_module()

    class DeadlineTransport(hx.BaseTransport):
        def handle_request(self, req: Any) -> Any:
            # The per-request timeout openai attaches (its `timeout` option) is the whole deadline.
            limit = (req.extensions.get("timeout") or {}).get("read") or timeout
            try:
                reply = request(
                    req.method,
                    str(req.url),
                    timeout=min(timeout, limit),
                    headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers.raw],
                    body=req.read(),
                )
            except RequestTimeout as e:
                raise hx.ReadTimeout(str(e), request=req) from None
            except RequestFailed as e:
                raise hx.ConnectError(str(e), request=req) from None
            return hx.Response(reply.status, headers=reply.headers, content=reply.body, request=req)

    http_client = openai.DefaultHttpxClient(transport=DeadlineTransport(), timeout=timeout)
    return openai.OpenAI(
        base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries, http_client=http_client
    )


# ------------------------------------------------------------------ redaction

# Split points around a token that might be a (mangled) key: whitespace, quotes, brackets, separators.
_TOKEN = re.compile(r"[^\s\"'`,;:=()<>\[\]{}|]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)\S+")
_SK = re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}")


def _distance(a: str, b: str, cap: int) -> int:
    """Levenshtein distance, stopping early once it exceeds `cap`."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        if min(cur) > cap:
            return cap + 1
        prev = cur
    return prev[-1]


def redact(text: str, secret: str | None) -> str:
    """`text` with the key removed: exact, any case, and near misses (a few characters added,
    dropped or changed: a provider echoing a mistyped or truncated key), plus anything sent as
    `Bearer ...` and OpenAI-style `sk-...` tokens. Short keys (< 8 characters) are matched
    exactly (any case) only, so ordinary words are never taken for them."""
    text = _BEARER.sub(r"\1***", text)
    text = _SK.sub("***", text)
    if not secret or secret == PLACEHOLDER_KEY:
        return text
    text = re.sub(re.escape(secret), "***", text, flags=re.IGNORECASE)
    if len(secret) < 8:
        return text
    key = secret.lower()
    slack = max(2, len(key) // 8)

    def near(m: re.Match[str]) -> str:
        tok = m.group(0)
        if abs(len(tok) - len(key)) > slack:
            return tok
        return "***" if _distance(tok.lower(), key, slack) <= slack else tok

    return _TOKEN.sub(near, text)


def describe_api_error(err: BaseException, secret: str | None = None, limit: int = 300) -> str:
    """One redacted line for an `openai` error: the HTTP status with the provider's error type or
    code and message, or what went wrong on the connection. Never the raw body."""
    status = getattr(err, "status_code", None)
    if status is not None:
        body = getattr(err, "body", None)
        info = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(info, dict):
            kind = info.get("code") or info.get("type")
            message = info.get("message")
            text = f"HTTP {status}" + (f" ({kind})" if kind else "") + (f": {message}" if message else "")
        else:  # not OpenAI's error object (an HTML page from a proxy, ...): its size, not its text
            size = len(str(body)) if body else 0
            text = f"HTTP {status}" + (
                f" with a {size}-character body that is not an API error" if size else ""
            )
    else:  # no reply: a timeout or connection error carries our transport's one line as its cause
        label = "timed out" if "Timeout" in type(err).__name__ else type(err).__name__
        text = f"{label}: {err.__cause__ or err}"
    text = " ".join(redact(text, secret).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
