"""Data pipeline benchmark: tokens/s per core and packing efficiency on the demo distribution.

    python benchmarks/data_pipeline.py [--template llama3] [--repeat 10] [--threads 1] [--json OUT]

Stages timed separately, on the shipped demo trajectories repeated `--repeat` times:
  prepare  parse + validate + render + tokenize + mask (`build_examples`), the up-front cost
  pack     best-fit-decreasing packing plan
  stream   Grain iteration: pick rows, materialise, batch (what the trainer waits on per step)
Throughput is reported per core: the tokenizer's Rust thread pool is limited to `--threads`
(RAYON_RS_NUM_CPUS, set before the tokenizer loads) and divided out.

Packing efficiency = real tokens / token slots, for: packed rows, padding every example to
max_length, and padding each random batch to its own longest example.

Peer: the vendor's own chat encoder on the same conversations (Meta's llama-models ChatFormat,
or mistral-common's instruct tokenizer), tokens only, no validation and no loss mask. Ours
(prepare) and the vendor alternate over --rounds rounds (benchmarks/_paired.py); the printed
ratio is the median of per-round tokens/s ratios with its min and max, beside the load seen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402
import _paired  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--template", choices=("llama3", "mistral"), default="llama3")
    ap.add_argument("--repeat", type=int, default=10, help="copies of the 400 demo rows")
    ap.add_argument(
        "--threads", type=int, default=1, help="tokenizer threads (throughput is divided by this)"
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-lengths", default="512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of ours vs the vendor encoder")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)  # must precede the tokenizers import

    import numpy as np

    from agentrefine_jax.config import DataConfig
    from agentrefine_jax.data import DEMO_TRAIN
    from agentrefine_jax.data.examples import build_examples
    from agentrefine_jax.data.packing import pack_best_fit, padding_efficiency
    from agentrefine_jax.data.pipeline import build_template, make_pipeline
    from agentrefine_jax.data.report import DataReport

    cfg = DataConfig(train_files=(str(DEMO_TRAIN),), tokenizer=args.template, template=args.template)
    t = time.perf_counter()
    template = build_template(cfg)
    print(f"tokenizer {args.template} ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    rows = [json.loads(line) for line in DEMO_TRAIN.read_text(encoding="utf-8").splitlines()]
    records = [(f"demo:{i}", r) for i, r in enumerate(rows * args.repeat)]
    print(_machine.header(), file=sys.stderr)
    results: dict = {
        "machine": _machine.machine(),
        "template": args.template,
        "threads": args.threads,
        "records": len(records),
    }

    report = DataReport()
    t = time.perf_counter()
    store = build_examples(
        records, template, loss_on=cfg.loss_on, max_length=8192, overlength="truncate", report=report
    )
    dt = time.perf_counter() - t
    results["prepare_tokens_per_s_per_core"] = report.tokens / dt / args.threads
    results["prepare_examples_per_s"] = len(store) / dt
    print(
        f"prepare: {report.tokens} tokens in {dt:.2f}s = {results['prepare_tokens_per_s_per_core']:,.0f} "
        "tokens/s/core",
        file=sys.stderr,
    )

    results["vs_vendor_encoder"] = _paired_prepare(records, template, cfg, args)

    lengths = store.lengths
    results["length_percentiles"] = report.length_percentiles()
    results["efficiency"] = {}
    for max_len in (int(x) for x in args.max_lengths.split(",")):
        fit = lengths[lengths <= max_len]
        t = time.perf_counter()
        plan = pack_best_fit(fit, max_len)
        dt_pack = time.perf_counter() - t
        eff = {
            "examples": int(len(fit)),
            "packed_rows": len(plan),
            "packed": float(fit.sum() / (len(plan) * max_len)),
            "pad_to_max_length": float(fit.sum() / (len(fit) * max_len)),
            "pad_per_batch": padding_efficiency(fit, args.batch_size),
            "pack_seconds": dt_pack,
        }
        results["efficiency"][max_len] = eff
        print(
            f"max_length {max_len}: packed {eff['packed']:.1%} "
            f"({len(plan)} rows, plan {dt_pack * 1e3:.0f} ms) | "
            f"pad per batch of {args.batch_size}: {eff['pad_per_batch']:.1%} | "
            f"pad to max_length: {eff['pad_to_max_length']:.1%}",
            file=sys.stderr,
        )

    # Streaming through Grain (the per-step cost once the plan exists).
    bench_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"agentrefine_bench_{os.getpid()}.jsonl")
    with open(bench_file, "w", encoding="utf-8") as f:
        for _, r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    try:
        scfg = DataConfig(
            train_files=(bench_file,),
            tokenizer=args.template,
            template=args.template,
            max_length=2048,
            prefetch=0,
        )
        pipe = make_pipeline(scfg, global_batch_size=args.batch_size, num_epochs=1)
        t = time.perf_counter()
        n_tok = 0
        n_batches = 0
        for batch in pipe:
            n_tok += int((np.asarray(batch["segment_ids"]) > 0).sum())
            n_batches += 1
        dt = time.perf_counter() - t
    finally:
        os.unlink(bench_file)
    results["stream_tokens_per_s"] = n_tok / dt
    results["stream_batches_per_s"] = n_batches / dt
    print(
        f"stream: {n_batches} batches of {args.batch_size}x2048 in {dt:.2f}s = {n_tok / dt:,.0f} tokens/s "
        f"({n_batches / dt:.0f} batches/s, one thread)",
        file=sys.stderr,
    )
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _vendor_encoder(template: str):
    """messages -> token ids with the vendor's own library (the oracle of tests/test_data_templates)."""
    if template == "llama3":
        from llama_models.datatypes import RawMessage, StopReason
        from llama_models.llama3.chat_format import ChatFormat
        from llama_models.llama3.tokenizer import Tokenizer

        cf = ChatFormat(Tokenizer.get_instance())
        bos = cf.tokenizer.special_tokens["<|begin_of_text|>"]

        def encode(messages: list[dict]) -> list[int]:
            ids = [bos]
            for m in messages:
                msg = RawMessage(role=m["role"], content=m["content"], stop_reason=StopReason.end_of_turn)
                ids += cf.encode_message(msg, None)[0]
            return ids

        return encode
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from agentrefine_jax.data.tokenizers import mistral_v3_model_path

    vendor = MistralTokenizer.from_file(str(mistral_v3_model_path()), mode=ValidationMode.finetuning)

    def encode(messages: list[dict]) -> list[int]:
        merged = [dict(m) for m in messages]
        if merged[0]["role"] == "system":  # our placement: system text opens the first user turn
            system = merged.pop(0)["content"]
            merged[0]["content"] = system + "\n\n" + merged[0]["content"]
        chat = [
            UserMessage(content=m["content"])
            if m["role"] == "user"
            else AssistantMessage(content=m["content"])
            for m in merged
        ]
        return vendor.encode_chat_completion(ChatCompletionRequest(messages=chat)).tokens

    return encode


