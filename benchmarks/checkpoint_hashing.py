"""Step time during a checkpoint save vs without one: the trainer's own TrainCheckpoints (Orbax
background write, then the sha256 manifest hashed on a background worker) and its step after a
save (the trainer's save strategy: spare buffers, no copy of the state) on a CPU model wide
enough for a >= 2 GB checkpoint (float32 params + AdamW's two moments), in paired rounds.

Each round runs, back to back (see `_paired.py`):
  * save    — `ckpts.save(...)` (its blocking part: handing the arrays to Orbax) and then train
              steps, polling between steps as the trainer does, for at least `--steps` steps and
              until the save is committed *and* its manifest written; every second of it counts;
  * no_save — as many train steps as that save round took (so both cover spans of equal
              length under the same load: a save that runs in the background at low priority
              may overlap tens of steps on a busy machine).
The printed figure is the median over rounds of (mean step time with a save) / (mean step time
without), with min and max, beside the machine load. 1.0 means the save costs the step nothing.
Also reported: the save's cost in seconds (the save round's time minus as many steps without a
save), and the blocking part of `save()` alone.

    python benchmarks/checkpoint_hashing.py [--rounds 5] [--steps 4] [--dir /tmp/x] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agentrefine_jax import host_memory  # noqa: E402

host_memory.relaunch_with_huge_pages()  # the trainer's own process set-up (agentrefine_jax/host_memory.py)
import _machine  # noqa: E402
import _paired  # noqa: E402

# ~198M parameters: 12 bytes each with AdamW's moments -> ~2.4 GB per checkpoint.
MODEL = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=1,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _setup(root: str, batch: int, seq: int) -> tuple[Any, Any, dict, int]:
    import jax
    import numpy as np

    from agentrefine_jax import sharding as shd
    from agentrefine_jax.checkpoint import TrainCheckpoints, make_meta
    from agentrefine_jax.config import MeshConfig, OptimConfig
    from agentrefine_jax.models import preset
    from agentrefine_jax.paths import as_path
    from agentrefine_jax.train import save_strategy
    from agentrefine_jax.train.optimizer import make_optimizer
    from agentrefine_jax.train.step import build_steps

    cfg = preset("tiny", **MODEL, tie_embeddings=False, param_dtype="float32", dtype="float32")
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-5), 1000)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = build_steps(
        cfg,
        opt,
        mesh,
        MeshConfig().rules,
        global_batch=batch,
        micro_batch=None,
        loss_chunk=seq,
        loss_impl="auto",
    )
    state = {"params": fns.init_params(0)}
    state["opt"] = fns.init_opt(state["params"])
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    rng = np.random.RandomState(0)
    batch_arrays = {
        "input_ids": rng.randint(0, MODEL["vocab_size"], (batch, seq)).astype(np.int32),
        "loss_mask": np.ones((batch, seq), np.int32),
        "segment_ids": np.ones((batch, seq), np.int32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (batch, 1)),
    }
    ckpts = TrainCheckpoints(as_path(root), keep=1)
    meta = make_meta(cfg, step=0)
    strategy = save_strategy.choose(fns, (state["params"], state["opt"]))  # as the trainer chooses

    def step() -> None:  # as the trainer's loop steps (train/loop.py: run_steps)
        state["params"], state["opt"], m = strategy.step(state["params"], state["opt"], batch_arrays)
        float(m["loss"])  # the step is done

    return step, ckpts, {"state": state, "meta": meta, "strategy": strategy}, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per round (a save round: at least)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    root = args.dir or tempfile.mkdtemp(prefix="agentrefine-ckpt-bench-")
    step, ckpts, held, nbytes = _setup(os.path.join(root, "checkpoints"), args.batch, args.seq)
    _log(_machine.header())
    _log(f"checkpoint size {nbytes / 1e9:.2f} GB (params + AdamW moments, float32)")
    counter: dict[str, Any] = {"step": 0, "save_steps": [], "save_seconds": [], "extra": [], "blocking": []}

    def no_save() -> float:
        n = counter["save_steps"][-1]  # the save round just before this one (save runs first)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        took = time.perf_counter() - t0
        counter["extra"].append(counter["save_seconds"][-1] - took)
        return n / took

    def save() -> float:
        counter["step"] += 1
        t0 = time.perf_counter()
        s = held["state"]
        ckpts.save(counter["step"], s["params"], s["opt"], held["meta"])
        held["strategy"].handed((s["params"], s["opt"]))  # as the trainer's Checkpointing hook does
        counter["blocking"].append(time.perf_counter() - t0)
        n = 0
        while n < args.steps or ckpts.pending or ckpts.hashing:
            step()
            ckpts.poll()  # what the trainer's loop does between steps
            n += 1
        counter["save_steps"].append(n)
        counter["save_seconds"].append(time.perf_counter() - t0)
        return n / counter["save_seconds"][-1]

    try:
        res = _paired.measure({"save": save, "no_save": no_save}, "no_save", rounds=args.rounds, log=_log)
        ckpts.finish()
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    r = res["ratio"]["save"]  # throughput with a save / without; the step-time ratio is its inverse
    out = {
        "machine": _machine.machine(),
        "checkpoint_gb": nbytes / 1e9,
        "rounds": res["rounds"],
        "steps_per_round": args.steps,
        "steps_in_save_window": counter["save_steps"][-args.rounds :],
        "step_seconds_no_save": 1 / res["throughput"]["no_save"]["median"],
        "step_time_ratio": {"median": 1 / r["median"], "min": 1 / r["max"], "max": 1 / r["min"]},
        "save_cost_seconds": _paired.spread(counter["extra"][-args.rounds :]),
        "save_blocking_seconds": _paired.spread(counter["blocking"][-args.rounds :]),
        "load": res["load"],
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        q = out["step_time_ratio"]
        print(
            f"step time during a {out['checkpoint_gb']:.2f} GB save / without: {q['median']:.3f}x "
            f"[{q['min']:.3f}-{q['max']:.3f}] (median of {out['rounds']} paired rounds; "
            f"{out['step_seconds_no_save']:.2f} s/step without; load {res['load']['min']:.1f}-"
            f"{res['load']['max']:.1f} on {out['cpus']} CPUs); a save costs "
            f"{out['save_cost_seconds']['median']:.1f} s, {out['save_blocking_seconds']['median']:.2f} s "
            f"of it blocking; {out['steps_in_save_window']} steps per save window"
        )


if __name__ == "__main__":
    main()
