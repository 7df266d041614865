"""Requests/s and latency of the OpenAI-compatible server under 1 / 8 / 32 concurrent clients: the
server of this tree ("new", uvicorn + starlette) against the thread-pool server it replaced
("old"), both serving the same checkpoint at the same time, in alternating paired rounds.

The old server is git's: `--old-ref` (default: the last commit with inference/http_server.py) is
extracted with `git archive` into a temporary directory and run from there (nothing of it is kept
in the tree). Each server is a `python -m agentrefine_jax.inference serve` process on 127.0.0.1.

Each round, per concurrency level, runs `--requests` chat completions (greedy, `--max-tokens`) on
each server back to back (see `_paired.py`): `c` client threads, each on its own keep-alive
connection, take requests until the round's are done. Printed per level: requests/s of each server
(median over rounds, min-max), the median ratio new/old with its spread, and p50 / p95 latency
(over all the round's requests, median over rounds). The model runs one request at a time in both
servers, so requests/s is mostly the model's; what differs is what the HTTP layer adds.

    python benchmarks/serve_load.py [--rounds 3] [--requests 32] [--max-tokens 16]
        [--checkpoint DIR] [--old-ref REF] [--json]

Without --checkpoint a tiny random Llama (the test suite's serving model: 2 layers, hidden 64,
Llama-3 tokenizer, context 512) is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _paired  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
OLD_REF = "c2d59e5"  # the last commit serving over inference/http_server.py (the thread pool)
LEVELS = (1, 8, 32)
MESSAGES = [
    {"role": "system", "content": "You are an agent. Answer with Thought: ... Action: ..."},
    {"role": "user", "content": "Observation: you are in a kitchen. There is a fridge and a stove."},
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tiny_checkpoint(path: pathlib.Path) -> pathlib.Path:
    import jax
    import numpy as np
    from flax import nnx

    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.models import llama
    from agentrefine_jax.models.config import preset

    cfg = preset("tiny", max_position_embeddings=512)
    graphdef, state = nnx.split(llama.abstract(cfg))
    rng = np.random.default_rng(0)

    def draw(p: Any, leaf: Any) -> Any:
        noise = rng.standard_normal(leaf.shape)
        value = 1.0 + 0.1 * noise if str(p[-1].key).endswith("norm") else 0.1 * noise
        return jax.device_put(np.asarray(value, leaf.dtype))

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    save_model(path, nnx.merge(graphdef, state), cfg, step=0, tokenizer="llama3", template="llama3")
    return path


def _old_tree(ref: str, into: pathlib.Path) -> pathlib.Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "agentrefine_jax"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


class Server:
    def __init__(self, name: str, code_root: pathlib.Path, checkpoint: pathlib.Path, log_dir: pathlib.Path):
        env = {**os.environ, "PYTHONPATH": str(code_root)}
        env.pop("AGENTREFINE_SERVE_API_KEY", None)
        self.name = name
        self.log = open(log_dir / f"{name}.stderr", "w")  # noqa: SIM115 - kept open while it serves
        cmd = [sys.executable, "-m", "agentrefine_jax.inference", "serve", "--checkpoint", str(checkpoint)]
        self.proc = subprocess.Popen(
            [*cmd, "--port", "0", "-q"], stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("serving "):
            raise RuntimeError(
                f"{name} server did not start: {(log_dir / f'{name}.stderr').read_text()[-2000:]}"
            )
        self.model = line.split("'")[1]
        self.port = int(line.rsplit(":", 1)[1].split("/")[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _round(server: Server, clients: int, requests: int, max_tokens: int, latencies: list[float]) -> float:
    """`requests` completions over `clients` keep-alive connections; requests/s, latencies appended."""
    body = json.dumps(
        {"model": server.model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    left = [requests]
    lock = threading.Lock()
    errors: list[str] = []
    times: list[float] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        while True:
            with lock:
                if left[0] == 0:
                    break
                left[0] -= 1
            t0 = time.perf_counter()
            try:
                conn.request(
                    "POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"}
                )
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    errors.append(f"HTTP {resp.status}")
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{type(e).__name__}: {e}")
                conn.close()
            with lock:
                times.append(time.perf_counter() - t0)
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{server.name}: {len(errors)} failed requests, e.g. {errors[0]}")
    latencies.extend(times)
    return requests / elapsed


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace, tmp: pathlib.Path) -> dict[str, Any]:
    checkpoint = pathlib.Path(args.checkpoint) if args.checkpoint else _tiny_checkpoint(tmp / "demo-model")
    (tmp / "old").mkdir()
    old_root = _old_tree(args.old_ref, tmp / "old")
    servers = {"old": Server("old", old_root, checkpoint, tmp), "new": Server("new", ROOT, checkpoint, tmp)}
    try:
        print(_machine.header(), file=sys.stderr, flush=True)
        results: dict[str, Any] = {
            "machine": _machine.machine(),
            "old_ref": args.old_ref,
            "max_tokens": args.max_tokens,
            "levels": {},
        }
        for clients in LEVELS:
            per_round: dict[str, list[list[float]]] = {name: [] for name in servers}

            def contender(
                name: str, clients: int = clients, per_round: dict = per_round
            ) -> Callable[[], float]:
                def one() -> float:
                    lat: list[float] = []
                    value = _round(servers[name], clients, args.requests, args.max_tokens, lat)
                    per_round[name].append(lat)
                    return value

                return one

            _log(f"{clients} concurrent client(s):")
            res = _paired.measure(
                {name: contender(name) for name in servers}, "old", rounds=args.rounds, warmup=1, log=_log
            )
            for name in servers:
                measured = per_round[name][1:]  # the warm-up round is not a measurement
                res[f"{name}_latency_s"] = {
                    "p50": statistics.median(_percentile(x, 0.50) for x in measured),
                    "p95": statistics.median(_percentile(x, 0.95) for x in measured),
                }
            results["levels"][clients] = res
        return results
    finally:
        for server in servers.values():
            server.stop()


def _table(results: dict[str, Any]) -> str:
    lines = [
        f"max_tokens={results['max_tokens']}, old = git {results['old_ref']}",
        "clients | old req/s | new req/s | new/old (min-max) | old p50 / p95 s | new p50 / p95 s | load",
    ]
    for clients, r in results["levels"].items():
        old, new, ratio = r["throughput"]["old"], r["throughput"]["new"], r["ratio"]["new"]
        lo, hi = r["load"]["min"], r["load"]["max"]
        lines.append(
            f"{clients:>7} | {old['median']:9.2f} | {new['median']:9.2f} | "
            f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) | "
            f"{r['old_latency_s']['p50']:.3f} / {r['old_latency_s']['p95']:.3f} | "
            f"{r['new_latency_s']['p50']:.3f} / {r['new_latency_s']['p95']:.3f} | {lo:.1f}-{hi:.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help="requests per server, level and round")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--checkpoint", help="serve this checkpoint (default: a tiny random Llama)")
    p.add_argument("--old-ref", default=OLD_REF, help="git ref of the old server")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        results = run(args, pathlib.Path(tmp))
    print(json.dumps(results, indent=1) if args.json else _table(results))


if __name__ == "__main__":
    main()
