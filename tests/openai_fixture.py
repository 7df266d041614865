"""What an OpenAI-compatible /v1/chat/completions endpoint answers, for the tests' loopback model servers."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


def chat_completion(model: str, content: str) -> dict:
    """A one-choice chat completion in the API's response shape."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def send_json(
    handler: BaseHTTPRequestHandler, status: int, payload: object, content_type: str = "application/json"
) -> None:
    """Answer a request with `payload` as JSON (Content-Length set: clients read it whole)."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
