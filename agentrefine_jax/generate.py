"""`python -m agentrefine_jax.generate`: generate from a checkpoint, on token ids or chat text.

    python -m agentrefine_jax.generate --checkpoint CKPT --prompt-ids 1,2,3 --max-new-tokens 16 --greedy
        -> prints the generated ids as a JSON list (one line per --prompt-ids, batched)
    python -m agentrefine_jax.generate --checkpoint CKPT --prompt "Hello" --template llama3
        -> prints the assistant reply (the prompt is built with the training chat template)

Progress and timings go to stderr; stdout carries only the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agentrefine_jax.cli_errors import OneLineParser, float_in, int_in
from agentrefine_jax.inference.chat import ChatGenerator, Completion, ContextOverflowError
from agentrefine_jax.inference.engine import generate
from agentrefine_jax.inference.loading import load_for_inference
from agentrefine_jax.models.llama import param_count

__all__ = ["ChatGenerator", "Completion", "ContextOverflowError", "main"]


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty id list")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m agentrefine_jax.generate",
        description="KV-cached generation from a project checkpoint or a Hugging Face directory.",
    )
    p.add_argument("--checkpoint", required=True, help="training run / checkpoint dir, or an HF model dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt-ids", type=_ids, action="append", help="comma-separated token ids; repeat to batch"
    )
    src.add_argument("--prompt", help="user message; the prompt is built with the chat template")
    src.add_argument("--messages", help="JSON file ('-' = stdin) with a list of {role, content} messages")
    p.add_argument("--system", help="system prompt to put before --prompt")
    p.add_argument("--template", help="chat template (default: the checkpoint's)")
    p.add_argument("--tokenizer", help="tokenizer name or dir (default: the checkpoint's)")
    p.add_argument("--max-new-tokens", type=int_in(1), required=True)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default when no temperature)")
    p.add_argument(
        "--temperature",
        type=float_in(0, float("inf")),
        default=None,
        help="sampling temperature (0 = greedy)",
    )
    p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (chat mode); repeatable")
    stops = p.add_mutually_exclusive_group()
    stops.add_argument(
        "--stop-ids", type=_ids, help="ids that end a row (ids mode; default: the model's eos)"
    )
    stops.add_argument("--no-stop-ids", action="store_true", help="never stop before --max-new-tokens")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="override the compute dtype")
    p.add_argument("--json", action="store_true", help="chat mode: print a JSON object instead of the text")
    return p


def _log(msg: str) -> None:
    print(f"[generate] {msg}", file=sys.stderr, flush=True)


def _temperature(args: argparse.Namespace) -> float:
    if args.greedy and args.temperature not in (None, 0.0):
        raise ValueError("--greedy contradicts --temperature > 0")
    return 0.0 if args.greedy or args.temperature is None else args.temperature


def _messages(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.prompt is not None:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return msgs + [{"role": "user", "content": args.prompt}]
    raw = sys.stdin.read() if args.messages == "-" else open(args.messages, encoding="utf-8").read()
    msgs = json.loads(raw)
    if not isinstance(msgs, list):
        raise ValueError(f"{args.messages}: expected a JSON list of messages")
    return msgs


def run(args: argparse.Namespace) -> int:
    temperature = _temperature(args)
    t0 = time.perf_counter()
    loaded = load_for_inference(args.checkpoint, dtype=args.dtype)
    _log(
        f"loaded {args.checkpoint} ({loaded.source}, {param_count(loaded.model) / 1e6:.2f}M params, "
        f"compute {loaded.cfg.dtype}) in {time.perf_counter() - t0:.1f}s"
    )
    t1 = time.perf_counter()
    if args.prompt_ids is not None:
        if args.stop:
            raise ValueError("--stop strings need text; use --stop-ids with --prompt-ids")
        stop_ids = () if args.no_stop_ids else args.stop_ids
        gens = generate(
            loaded.model,
            args.prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=temperature,
            top_p=args.top_p,
            stop_token_ids=stop_ids,
            seed=args.seed,
        )
        n = sum(len(g.tokens) for g in gens)
        _log(
            f"generated {n} tokens for {len(gens)} prompt(s) in "
            f"{time.perf_counter() - t1:.1f}s (incl. compile)"
        )
        for g in gens:
            print(json.dumps(g.tokens), flush=True)
        return 0

    gen = ChatGenerator.from_loaded(loaded, args.template, args.tokenizer)
    if args.stop_ids or args.no_stop_ids:
        gen.stop_token_ids = () if args.no_stop_ids else tuple(args.stop_ids)
    (c,) = gen.complete(
        [_messages(args)],
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        top_p=args.top_p,
        stop=args.stop,
        seed=args.seed,
    )
    _log(
        f"{c.prompt_tokens} prompt + {c.completion_tokens} generated tokens in "
        f"{time.perf_counter() - t1:.1f}s (incl. compile); finish: {c.finish_reason}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens,
                },
                ensure_ascii=False,
            )
        )
    else:
        print(c.text, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"[generate] error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
