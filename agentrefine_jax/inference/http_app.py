"""The server's ASGI app (Starlette): routes, request bodies, the key check, and the model's thread.

Routes: `POST /v1/chat/completions` (`stream: true`: server-sent events, `_EventStream`),
`GET /v1/models`, `GET /health` (a trailing slash or a query string does not matter); anything else
is 404 in OpenAI's error format.

The event loop never runs the model or parses a large body. Each chat request is read here (counted
as it arrives: a body over `max_body_bytes` is refused at once), parsed and validated on one
"serve-parse" thread (JSON, then the prompt's size against the context before any tokenizing:
`ChatService.parse`), then generated on one "serve-model" thread: the one model serves one request
at a time, in arrival order, as before. While it waits or generates, the request watches its
connection: a client that goes away has its generation cancelled at the next decode chunk (or
before it starts) and is answered nothing -- no traceback, no 500; the log says 499 (as nginx
does). `stop_all()` (the drain's grace period is over, or Ctrl-C) cancels every request in flight;
each is answered 503 `server_shutting_down`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import traceback
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from agentrefine_jax.inference.api_errors import APIError, json_bytes
from agentrefine_jax.inference.chat import GenerationCancelled

GONE = 499  # logged (never sent) for a request whose client closed the connection first
_CLOSE = {"connection": "close"}


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(payload), status_code=status, media_type="application/json", headers=headers)


def _error(err: APIError, headers: dict[str, str] | None = None) -> Response:
    return _json(err.status, err.body(), headers)


class ChatApp:
    """The ASGI app over a `ChatService` (inference/server.py)."""

    def __init__(self, service: Any, *, max_body_bytes: int):
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.stopping = False
        self._jobs: set[threading.Event] = set()  # the cancel flag of each chat request in flight
        self._parse = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serve-parse")
        self._model = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="serve-model")
        not_found = {404: self._no_route, 405: self._no_route}
        self._app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ],
            exception_handlers=not_found,  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ for the server

    def in_flight(self) -> int:
        return len(self._jobs)

    def stop_all(self) -> None:
        """Cancel every chat request in flight and refuse new ones (503)."""
        self.stopping = True
        for cancel in list(self._jobs):
            cancel.set()

    def close(self) -> None:
        """Let the threads go (a generation in progress ends at its next chunk when cancelled)."""
        for pool in (self._parse, self._model):
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        scope = {**scope, "path": scope["path"].rstrip("/") or "/"}
        headers = dict(scope["headers"])
        # A body we do not read (GET, HEAD) ends the connection after the response, as it always did.
        body_unread = scope["method"] not in ("POST", "PUT", "PATCH") and (
            b"transfer-encoding" in headers or headers.get(b"content-length", b"0").strip() != b"0"
        )
        status = GONE

        async def send_noted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if body_unread:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self._app(scope, receive, send_noted)
        client = scope.get("client") or ("-", 0)
        self.service.log(f'{client[0]}:{client[1]} "{scope["method"]} {scope["path"]}" {status}')

    # ------------------------------------------------------------------ routes

    async def _no_route(self, request: Request, exc: HTTPException) -> Response:
        return _error(APIError(404, f"no route {request.method} {request.url.path}"))

    async def _health(self, request: Request) -> Response:
        return _json(200, {"status": "ok", "model": self.service.model_name})

    def _refused(self, request: Request) -> Response | None:
        if self.service.authorized(request.headers.get("authorization")):
            return None
        return _error(APIError(401, "invalid or missing API key", code="invalid_api_key"))

    async def _models(self, request: Request) -> Response:
        return self._refused(request) or _json(200, self.service.models())

    async def _read_body(self, request: Request) -> bytearray:
        """The body, counted as it arrives; APIError 413 (with the connection closed) beyond the cap."""
        over = APIError(413, f"request body over {self.max_body_bytes} bytes")
        length = request.headers.get("content-length")
        if length is not None and int(length) > self.max_body_bytes:  # h11 checked it is a number
            raise over
        body = bytearray()
        async for chunk in request.stream():
            if len(body) + len(chunk) > self.max_body_bytes:
                raise over
            body += chunk
        return body

    async def _chat(self, request: Request) -> Response | _EventStream:
        if refused := self._refused(request):
            return refused  # an unread body is read away by uvicorn (the connection stays in step)
        if "transfer-encoding" in request.headers and "content-length" in request.headers:
            err = APIError(400, "both Transfer-Encoding and Content-Length: ambiguous request length")
            return _error(err, _CLOSE)
        loop = asyncio.get_running_loop()
        try:
            raw = await self._read_body(request)
            request_ = await loop.run_in_executor(self._parse, self.service.parse, raw)
        except ClientDisconnect:  # gone, or its body was late (the transport answered 408)
            return Response(status_code=GONE)
        except APIError as e:
            return _error(e, _CLOSE if e.status == 413 else None)
        cancel = threading.Event()
        self._jobs.add(cancel)
        streaming = False
        try:
            if request_.stream:
                response = await self._stream(request, request_, cancel)
                streaming = isinstance(response, _EventStream)  # it lets the job go when it ends
                return response
            return await self._generate(request, request_, cancel)
        except asyncio.CancelledError:  # the loop is closing (Ctrl-C): the client is gone already
            cancel.set()
            return Response(status_code=GONE)
        finally:
            if not streaming:
                self._jobs.discard(cancel)

    async def _generate(self, request: Request, chat_request: Any, cancel: threading.Event) -> Response:
        if self.stopping:
            return self._shutting_down()
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._model, self.service.complete, chat_request, cancel.is_set)
        # Retrieve the outcome whoever waits for it (a cancelled job's exception is not an error).
        job.add_done_callback(lambda f: f.cancelled() or f.exception())
        watch = asyncio.ensure_future(request.receive())  # completes only when the client goes away
        try:
            await asyncio.wait((job, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not job.done():
            cancel.set()  # the model thread stops at its next decode chunk
            self._gone(request)
            return Response(status_code=GONE)
        return self._answer(job)

    async def _stream(
        self, request: Request, chat_request: Any, cancel: threading.Event
    ) -> Response | _EventStream:
        """`stream: true`: the chunks as server-sent events (`_EventStream`). An error before the
        first chunk (a malformed conversation, a prompt that leaves no room) is answered as without
        streaming: a status and OpenAI's error body."""
        if self.stopping:
            return self._shutting_down()
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def emit(chunk: dict) -> None:  # on the model thread
            with contextlib.suppress(RuntimeError):  # the loop is closed (Ctrl-C): nobody listens
                loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        job = loop.run_in_executor(self._model, self.service.stream, chat_request, cancel.is_set, emit)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())
        job.add_done_callback(lambda _: chunks.put_nowait(_END))  # after every chunk it emitted
        watch = asyncio.ensure_future(request.receive())  # completes only when the client goes away
        first = await _next(chunks, watch)
        if first is None:
            cancel.set()
            self._gone(request)
            return Response(status_code=GONE)
        if first is _END:
            watch.cancel()
            return self._answer(job)
        return _EventStream(self, request, cancel, first, chunks, watch, job)

    def _answer(self, job: asyncio.Future) -> Response:
        """The response for a finished job (its body, or the error it raised)."""
        try:
            return _json(200, job.result())
        except GenerationCancelled:
            return self._shutting_down()
        except APIError as e:
            return _error(e)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            traceback.print_exception(e, file=sys.stderr)
            return _error(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    def finished(self, cancel: threading.Event) -> None:
        """A streamed request has ended (it stays in flight, for the drain, until its last event)."""
        self._jobs.discard(cancel)

    def _gone(self, request: Request) -> None:
        client = request.client
        self.service.log(f"{client.host if client else '-'}: client went away; generation cancelled")

    def _shutting_down(self) -> Response:
        err = APIError(503, "server is shutting down; retry", code="server_shutting_down")
        return _error(err, {"retry-after": "1", **_CLOSE})


_END = object()  # the stream's job has ended (after every chunk it emitted)


async def _next(chunks: asyncio.Queue, watch: asyncio.Future) -> Any:
    """The next chunk (or _END), or None when the client went away first."""
    get = asyncio.ensure_future(chunks.get())
    await asyncio.wait((get, watch), return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


class _EventStream:
    """Chunks as server-sent events, as OpenAI streams: `data: {chunk}` each, `data: [DONE]` last.
    A client that goes away cancels the generation (at its next decode chunk); an error after the
    first chunk is one `data: {"error": ...}` event (what OpenAI's clients raise), then the end."""

    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),  # a proxy in front must not hold the events back
    ]

    def __init__(
        self,
        app: ChatApp,
        request: Request,
        cancel: threading.Event,
        first: dict,
        chunks: asyncio.Queue,
        watch: asyncio.Future,
        job: asyncio.Future,
    ):
        self._app, self._request, self._cancel = app, request, cancel
        self._first, self._chunks, self._watch, self._job = first, chunks, watch, job

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await self._send_all(send)
        except (asyncio.CancelledError, OSError):  # the loop is closing (Ctrl-C), or the socket failed
            self._cancel.set()
            raise
        finally:
            self._watch.cancel()
            self._app.finished(self._cancel)

    async def _send_all(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        chunk = self._first
        while chunk is not _END:
            await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
            chunk = await _next(self._chunks, self._watch)
            if chunk is None:
                self._cancel.set()
                self._app._gone(self._request)
                return
        error = self._error()
        if error is not None:
            await send({"type": "http.response.body", "body": _event(error.body()), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    def _error(self) -> APIError | None:
        try:
            self._job.result()
        except GenerationCancelled:
            return APIError(503, "server is shutting down; retry", code="server_shutting_down")
        except APIError as e:
            return e
        except Exception as e:  # noqa: BLE001 - report, keep serving
            traceback.print_exception(e, file=sys.stderr)
            return APIError(500, f"internal error: {type(e).__name__}: {e}")
        return None


def _event(payload: Any) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"
