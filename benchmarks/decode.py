"""Decode throughput: our KV-cache engine vs transformers (PyTorch, CPU) on the same weights.

    python benchmarks/decode.py                       # random ~40M-parameter Llama, batch 4
    python benchmarks/decode.py --batch 1 --new-tokens 128 --dtype float32
    python benchmarks/decode.py --hf-dir /path/to/llama   # an existing safetensors checkpoint

A random transformers Llama is written as safetensors and loaded by both stacks, so both
run identical weights on identical prompts. Both decode greedily for exactly
--new-tokens tokens (no early stop). Decode tokens/s counts generated tokens after the
first: ours from the engine's own prefill/decode timings, transformers' as
batch * (N - 1) / (t(N new tokens) - t(1 new token)). Compilation is excluded (one
warm-up run), and the best of --repeats runs is reported for each side.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", help="benchmark this HF Llama/Mistral dir instead of a random model")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both stacks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def random_hf_dir(args: argparse.Namespace, out: pathlib.Path) -> pathlib.Path:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(2048, args.prompt_len + args.new_tokens),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    return out


def bench_transformers(
    hf_dir: pathlib.Path, prompts: np.ndarray, args: argparse.Namespace
) -> dict[str, object]:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=dtype, use_safetensors=True, local_files_only=True
    ).eval()
    ids = torch.as_tensor(prompts)
    mask = torch.ones_like(ids)

    def run(n: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()

    run(2)  # warm-up (allocator, thread pool)
    t1 = min(run(1)[0] for _ in range(args.repeats))
    best, tokens = float("inf"), []
    for _ in range(args.repeats):
        t, tokens = run(args.new_tokens)
        best = min(best, t)
    decode_s = max(best - t1, 1e-9)
    return {
        "prefill_s": t1,
        "decode_tok_s": args.batch * (args.new_tokens - 1) / decode_s,
        "tokens": tokens,
    }


def bench_ours(hf_dir: pathlib.Path, prompts: np.ndarray, args: argparse.Namespace) -> dict[str, object]:
    from agentrefine_jax.hf.io import load_hf_model
    from agentrefine_jax.inference.engine import generate

    _, model = load_hf_model(hf_dir, dtype=args.dtype, param_dtype=args.dtype)
    rows = prompts.tolist()

    def run() -> tuple[dict[str, float], list[list[int]]]:
        timings: dict[str, float] = {}
        gens = generate(model, rows, max_new_tokens=args.new_tokens, stop_token_ids=(), timings=timings)
        return timings, [g.tokens for g in gens]

    t0 = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t0
    best_prefill, best_decode, tokens = float("inf"), float("inf"), []
    for _ in range(args.repeats):
        timings, tokens = run()
        best_prefill = min(best_prefill, timings["prefill_s"])
        best_decode = min(best_decode, timings["decode_s"] / max(timings["decode_steps"], 1))
    return {
        "prefill_s": best_prefill,
        "decode_tok_s": args.batch / best_decode,
        "first_run_s": compile_s,
        "tokens": tokens,
    }


def main() -> int:
    args = parse_args()
    import jax

    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        hf_dir = pathlib.Path(args.hf_dir) if args.hf_dir else random_hf_dir(args, pathlib.Path(tmp) / "hf")
        from agentrefine_jax.hf.io import read_hf_config

        cfg = read_hf_config(hf_dir)
        rng = np.random.default_rng(args.seed)
        prompts = rng.integers(3, cfg.vocab_size, size=(args.batch, args.prompt_len))
        print(
            f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"heads {cfg.num_heads}/{cfg.num_kv_heads}, "
            f"vocab {cfg.vocab_size}; batch {args.batch}, prompt {args.prompt_len}, new {args.new_tokens}, "
            f"{args.dtype}; jax {jax.__version__} on {jax.default_backend()} "
            f"({os.cpu_count()} cores), torch threads {args.threads}",
            flush=True,
        )
        ours = bench_ours(hf_dir, prompts, args)
        theirs = bench_transformers(hf_dir, prompts, args)

    same = ours["tokens"] == theirs["tokens"]
    print(f"\n{'':18}{'prefill s':>12}{'decode tok/s':>15}")
    print(f"{'transformers':18}{theirs['prefill_s']:>12.4f}{theirs['decode_tok_s']:>15.1f}")
    print(f"{'agentrefine_jax':18}{ours['prefill_s']:>12.4f}{ours['decode_tok_s']:>15.1f}")
    print(f"\ndecode speed ratio (ours / transformers): {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x")
    print(f"our first run incl. compile: {ours['first_run_s']:.1f}s")
    print(f"greedy outputs identical: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
