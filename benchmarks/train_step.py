"""Train-step throughput and peak memory: our trainer vs transformers + torch, on CPU.

Each contender runs in its own subprocess (so peak RSS is its own) on the same model
shape, batch and sequence length, with an AdamW step included:
  * ours        — agentrefine_jax jitted step (float32 params, float32 compute)
  * torch fp32  — transformers LlamaForCausalLM, eager, float32
  * torch bf16  — the same under torch.autocast(bfloat16)
Then "effective" (loss-bearing) tokens/s on the demo length distribution: our packed rows
vs transformers with per-batch padding.

    python benchmarks/train_step.py [--steps 5] [--batch 4] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODEL = dict(vocab=32000, hidden=256, inter=768, layers=4, heads=8, kv=4)


def _ours(batch: int, seq: int, steps: int, lengths: list[int] | None) -> dict:
    import jax
    import numpy as np

    from agentrefine_jax import sharding as shd
    from agentrefine_jax.config import MeshConfig, OptimConfig
    from agentrefine_jax.models import ModelConfig
    from agentrefine_jax.train.optimizer import make_optimizer
    from agentrefine_jax.train.step import build_steps

    cfg = ModelConfig(
        vocab_size=MODEL["vocab"],
        hidden_size=MODEL["hidden"],
        intermediate_size=MODEL["inter"],
        num_layers=MODEL["layers"],
        num_heads=MODEL["heads"],
        num_kv_heads=MODEL["kv"],
        head_dim=MODEL["hidden"] // MODEL["heads"],
        dtype="float32",
    )
    opt, _ = make_optimizer(OptimConfig(learning_rate=1e-4), 100)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = build_steps(
        cfg, opt, mesh, MeshConfig().rules, global_batch=batch, micro_batch=None, loss_chunk=256
    )
    params = fns.init_params(0)
    opt_state = fns.init_opt(params)
    rng = np.random.RandomState(0)
    batches = [_packed_batch(rng, batch, seq, lengths) for _ in range(steps + 1)]
    loss_tokens = 0.0
    for i, b in enumerate(batches):
        if i == 1:
            t0 = time.perf_counter()
        params, opt_state, m = fns.train(params, opt_state, b)
        if i >= 1:
            loss_tokens += float(m["loss_tokens"])
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    return {"tokens_per_sec": steps * batch * seq / dt, "loss_tokens_per_sec": loss_tokens / dt}


def _packed_batch(rng, batch: int, seq: int, lengths: list[int] | None) -> dict:
    import numpy as np

    ids = rng.randint(0, MODEL["vocab"], (batch, seq)).astype(np.int32)
    seg = np.ones((batch, seq), np.int32)
    pos = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    if lengths:  # first-fit pack documents drawn from the length distribution
        for r in range(batch):
            t, s = 0, 1
            while True:
                n = int(lengths[rng.randint(len(lengths))])
                if t + n > seq:
                    break
                seg[r, t : t + n], pos[r, t : t + n] = s, np.arange(n)
                t, s = t + n, s + 1
            seg[r, t:], pos[r, t:] = 0, 0
    return {"input_ids": ids, "loss_mask": (seg > 0).astype(np.int32), "segment_ids": seg, "positions": pos}


def _torch(batch: int, seq: int, steps: int, bf16: bool, lengths: list[int] | None) -> dict:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=MODEL["vocab"],
            hidden_size=MODEL["hidden"],
            intermediate_size=MODEL["inter"],
            num_hidden_layers=MODEL["layers"],
            num_attention_heads=MODEL["heads"],
            num_key_value_heads=MODEL["kv"],
            attn_implementation="sdpa",
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    rng = np.random.RandomState(0)
    loss_tokens = 0
    total_tokens = 0
    for i in range(steps + 1):
        if lengths:  # per-batch padding: pad to the longest document of the batch
            docs = [int(lengths[rng.randint(len(lengths))]) for _ in range(batch)]
            width = max(docs)
            mask = np.zeros((batch, width), np.int64)
            for r, n in enumerate(docs):
                mask[r, :n] = 1
        else:
            width, mask = seq, np.ones((batch, seq), np.int64)
        ids = torch.tensor(rng.randint(0, MODEL["vocab"], (batch, width)))
        labels = ids.masked_fill(torch.tensor(mask) == 0, -100)
        if i == 1:
            t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(input_ids=ids, attention_mask=torch.tensor(mask), labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= 1:
            loss_tokens += int(mask.sum())
            total_tokens += batch * width
    dt = time.perf_counter() - t0
    return {"tokens_per_sec": total_tokens / dt, "loss_tokens_per_sec": loss_tokens / dt}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(args: argparse.Namespace) -> None:
    # Framework imports alone cost hundreds of MB; report the peak above that baseline too.
    if args.child == "ours":
        import jax  # noqa: F401
    else:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    base = _rss_mb()
    lengths = json.loads(args.lengths) if args.lengths else None
    if args.child == "ours":
        res = _ours(args.batch, args.seq, args.steps, lengths)
    else:
        res = _torch(args.batch, args.seq, args.steps, args.child == "torch_bf16", lengths)
    res["peak_rss_mb"] = _rss_mb()
    res["train_mem_mb"] = res["peak_rss_mb"] - base
    print(json.dumps(res))


def _run(kind: str, args: argparse.Namespace, lengths: list[int] | None = None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
    ]
    if lengths:
        cmd += ["--lengths", json.dumps(lengths)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _demo_lengths() -> list[int]:
    from agentrefine_jax.data import DEMO_TRAIN
    from agentrefine_jax.data.schema import normalize_row
    from agentrefine_jax.data.templates import get_template
    from agentrefine_jax.data.tokenizers import load_tokenizer

    template = get_template("llama3", load_tokenizer("llama3"))
    lengths = []
    with open(DEMO_TRAIN) as f:
        for i, line in enumerate(f):
            row = normalize_row(json.loads(line), None, str(i))
            ids, _ = template.encode(row["messages"])
            lengths.append(len(ids))
    return lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--lengths", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    print(f"model {MODEL}, batch {args.batch} x seq {args.seq}, {args.steps} timed steps (after 1 warm-up)")
    res = {k: _run(k, args) for k in ("ours", "torch_fp32", "torch_bf16")}
    base = res["torch_fp32"]
    print(
        f"\n{'contender':<12}{'tokens/s':>10}{'ratio':>8}{'peak RSS MB':>13}{'ratio':>8}"
        f"{'above imports MB':>18}{'ratio':>8}"
    )
    for k, r in res.items():
        print(
            f"{k:<12}{r['tokens_per_sec']:>10,.0f}{r['tokens_per_sec'] / base['tokens_per_sec']:>7.2f}x"
            f"{r['peak_rss_mb']:>13,.0f}{r['peak_rss_mb'] / base['peak_rss_mb']:>7.2f}x"
            f"{r['train_mem_mb']:>18,.0f}{r['train_mem_mb'] / base['train_mem_mb']:>7.2f}x"
        )
    print("(ratios against torch fp32, measured in this run)")
    lengths = [n for n in _demo_lengths() if n <= args.seq]
    packed = _run("ours", args, lengths)
    padded = _run("torch_fp32", args, lengths)
    ratio = packed["loss_tokens_per_sec"] / padded["loss_tokens_per_sec"]
    print(f"\neffective (non-padding) tokens/s on the demo length distribution (n={len(lengths)}):")
    print(f"  ours, packed rows        {packed['loss_tokens_per_sec']:>10,.0f}")
    print(f"  torch fp32, batch-padded {padded['loss_tokens_per_sec']:>10,.0f}")
    print(f"  ratio                    {ratio:>10.2f}x")


if __name__ == "__main__":
    main()
