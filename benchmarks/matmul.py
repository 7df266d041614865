"""The train step's matmuls alone: XLA:CPU's dot against PyTorch's (oneDNN / MKL) on the same shapes.

    python benchmarks/matmul.py                  # SmolLM2-135M's projections at 512 rows, float32
    python benchmarks/matmul.py --rows 2048 --rounds 5 --json

Why it exists: on some CPU kinds our train step trails torch's while the step's other work is small
(README, "Benchmarks"), and the question is whether the gap is the matrix products themselves. The
workload is one decoder layer's projection products as a training step computes them, with SmolLM2's
widths (hidden 576, KV 192, MLP 1536; `--hidden`, `--kv`, `--mlp` change them): for each of q, k, v, o,
gate, up and down, the forward `x @ w`, the input gradient `dy @ w.T` and the weight gradient
`x.T @ dy`, at `--rows` token rows — 21 products. Both stacks run each product `--reps` times a
round on the same numpy inputs; a round's value is the total FLOPs over the total time (GFLOP/s).

Each contender runs in its own process (benchmarks/_paired.py's workers), so one library's thread
pool never spins or sleeps in the other's rounds; the two alternate over `--rounds` rounds after a
warm-up (compilation excluded) and the printed ratio is the median of the per-round ratios, with its
min and max and the load seen. Both compute in float32 on every core (`--threads`, torch's intra-op
threads; XLA uses its own pool over the same cores). The per-product rates are printed too, and the
JSON (the last line with `--json`) records the CPU model, its ISA flags and the XLA flags in effect.
Results are compared against a float64 product: the largest relative error of each stack is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _paired  # noqa: E402

KINDS = ("xla", "torch")
FORMS = ("fwd", "dx", "dw")  # x @ w, dy @ w.T, x.T @ dy
SPECS = {"fwd": "ti,io->to", "dx": "to,io->ti", "dw": "ti,to->io"}  # the same three as einsums


def products(rows: int, hidden: int, kv: int, mlp: int) -> list[tuple[str, str, int, int]]:
    """(projection, form, in, out) for one decoder layer's training products."""
    proj = [("q", hidden, hidden), ("k", hidden, kv), ("v", hidden, kv), ("o", hidden, hidden)]
    proj += [("gate", hidden, mlp), ("up", hidden, mlp), ("down", mlp, hidden)]
    return [(name, form, i, o) for name, i, o in proj for form in FORMS]


