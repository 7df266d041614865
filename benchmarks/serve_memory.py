"""RSS of the serve process over many requests of varied shapes (issue 44: 0.9 -> 1.4 GB over ~350).

Each request shape -- batch bucket (n), prompt-length bucket, max-new-tokens bucket, greedy or
sampled -- compiles one prefill and one decode program, which jit used to keep for the life of the
process. The server now keeps those of at most `--max-program-shapes` shapes (a new one beyond
them clears jax's caches; docs/inference.md). This script starts `serve` on a checkpoint (a tiny
random Llama by default: serve_load.py's), sends `--requests` chat completions cycling through a
fixed list of varied shapes (n 1-5, prompts of 1-300 words, max_tokens 1-300, greedy or
sampled, some with stream=true), and prints the RSS (from /proc) every `--every` requests, after
`--warm` warm-up requests. The bound it checks: the last sample within `--bound-mb` of the
highest one seen by the end of the first full cycle of shapes (once every shape has been compiled
at least once, RSS must stop growing).

    python benchmarks/serve_memory.py [--requests 1000] [--max-program-shapes 32] [--every 50]
        [--checkpoint DIR] [--bound-mb 100]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
from serve_load import ROOT, _tiny_checkpoint  # noqa: E402

WORDS = "look around the kitchen then take the apple from the fridge and put it on the table".split()


def shapes() -> list[dict]:
    """A fixed cycle of varied request bodies (without the model name)."""
    out = []
    grid = itertools.product((1, 2, 5), (1, 20, 80, 300), (1, 10, 40, 150, 300), (0.0, 0.8))
    for k, (n, words, max_tokens, temperature) in enumerate(grid):
        text = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(words))
        body = {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "n": n,
            "seed": k,
        }
        if k % 5 == 0:
            body["stream"] = True
        out.append(body)
    return out


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--max-program-shapes", type=int, default=None, help="default: the server's")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--bound-mb", type=float, default=100.0)
    args = ap.parse_args()
    print(_machine.header(), flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="serve-memory-"))
    checkpoint = pathlib.Path(args.checkpoint) if args.checkpoint else _tiny_checkpoint(tmp / "tiny")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTREFINE_SERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "agentrefine_jax.inference", "serve", "--checkpoint", str(checkpoint)]
    cmd += ["--port", "0", "-q"]
    if args.max_program_shapes is not None:
        cmd += ["--max-program-shapes", str(args.max_program_shapes)]
    with open(tmp / "serve.stderr", "w") as err:
        import subprocess

        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("serving "):
            raise RuntimeError(f"server did not start: {(tmp / 'serve.stderr').read_text()[-2000:]}")
        model, port = line.split("'")[1], int(line.rsplit(":", 1)[1].split("/")[0])
        bodies = shapes()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        samples: list[tuple[int, float]] = []
        statuses: dict[int, int] = {}
        t0 = time.monotonic()
        for i in range(args.warm + args.requests):
            body = {"model": model, **bodies[i % len(bodies)]}
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            done = i + 1 - args.warm
            if done == 0 or (done > 0 and done % args.every == 0):
                samples.append((done, _rss_mb(proc.pid)))
                print(
                    f"{done:5d} requests  RSS {samples[-1][1]:7.0f} MB  {time.monotonic() - t0:6.0f} s",
                    flush=True,
                )
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    cycle = len(bodies)
    first_cycle = max((mb for n, mb in samples if n <= cycle), default=samples[0][1])
    last = samples[-1][1]
    result = {
        "machine": _machine.machine(),
        "requests": args.requests,
        "shapes_in_cycle": cycle,
        "statuses": statuses,
        "rss_after_warmup_mb": samples[0][1],
        "rss_max_first_cycle_mb": first_cycle,
        "rss_last_mb": last,
        "rss_max_mb": max(mb for _, mb in samples),
        "bound_mb": args.bound_mb,
        # Only meaningful once the shapes have all been seen (more requests than one cycle).
        "within_bound": last <= first_cycle + args.bound_mb if args.requests > cycle else None,
    }
    print(json.dumps(result))
    return 0 if result["within_bound"] is not False and set(statuses) == {200} else 1


if __name__ == "__main__":
    raise SystemExit(main())
