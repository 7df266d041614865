"""OpenAI-compatible chat-completions backend (GPT-4o, DeepSeek, a local vLLM server, ...).

The `openai` client's own retries are disabled so that the policy lives here: exponential
backoff with jitter on 429 / 5xx / 408 / 409 / timeouts / connection errors (honouring
Retry-After), a fatal error on other 4xx (a bad key or model name would fail every request).
A 200 that is not a chat completion (a body that is not JSON, no `choices`, a choice without a
message: proxies and overloaded servers send these) is a transport fault, not the model's
answer, so it is retried the same way instead of costing the persona a regeneration.
`LLMSettings.timeout` is one deadline for the whole request (connect + reply), not per read, and
the API key is read from an environment variable and never printed: both are owned by
`agentrefine_jax.http_client`, and error texts reach logs and summary.json only through its
`describe_api_error` (status, the provider's error code and message, redacted, never the raw body).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import openai

from agentrefine_jax.http_client import PLACEHOLDER_KEY, describe_api_error, openai_client, redact


class APIFatalError(RuntimeError):
    """A non-retryable API error (authentication, unknown model, bad request)."""


class APITransientError(RuntimeError):
    """A retryable API error that persisted through every retry."""


class JSONExtractError(ValueError):
    """The reply contains no parseable JSON value."""


@dataclasses.dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.calls += other.calls

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "calls": self.calls,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Usage:
        d = d or {}
        return cls(int(d.get("prompt_tokens", 0)), int(d.get("completion_tokens", 0)), int(d.get("calls", 0)))


@dataclasses.dataclass
class Reply:
    text: str
    usage: Usage
    finish_reason: str | None = None


@dataclasses.dataclass
class LLMSettings:
    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 1.0
    max_tokens: int | None = None
    timeout: float = 300.0  # seconds for a whole request (connect + complete reply), per attempt
    # Retries of one request on transient errors, and the backoff schedule between them.
    max_api_retries: int = 6
    backoff_base: float = 1.0
    backoff_max: float = 60.0


def _retry_after(err: openai.APIStatusError) -> float | None:
    try:
        value = err.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, ValueError):
        return None


class ChatClient:
    """Thread-safe chat-completions client with retries; one per stage (script / trajectory)."""

    def __init__(
        self,
        settings: LLMSettings,
        *,
        log: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.settings = settings
        self._log = log or logging.getLogger(__name__).warning
        self._sleep = sleep
        key = os.environ.get(settings.api_key_env, "")
        if not key:
            self._log(
                f"[synth] warning: ${settings.api_key_env} is not set; sending a placeholder key "
                "(fine for local servers, rejected by hosted APIs)"
            )
        self._key = key or PLACEHOLDER_KEY
        self._client = openai_client(settings.base_url, self._key, timeout=settings.timeout, max_retries=0)
        self._lock = threading.Lock()
        self.usage = Usage()
        self.retries = 0

    def redact(self, text: str) -> str:
        return redact(text, self._key)

    def _backoff(self, attempt: int, hint: float | None) -> float:
        s = self.settings
        delay = min(s.backoff_max, s.backoff_base * (2**attempt)) * random.uniform(0.5, 1.0)
        if hint is not None:
            delay = max(delay, min(hint, s.backoff_max))
        return delay

    def complete(self, messages: list[dict[str, str]], *, tag: str = "") -> Reply:
        """One chat completion, retried on transient errors; raises APIFatalError/APITransientError."""
        s = self.settings
        kwargs: dict[str, Any] = {"model": s.model, "messages": messages, "temperature": s.temperature}
        if s.max_tokens is not None:
            kwargs["max_tokens"] = s.max_tokens
        last = ""
        for attempt in range(s.max_api_retries + 1):
            hint = None
            try:
                resp = self._client.chat.completions.create(**kwargs)
            except openai.APIStatusError as e:
                code = e.status_code
                if code not in (408, 409, 429) and code < 500:
                    raise APIFatalError(
                        f"{describe_api_error(e, self._key)} from {s.base_url} (model {s.model!r})"
                    ) from None
                hint = _retry_after(e)
                last = f"HTTP {code}"
            except (openai.APITimeoutError, openai.APIConnectionError) as e:
                last = describe_api_error(e, self._key)
            except (json.JSONDecodeError, openai.APIResponseValidationError):
                last = "HTTP 200 with a body that is not JSON"
            else:
                problem = _not_a_completion(resp)
                if problem is None:
                    return self._record(resp)
                self._count_usage(resp)  # a malformed reply may still have been billed
                last = f"HTTP 200 {problem}"
            if attempt == s.max_api_retries:
                break
            delay = self._backoff(attempt, hint)
            with self._lock:
                self.retries += 1
            self._log(f"[synth] {tag}{last}; retry {attempt + 1}/{s.max_api_retries} in {delay:.2f}s")
            self._sleep(delay)
        raise APITransientError(f"{last} (from {s.base_url}, through {s.max_api_retries} retries)")

    def _count_usage(self, resp: Any) -> Usage:
        u = getattr(resp, "usage", None)
        try:
            usage = Usage(
                prompt_tokens=int(getattr(u, "prompt_tokens", 0) or 0),
                completion_tokens=int(getattr(u, "completion_tokens", 0) or 0),
                calls=1,
            )
        except (TypeError, ValueError):  # a malformed usage block: count the call only
            usage = Usage(calls=1)
        with self._lock:
            self.usage.add(usage)
        return usage

    def _record(self, resp: Any) -> Reply:
        usage = self._count_usage(resp)
        choice = resp.choices[0]
        return Reply(choice.message.content or "", usage, choice.finish_reason)


def _not_a_completion(resp: Any) -> str | None:
    """Why a 200 reply is not a usable chat completion, or None when it is one."""
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or not choices:
        return "without choices"
    message = getattr(choices[0], "message", None)
    if message is None or not isinstance(getattr(message, "content", None), (str, type(None))):
        return "with a choice that has no message"
    return None


# ------------------------------------------------------------------ JSON extraction

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)```", re.DOTALL)


def extract_json(text: str) -> Any:
    """The JSON value in an LLM reply: bare, fenced (```json), or embedded in prose.

    Reasoning blocks (<think>...</think>) are ignored.  Raises JSONExtractError.
    """
    text = _THINK.sub("", text).strip()
    candidates = [m.group(1).strip() for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for cand in candidates:
        try:
            return json.loads(cand)
        except json.JSONDecodeError:
            pass
        # First '{' or '[' from which a complete JSON object/array decodes.
        for m in re.finditer(r"[\[{]", cand):
            try:
                value, _ = decoder.raw_decode(cand, m.start())
            except json.JSONDecodeError:
                continue
            if isinstance(value, (dict, list)):
                return value
    snippet = text[:200].replace("\n", " ")
    raise JSONExtractError(f"no JSON object in reply ({len(text)} chars): {snippet!r}")