def operands(rows: int, form: str, i: int, o: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The two float32 operands of one product, laid out as the step holds them."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, i), dtype=np.float32)
    w = rng.standard_normal((i, o), dtype=np.float32) * 0.05
    dy = rng.standard_normal((rows, o), dtype=np.float32)
    return {"fwd": (x, w), "dx": (dy, w), "dw": (x, dy)}[form]


def flops(rows: int, i: int, o: int) -> int:
    return 2 * rows * i * o  # every form multiplies the same three extents


def _reference(form: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # optimize=True: numpy contracts through BLAS (its plain einsum loop takes minutes at 512 rows)
    return np.einsum(SPECS[form], a.astype(np.float64), b.astype(np.float64), optimize=True)


def _xla(form: str, a: np.ndarray, b: np.ndarray) -> Callable[[], Any]:
    import jax
    import jax.numpy as jnp

    # The step's own contractions (einsum, as the model and its gradients are written): XLA chooses
    # the kernel and any transposition.
    spec = SPECS[form]
    fn = jax.jit(lambda p, q: jnp.einsum(spec, p, q, preferred_element_type=jnp.float32))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    return lambda: fn(ja, jb).block_until_ready()


def _torch(form: str, a: np.ndarray, b: np.ndarray) -> Callable[[], Any]:
    import torch

    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    op = {"fwd": lambda: ta @ tb, "dx": lambda: ta @ tb.t(), "dw": lambda: ta.t() @ tb}[form]
    return op


def child(args: argparse.Namespace) -> None:
    """One contender's worker: builds every product, then answers rounds."""
    if args.child == "torch":
        import torch

        torch.set_num_threads(args.threads)
    make = _xla if args.child == "xla" else _torch
    work = []
    errors = []
    for n, (name, form, i, o) in enumerate(products(args.rows, args.hidden, args.kv, args.mlp)):
        a, b = operands(args.rows, form, i, o, seed=n)
        run = make(form, a, b)
        out = run()  # a jax array (block_until_ready returns it) or a torch tensor
        got = out.numpy() if args.child == "torch" else np.asarray(out)
        ref = _reference(form, a, b)
        errors.append(float(np.abs(got - ref).max() / np.abs(ref).max()))
        work.append((f"{name}.{form}", run, flops(args.rows, i, o)))

    def one_round() -> dict[str, Any]:
        per: dict[str, float] = {}
        total_flops, total_s = 0, 0.0
        for key, run, f in work:
            t0 = time.perf_counter()
            for _ in range(args.reps):
                run()
            s = time.perf_counter() - t0
            per[key] = f * args.reps / s / 1e9
            total_flops += f * args.reps
            total_s += s
        return {"value": total_flops / total_s / 1e9, "per_product": per, "max_rel_error": max(errors)}

    _paired.serve(lambda: one_round)


def _worker(kind: str, args: argparse.Namespace) -> _paired.Worker:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--rows", str(args.rows)]
    cmd += ["--hidden", str(args.hidden), "--kv", str(args.kv), "--mlp", str(args.mlp)]
    cmd += ["--reps", str(args.reps), "--threads", str(args.threads)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return _paired.Worker(cmd, env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=512, help="token rows (the train step's batch x length)")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--kv", type=int, default=192, help="k and v projections' width (kv heads x head dim)")
    p.add_argument("--mlp", type=int, default=1536)
    p.add_argument("--reps", type=int, default=10, help="calls of each product per round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (xla, torch)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    p.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rows", "hidden", "kv", "mlp", "reps", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def _log(msg: str) -> None:
    print(f"[matmul] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    info = _machine.machine()
    _log(_machine.header(info))
    workers: dict[str, _paired.Worker] = {}
    try:
        for kind in KINDS:  # started one at a time: their set-ups do not overlap
            workers[kind] = _worker(kind, args)
        res = _paired.measure({k: w.round for k, w in workers.items()}, "torch", rounds=args.rounds, log=_log)
        last = {k: w.last for k, w in workers.items()}
        for w in workers.values():
            w.close()
    finally:
        for w in workers.values():
            w.kill()
    ratio = res["ratio"]["xla"]
    names = list(last["xla"]["per_product"])
    # Significant digits, not decimals: a toy product's rate (the test's widths, a busy host) can be
    # well under 0.05 GFLOP/s, and one decimal recorded it as 0.
    per = {n: {k: float(f"{last[k]['per_product'][n]:.4g}") for k in KINDS} for n in names}
    print(f"{'product':12s} {'xla GF/s':>9s} {'torch GF/s':>11s}  (last round)")
    for n, v in per.items():
        print(f"{n:12s} {v['xla']:9.1f} {v['torch']:11.1f}")
    tp = res["throughput"]
    ratio_text = f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]"
    print(
        f"{args.rows} rows, hidden {args.hidden}: xla {tp['xla']['median']:.1f} GFLOP/s, torch "
        f"{tp['torch']['median']:.1f} GFLOP/s: {ratio_text} "
        f"(median of {args.rounds} rounds, load {res['load']['min']:.2f}-{res['load']['max']:.2f}); "
        f"max relative error vs float64: xla {last['xla']['max_rel_error']:.1e}, "
        f"torch {last['torch']['max_rel_error']:.1e}"
    )
    if args.json:
        doc = {
            "setting": {k: getattr(args, k) for k in ("rows", "hidden", "kv", "mlp", "reps", "threads")},
            **res,
            "per_product_last_round": per,
            "max_rel_error": {k: last[k]["max_rel_error"] for k in KINDS},
            "machine": info,
        }
        print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
