"""Text that cannot be encoded: lone UTF-16 surrogates in strings decoded from untrusted JSON.

JSON may escape a lone surrogate (`"\\ud800"`); Python's `json` decodes it into a `str` that no
UTF-8 encoder, tokenizer or file writer accepts, so it fails far from where it came in. Every
stage that takes text from outside (data rows, synth trajectories, inference prompts and requests)
asks `lone_surrogate` first and refuses (or skips and counts) the row, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _bad_char(s: str) -> str | None:
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(s[e.start]):04X}"
    return None


def lone_surrogate(obj: Any, path: str = "") -> str | None:
    """Where the first string (or object key) in `obj` holds a lone surrogate, e.g.
    `messages[1].content: lone surrogate U+D800`; None when all text is valid.

    Iterative, so a deeply nested value cannot exhaust the interpreter's stack."""
    stack: list[tuple[str, Any]] = [(path, obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            bad = _bad_char(value)
            if bad:
                return f"{where or 'text'}: lone surrogate {bad} (not valid Unicode text)"
        elif isinstance(value, Mapping):
            items = list(value.items())
            for key, item in reversed(items):
                if isinstance(key, str) and _bad_char(key):
                    return f"{where or 'object'}: a key holds a lone surrogate {_bad_char(key)}"
                stack.append((f"{where}.{key}" if where else str(key), item))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None
