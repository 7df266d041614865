"""An OpenAI-compatible chat-completions server for our models.

    python -m agentrefine_jax.inference serve --checkpoint CKPT --port 8000
    # then, from any OpenAI client:
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x").chat.completions.create(
        model=NAME, messages=[...], max_tokens=256, temperature=0.7)

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health. Three layers, one concern each:
this module is the API (request validation, generation, response bodies: `ChatService`);
inference/http_app.py the ASGI app (Starlette: routes, bodies, the key check, the model's thread,
cancellation); inference/http_transport.py the HTTP server (uvicorn: connection limit, read
deadline, graceful closes, the SIGTERM drain). Requests are served one at a time on the one model
(its own thread), so a request never waits on a half-finished batch of another. Bound to
127.0.0.1 unless --host says otherwise; when the environment variable named by --api-key-env is
set, every /v1 request must carry it as a Bearer token (the key itself is never logged).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax

from agentrefine_jax.data.tool_replies import ToolReply, parse_tool_reply, tool_format
from agentrefine_jax.inference.api_errors import APIError
from agentrefine_jax.inference.chat import (
    ChatGenerator,
    Completion,
    ContextOverflowError,
    GenerationCancelled,
)
from agentrefine_jax.inference.engine import batch_bucket, bucket
from agentrefine_jax.inference.http_app import ChatApp
from agentrefine_jax.inference.http_transport import Drained, HTTPServer, ServerLimits
from agentrefine_jax.unicode_text import lone_surrogate

__all__ = ["APIError", "ChatService", "Drained", "ServerLimits", "make_server", "parse_chat_request"]

MAX_BODY_BYTES = 16 * 2**20
# Request shapes whose compiled programs are kept at once (see ChatService.programs_for).
MAX_PROGRAM_SHAPES = 32
MAX_STOP_STRINGS = 4  # as the OpenAI API
# Accepted but without effect here (bookkeeping fields of the OpenAI API).
_IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})


@dataclasses.dataclass
class ChatRequest:
    # The conversation as the chat template takes it (data/schema.py): the request's `tools` (those
    # offered: all, or the one `tool_choice` names) on the first message, calls' arguments as objects.
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: list[str]
    seed: int
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    # The function names whose calls the reply is read for (data/tool_replies.py); None: the reply is
    # text (no tools, or tool_choice "none").
    tool_names: frozenset[str] | None = None


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise APIError(400, f"'{key}' must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def _integer(body: dict[str, Any], key: str, default: int | None, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise APIError(400, f"'{key}' must be an integer >= {lo}, got {value!r}", param=key)
    return value


def _content(value: Any, i: int) -> str:
    """Message content: a string, or a list of text parts (joined); anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _arguments(value: Any, where: str) -> dict[str, Any]:
    """A call's arguments: OpenAI sends a JSON string of an object (an object itself is taken too)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise APIError(400, f"{where}.arguments is not a JSON object", param="messages") from None
    if not isinstance(value, dict):
        raise APIError(400, f"{where}.arguments must be a JSON object", param="messages")
    return value


def _calls(value: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, as the templates render them (arguments as objects)."""
    if not isinstance(value, list) or not value:
        raise APIError(400, f"messages[{i}].tool_calls must be a non-empty list", param="messages")
    out = []
    for j, call in enumerate(value):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(call.get("id"), str)
        ):
            raise APIError(
                400, f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                param="messages",
            )  # fmt: skip
        args = _arguments(fn.get("arguments", "{}"), where)
        out.append(
            {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}
        )
    return out


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(
                400,
                f"messages[{i}].role {role!r} is not supported (system, user, assistant, tool)",
                param="messages",
            )
        if m.get("function_call"):
            raise APIError(400, f"messages[{i}]: function_call is the legacy form; send tool_calls",
                           param="messages")  # fmt: skip
        calls = _calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") else None
        content = m.get("content")
        msg: dict[str, Any] = {
            "role": role,
            "content": "" if content is None and calls else _content(content, i),
        }
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise APIError(400, f"messages[{i}]: a tool message needs its tool_call_id", param="messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "'tools' must be a non-empty list of functions", param="tools")
    out, names = [], set()
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise APIError(
                400, f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}", param="tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name) or name in names:
            raise APIError(
                400, f"tools[{j}].function.name must be a unique name of 1-64 letters, digits, _ or -, "
                f"got {name!r}", param="tools",
            )  # fmt: skip
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise APIError(400, f"tools[{j}].function: parameters must be an object, description a string",
                           param="tools")  # fmt: skip
        names.add(name)
        out.append({"type": "function", "function": fn})
    return out


