"""What an OpenAI-compatible /v1/chat/completions endpoint answers, for the tests' loopback model servers."""

from __future__ import annotations


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
