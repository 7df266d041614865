"""The OpenAI error format, one owner for the server's app and its HTTP transport.

Every error the server sends -- a refused request, a malformed HTTP message, a late body, a busy
or stopping server -- is `{"error": {"message", "type", "param", "code"}}` with the HTTP status.
"""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """An error reported to the client in OpenAI's error format."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def json_bytes(payload: Any) -> bytes:
    """UTF-8 JSON; text that cannot be encoded (a lone surrogate echoed back) is \\u-escaped."""
    try:
        return json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(payload).encode()


def error_bytes(status: int, message: str, *, code: str | None = None) -> bytes:
    return json_bytes(APIError(status, message, code=code).body())