def _offered(tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]] | None:
    """The functions offered to the model under `tool_choice`; None: "none" (the reply is text)."""
    if choice in (None, "auto"):
        return tools
    if choice == "none":
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str):
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise APIError(400, f"tool_choice names {name!r}, which is not in 'tools'", param="tool_choice")
        return named
    raise APIError(
        400,
        f"tool_choice {choice!r} is not supported: 'auto', 'none' or "
        "{'type': 'function', 'function': {'name': ...}} (no constrained decoding, so not 'required')",
        param="tool_choice",
    )


def parse_chat_request(
    body: Any, *, model_name: str, default_max_tokens: int, max_n: int, rng: secrets.SystemRandom
) -> ChatRequest:
    """Validate a /v1/chat/completions body; unsupported options are refused, not ignored."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if body.get("model") != model_name:
        raise APIError(
            404,
            f"model {body.get('model')!r} is not served here; use {model_name!r}",
            param="model",
            code="model_not_found",
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be a boolean, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and (
        not stream
        or not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise APIError(
            400, "'stream_options' is {'include_usage': bool}, with stream=true only", param="stream_options"
        )
    if body.get("logprobs") or body.get("top_logprobs"):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if body.get("functions") or body.get("function_call"):
        raise APIError(
            400, "'functions' / 'function_call' are the legacy form; send 'tools'", param="functions"
        )
    tools = _tools(body["tools"]) if body.get("tools") is not None else None
    if tools is None and body.get("tool_choice") not in (None, "none"):
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    offered = _offered(tools, body.get("tool_choice")) if tools else None
    if tools and stream:
        raise APIError(
            400, "stream=true with tools is not supported; send the request without stream", param="stream"
        )
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(400, f"'{key}' is not supported (only 0)", param=key)
    if body.get("logit_bias"):
        raise APIError(400, "'logit_bias' is not supported", param="logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
    known = {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
        "seed", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "functions", "tool_choice",
        "function_call", "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
    }  # fmt: skip
    unknown = sorted(set(body) - known - _IGNORED_FIELDS)
    if unknown:
        raise APIError(400, f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0])

    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    max_tokens = _integer(body, "max_tokens", max_tokens, 1)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        stops = list(stop)
    else:
        raise APIError(
            400, f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings", param="stop"
        )
    seed = _integer(body, "seed", None, 0)
    n = int(_integer(body, "n", 1, 1) or 1)
    if n > max_n:
        raise APIError(400, f"'n' must be at most {max_n} on this server", param="n")
    messages = _messages(body.get("messages"))
    if tools:  # rendered as the family's template renders a row's tools (data/schema.py: first message)
        messages[0]["tools"] = offered if offered is not None else tools
    return ChatRequest(
        messages=messages,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's default is 1
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        n=n,
        stop=stops,
        seed=rng.randrange(2**31) if seed is None else seed % 2**31,
        stream=bool(stream),
        include_usage=bool(options and options.get("include_usage")),
        tool_names=frozenset(t["function"]["name"] for t in offered) if offered else None,
    )


class ChatService:
    """The model behind the HTTP layers: validation, generation, response bodies (thread-safe: the
    app parses on one thread and generates on another)."""

    def __init__(
        self,
        generator: ChatGenerator,
        *,
        model_name: str | None = None,
        default_max_tokens: int = 512,
        max_n: int = 16,
        api_key: str | None = None,
        log: Any = None,
        max_program_shapes: int = MAX_PROGRAM_SHAPES,
    ):
        if max_program_shapes < 1:
            raise ValueError(f"max_program_shapes must be >= 1, got {max_program_shapes}")
        self.generator = generator
        self.max_program_shapes = max_program_shapes
        self.shapes: set[tuple[int, int, int, bool]] = set()  # those compiled since the last clear
        self.program_clears = 0
        self.model_name = model_name or generator.name
        self.default_max_tokens = default_max_tokens
        self.max_n = max_n
        self._api_key = api_key or None
        self._rng = secrets.SystemRandom()
        self.created = int(time.time())
        self.log = log or logging.getLogger(__name__).info
        # The family's tool-call format (data/tool_replies.py); None: the template renders no tools.
        self.tool_format = tool_format(generator.template)
        self.malformed_tool_calls = 0  # replies whose call text did not parse (answered as content)

    def authorized(self, header: str | None) -> bool:
        if self._api_key is None:
            return True
        given = (header or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self._api_key.encode())

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "agentrefine_jax",
        }
        return {"object": "list", "data": [card]}

    def parse(self, raw: bytes | bytearray) -> ChatRequest:
        """A request body -> a validated ChatRequest, or APIError; no tokenizing: a prompt whose text
        cannot fit the context is refused on its size (`ChatGenerator.check_fits`)."""
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "request body is JSON nested deeper than the parser allows") from None
        if bad_text := lone_surrogate(body):  # anywhere (a key, a stop string): unencodable text
            raise APIError(400, f"request body: {bad_text}")
        req = parse_chat_request(
            body,
            model_name=self.model_name,
            default_max_tokens=self.default_max_tokens,
            max_n=self.max_n,
            rng=self._rng,
        )
        uses_tools = any(m.get("tools") or m.get("tool_calls") or m["role"] == "tool" for m in req.messages)
        if uses_tools and self.tool_format is None:
            raise APIError(
                400,
                f"this model's chat template ({self.generator.template.name}) renders no tools; "
                "serve one whose template does (llama3, mistral, or an hf directory with <tool_call>)",
                param="tools",
            )
        try:
            self.generator.check_fits(req.messages)
        except ContextOverflowError as e:
            raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        return req

    def _generate(
        self,
        req: ChatRequest,
        cancelled: Callable[[], bool] | None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> tuple[list[Completion], dict[str, int]]:
        """Generate (on the caller's thread): the completions and the usage; `cancelled()` is asked
        before and during generation (raises chat.GenerationCancelled)."""
        if cancelled is not None and cancelled():
            self.log("chat.completions: generation cancelled before it started")
            raise GenerationCancelled("cancelled before it started")
        t0 = time.perf_counter()
        try:
            self.programs_for(req)
            done = self.generator.complete(
                [req.messages] * req.n,
                max_new_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                stop=req.stop,
                seed=req.seed,
                cancelled=cancelled,
                on_text=on_text,
            )
        except GenerationCancelled as e:
            self.log(f"chat.completions: generation {e}")
            raise
        except ContextOverflowError as e:
            raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
        except ValueError as e:  # malformed conversation (role order, empty content, ...)
            raise APIError(400, str(e), param="messages") from None
        completion_tokens = sum(c.completion_tokens for c in done)
        prompt_tokens = done[0].prompt_tokens
        self.log(
            f"chat.completions n={req.n} prompt={prompt_tokens} completion={completion_tokens} "
            f"T={req.temperature:g} top_p={req.top_p:g}{' stream' if req.stream else ''} "
            f"in {time.perf_counter() - t0:.2f}s"
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return done, usage

    def programs_for(self, req: ChatRequest) -> None:
        """Bound the compiled programs the process holds (on the model thread, before generating).

        The engine compiles one prefill and one decode program per request shape -- batch bucket
        (n), prompt-length bucket, max-new-tokens bucket, greedy or sampled (`engine.bucket`) -- and
        jit keeps every one for the life of the process: varied requests made RSS grow by a few MB
        per new shape (0.9 -> 1.4 GB over ~350 varied requests, issue 44), for up to hundreds of
        shapes (thousands at an 8k context). Once `max_program_shapes` distinct shapes were compiled,
        a new one clears jax's caches first (`jax.clear_caches`: the executables are freed) and
        counting starts over: the programs held, and so RSS, stay bounded, at the price of compiling
        again a shape seen before the clear. Raises ValueError for a malformed conversation."""
        prompt = len(self.generator.encode(req.messages))
        room = self.generator.model.cfg.max_position_embeddings - prompt
        new = min(req.max_tokens, room)
        if new < 1:
            return  # refused by the generator: nothing is compiled
        shape = (batch_bucket(req.n), bucket(prompt), bucket(new), req.temperature == 0.0)
        if shape in self.shapes:
            return
        if len(self.shapes) >= self.max_program_shapes:
            jax.clear_caches()
            self.shapes.clear()
            self.program_clears += 1
            self.log(
                f"chat.completions: {self.max_program_shapes} request shapes compiled; "
                "compiled programs cleared (--max-program-shapes)"
            )
        self.shapes.add(shape)

    def complete(self, req: ChatRequest, cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Generate (on the caller's thread) and build the response body; `cancelled()` is asked
        before and during generation (raises chat.GenerationCancelled)."""
        done, usage = self._generate(req, cancelled)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
            "choices": [self._choice(req, i, c) for i, c in enumerate(done)],
            "usage": usage,
        }

    def _choice(self, req: ChatRequest, index: int, c: Completion) -> dict[str, Any]:
        """One choice of a response; with tools offered, the reply read for calls in the family's
        format (OpenAI's `tool_calls`, finish_reason "tool_calls"); call text that does not parse is
        answered as content and counted."""
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if req.tool_names is not None and self.tool_format is not None:
            reply = self._read_calls(self.tool_format, req.tool_names, c)
            if reply.error is not None:
                self.malformed_tool_calls += 1
                self.log(
                    f"chat.completions: {reply.error}; answered as content "
                    f"({self.malformed_tool_calls} such replies so far)"
                )
            if reply.calls:
                message["content"] = reply.content or None
                message["tool_calls"] = [
                    {
                        "id": call.get("id") or uuid.uuid4().hex[:9],  # 9 characters: Mistral's id rule
                        "type": "function",
                        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                    }
                    for call in reply.calls
                ]
                finish = "tool_calls"
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": None}

    def _read_calls(self, fmt: str, names: frozenset[str], c: Completion) -> ToolReply:
        ids = list(c.token_ids)
        if c.finish_reason == "stop" and ids and ids[-1] in self.generator.stop_token_ids:
            ids = ids[:-1]  # the end token (a stop string's cut is in the text; only Mistral reads ids)
        return parse_tool_reply(fmt, c.text, ids, self.generator.template, names)

    def stream(
        self,
        req: ChatRequest,
        cancelled: Callable[[], bool] | None,
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        """Generate (on the caller's thread), handing each `chat.completion.chunk` to `emit` as OpenAI
        streams them: the role first, then content deltas after each decode chunk, then each
        choice's finish_reason (and, with include_usage, a last chunk with the usage). Errors before
        the first chunk are raised as by `complete`; nothing is emitted for them."""
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        sent = [""] * req.n  # the text each choice has streamed so far
        started = False

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> None:
            nonlocal started
            if not started:  # the role comes first, as OpenAI's stream
                started = True
                head = [_choice(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
                chunk(head)
            body = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "system_fingerprint": None,
                "choices": choices,
            }
            if req.include_usage:
                body["usage"] = usage
            emit(body)

        def on_text(i: int, text: str) -> None:
            safe = streamable(text, req.stop)
            if len(safe) > len(sent[i]) and safe.startswith(sent[i]):
                chunk([_choice(i, {"content": safe[len(sent[i]) :]})])
                sent[i] = safe

        done, usage = self._generate(req, cancelled, on_text)
        for i, c in enumerate(done):
            if not c.text.startswith(sent[i]):  # never expected: what was sent cannot be taken back
                self.log(f"chat.completions: streamed text of choice {i} is not a prefix of its reply")
            elif len(c.text) > len(sent[i]):
                chunk([_choice(i, {"content": c.text[len(sent[i]) :]})])
            chunk([_choice(i, {}, c.finish_reason)])
        if req.include_usage:
            chunk([], usage)


def _choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def streamable(text: str, stops: list[str]) -> str:
    """The part of a reply so far that no later token can change: without a trailing U+FFFD (a
    character whose bytes are not all generated yet), trailing whitespace (the tokenizer's clean-up
    may join it to what follows: " ." -> "."), or a tail that may be the start of a stop string
    (cut from the reply if it completes)."""
    end = len(text)
    while end and (text[end - 1] == "\ufffd" or text[end - 1].isspace()):
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[end - k : end] == stop[:k]:
                end -= k
                break
    return text[:end]


class ChatServer(HTTPServer):
    """The served app on its socket (see http_transport.HTTPServer); `server_close()` also lets the
    app's threads go."""

    def __init__(self, service: ChatService, host: str, port: int, limits: ServerLimits):
        self.app = ChatApp(service, max_body_bytes=MAX_BODY_BYTES)
        super().__init__(
            self.app,
            host,
            port,
            limits,
            service.log,
            in_flight=self.app.in_flight,
            on_expiry=self.app.stop_all,
        )

    def server_close(self) -> None:
        super().server_close()
        self.app.close()


def make_server(
    service: ChatService, host: str = "127.0.0.1", port: int = 8000, limits: ServerLimits | None = None
) -> ChatServer:
    """A bound (not yet serving) server; port 0 picks a free port (see server.server_address).

    `serve_forever()` serves until `drain()` (SIGTERM), `interrupt()` (Ctrl-C) or `shutdown()`
    (another thread) and returns how it ended (`Drained`); `server_close()` releases it."""
    return ChatServer(service, host, port, limits or ServerLimits())