def _paired_prepare(records, template, cfg, args) -> dict:
    """Our prepare stage vs the vendor's chat encoder, alternating rounds, tokens/s each."""
    from agentrefine_jax.data.examples import build_examples
    from agentrefine_jax.data.report import DataReport
    from agentrefine_jax.data.schema import normalize_row

    encode = _vendor_encoder(args.template)
    convs = [normalize_row(r, None, rid)["messages"] for rid, r in records]

    def ours() -> float:
        report = DataReport()
        t = time.perf_counter()
        build_examples(
            records, template, loss_on=cfg.loss_on, max_length=8192, overlength="truncate", report=report
        )
        return report.tokens / (time.perf_counter() - t)

    def vendor() -> float:
        t = time.perf_counter()
        n = sum(len(encode(m)) for m in convs)
        return n / (time.perf_counter() - t)

    res = _paired.measure(
        {"ours": ours, "vendor": vendor},
        "vendor",
        rounds=args.rounds,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    r, ld = res["ratio"]["ours"], res["load"]
    print(
        f"prepare vs vendor encoder ({args.template}): {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}] "
        f"over {res['rounds']} alternating rounds, load {ld['min']:.2f}-{ld['max']:.2f}",
        file=sys.stderr,
    )
    return {"ratio": r, "rounds": res["rounds"], "load": ld, "tokens_per_s": res["throughput"]}


if __name__ == "__main__":
    sys.exit(main())
