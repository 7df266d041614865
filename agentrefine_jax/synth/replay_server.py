"""A standard-library OpenAI-compatible server that replays recorded chat-completion replies.

Used by the tests and for offline dry runs of `generate` (no key, no network):

    python -m agentrefine_jax.synth replay-server --replies replies.json --port 8765

A replies file is {"rules": [rule, ...]}.  A rule is
{"match": [substring, ...], "replies": [reply, ...], "repeat_last": bool}: a request is answered
by the first rule whose substrings all occur in the request's message contents and which has
replies left (consumed in order; `repeat_last` keeps answering with the last one).  A reply is
one of
- {"content": str, "usage": {"prompt_tokens": int, "completion_tokens": int}}  (a 200 reply)
- {"status": int, "body": object|str, "headers": {...}}                         (an error)
- {"hang": true}   never answers until the server stops (to kill a client mid-request)
Unmatched requests get a 500 and are recorded with rule=None.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
import time
from typing import Any


class ReplayServer:
    def __init__(self, rules: list[dict[str, Any]], host: str = "127.0.0.1", port: int = 0):
        self._rules = [dict(r, replies=list(r.get("replies", [])), _next=0) for r in copy.deepcopy(rules)]
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.requests: list[dict[str, Any]] = []
        self._n = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                length = int(self.headers.get("content-length", 0))
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = {}
                status, payload, headers = server._answer(self.path, body, self.headers.get("authorization"))
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, str(v))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="replay-server")

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> ReplayServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def add_rules(self, rules: list[dict[str, Any]], *, first: bool = False) -> None:
        new = [dict(r, replies=list(r.get("replies", [])), _next=0) for r in copy.deepcopy(rules)]
        with self._lock:
            self._rules = new + self._rules if first else self._rules + new

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(list(self.requests)):
                    return True
            time.sleep(0.02)
        return False

    # ------------------------------------------------------------------ matching

    def _answer(self, path: str, body: dict[str, Any], auth: str | None) -> tuple[int, Any, dict[str, str]]:
        text = "\n".join(
            m.get("content", "") for m in body.get("messages", []) if isinstance(m.get("content"), str)
        )
        with self._lock:
            rule, reply = None, None
            for r in self._rules:
                if not all(s in text for s in r.get("match", [])):
                    continue
                if r["_next"] < len(r["replies"]):
                    reply = r["replies"][r["_next"]]
                    r["_next"] += 1
                elif r.get("repeat_last") and r["replies"]:
                    reply = r["replies"][-1]
                else:
                    continue
                rule = r
                break
            self._n += 1
            n = self._n
            record = {
                "n": n,
                "path": path,
                "body": body,
                "text": text,
                "authorization": auth,
                "rule": rule.get("name") if rule else None,
                "reply": reply,
            }
            self.requests.append(record)
        if reply is None:
            return 500, {"error": {"message": "no recorded reply matches this request", "type": "replay"}}, {}
        if reply.get("hang"):
            self._released.wait()
            return 503, {"error": {"message": "server stopped"}}, {}
        if "status" in reply:
            payload = reply.get("body", {"error": {"message": f"recorded HTTP {reply['status']}"}})
            if isinstance(payload, str):
                payload = payload.encode()
            return int(reply["status"]), payload, dict(reply.get("headers", {}))
        content = reply["content"]
        # Without recorded usage, a rough 4-characters-a-token estimate.
        estimate = {"prompt_tokens": len(text) // 4, "completion_tokens": len(content) // 4}
        usage = dict(reply.get("usage") or estimate)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return (
            200,
            {
                "id": f"chatcmpl-replay-{n}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "replay"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": reply.get("finish_reason", "stop"),
                    }
                ],
                "usage": usage,
            },
            {},
        )
