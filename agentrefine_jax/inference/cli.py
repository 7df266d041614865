"""`python -m agentrefine_jax.inference generate|serve`: decode from a checkpoint, or serve it.

    python -m agentrefine_jax.inference generate --checkpoint CKPT --prompt-ids 1,2,3 --max-new-tokens 16
        -> prints the generated ids as a JSON list (one line per --prompt-ids, batched)
    python -m agentrefine_jax.inference generate --checkpoint CKPT --prompt "Hello"
        -> prints the assistant reply (the prompt is built with the checkpoint's chat template:
           the training run's, or an HF directory's own)
    python -m agentrefine_jax.inference serve --checkpoint CKPT --port 8000
        -> an OpenAI-compatible /v1/chat/completions server (see inference/server.py)

Progress and timings go to stderr; stdout carries only the result.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from agentrefine_jax import logs
from agentrefine_jax.cli_errors import TERMINATED, OneLineParser, fail, float_in, int_in
from agentrefine_jax.inference.chat import ChatGenerator
from agentrefine_jax.inference.engine import generate
from agentrefine_jax.inference.loading import check_chat_names, load_for_inference
from agentrefine_jax.inference.server import MAX_PROGRAM_SHAPES, ChatService, ServerLimits, make_server
from agentrefine_jax.models.config import DTYPES
from agentrefine_jax.models.llama import param_count
from agentrefine_jax.outputs import json_dumps

PROG = "python -m agentrefine_jax.inference"
log = logging.getLogger(__name__)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty id list")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Decode from, or serve, a checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(
        sub.add_parser(
            "generate", help="KV-cached generation from a project checkpoint or a Hugging Face directory."
        )
    )
    _add_serve(
        sub.add_parser(
            "serve", help="OpenAI-compatible /v1/chat/completions server for a checkpoint or HF model dir."
        )
    )
    _add_before_after(
        sub.add_parser(
            "before-after",
            help="one held-out chat turn answered greedily by a run's starting model and its trained export",
        )
    )
    return parser


def _add_before_after(p: argparse.ArgumentParser) -> None:
    logs.add_flags(p)
    p.add_argument("--run", required=True, help="a training run dir that started from train.init_from_hf")
    p.add_argument("--row", type=int_in(0), default=0, help="row of the run's first eval file (default 0)")
    p.add_argument("--max-new-tokens", type=int_in(1), default=64)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the model's)")


def run_before_after(args: argparse.Namespace) -> int:
    from agentrefine_jax.inference.before_after import compare, format_turn

    t0 = time.perf_counter()
    turn = compare(args.run, row=args.row, max_new_tokens=args.max_new_tokens, dtype=args.dtype)
    print(format_turn(turn))
    log.info(f"before/after in {time.perf_counter() - t0:.1f}s")
    return 0


def _add_generate(p: argparse.ArgumentParser) -> None:
    logs.add_flags(p)
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
    _add_dtype_args(p)
    p.add_argument("--json", action="store_true", help="chat mode: print a JSON object instead of the text")


def _add_dtype_args(p: argparse.ArgumentParser) -> None:
    """--dtype and --weights-dtype, the same for generate and serve."""
    p.add_argument("--dtype", choices=DTYPES, help="override the compute dtype")
    p.add_argument(
        "--weights-dtype",
        choices=DTYPES,
        help="store the weights in this dtype (default: the checkpoint's). bfloat16 halves the bytes a "
        "decode step reads (batch-1 decode is memory-bound on CPU); greedy text may differ from float32 "
        "weights (docs/inference.md)",
    )


def _temperature(args: argparse.Namespace) -> float:
    if args.greedy and args.temperature not in (None, 0.0):
        raise ValueError("--greedy contradicts --temperature > 0")
    return 0.0 if args.greedy or args.temperature is None else args.temperature


def _messages(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.prompt is not None:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        return msgs + [{"role": "user", "content": args.prompt}]
    raw = sys.stdin.read() if args.messages == "-" else open(args.messages, encoding="utf-8").read()
    try:
        msgs = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{args.messages}: JSON nested deeper than the parser allows") from None
    if not isinstance(msgs, list):
        raise ValueError(f"{args.messages}: expected a JSON list of messages")
    return msgs


def run_generate(args: argparse.Namespace) -> int:
    temperature = _temperature(args)
    t0 = time.perf_counter()
    if args.prompt_ids is None:  # chat mode: refuse a missing template before the weights load
        check_chat_names(args.checkpoint, args.template, args.tokenizer)
    loaded = load_for_inference(args.checkpoint, dtype=args.dtype, param_dtype=args.weights_dtype)
    log.info(
        f"loaded {args.checkpoint} ({loaded.source}, {param_count(loaded.model) / 1e6:.2f}M params, "
        f"weights {loaded.cfg.param_dtype}, compute {loaded.cfg.dtype}) in {time.perf_counter() - t0:.1f}s"
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
        log.info(
            f"generated {n} tokens for {len(gens)} prompt(s) in "
            f"{time.perf_counter() - t1:.1f}s (incl. compile)"
        )
        for g in gens:
            print(json_dumps(g.tokens), flush=True)
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
    log.info(
        f"{c.prompt_tokens} prompt + {c.completion_tokens} generated tokens in "
        f"{time.perf_counter() - t1:.1f}s (incl. compile); finish: {c.finish_reason}"
    )
    if args.json:
        print(
            json_dumps(
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


def _add_serve(p: argparse.ArgumentParser) -> None:
    logs.add_flags(p)
    p.add_argument("--checkpoint", required=True, help="training run / checkpoint dir, or an HF model dir")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument(
        "--port", type=int_in(0, 65535), default=8000, help="0 = any free port (printed at start-up)"
    )
    p.add_argument("--model-name", help="the model id clients must send (default: checkpoint dir name)")
    p.add_argument("--template", help="chat template (default: the checkpoint's)")
    p.add_argument("--tokenizer", help="tokenizer name or dir (default: the checkpoint's)")
    _add_dtype_args(p)
    p.add_argument(
        "--default-max-tokens", type=int_in(1), default=512, help="when a request sets no max_tokens"
    )
    p.add_argument("--max-n", type=int_in(1), default=16, help="largest 'n' a request may ask for")
    p.add_argument(
        "--api-key-env",
        default="AGENTREFINE_SERVE_API_KEY",
        help="env var holding the key clients must send; unset or empty = no authentication",
    )
    p.add_argument("--warmup", action="store_true", help="compile for a short request before serving")
    p.add_argument(
        "--max-program-shapes",
        type=int_in(1),
        default=MAX_PROGRAM_SHAPES,
        help="request shapes whose compiled programs are kept; one more clears them (bounds memory; "
        "default %(default)s)",
    )
    d = ServerLimits()
    p.add_argument(
        "--max-connections",
        type=int_in(1, 65536),
        default=None,
        help=f"open connections at most (default {d.max_connections}); one more is answered 503 at once",
    )
    # The thread-pool server's flags: its capacity was workers + queue connections.
    p.add_argument(
        "--workers", type=int_in(1, 1024), help="older flag: --max-connections is --workers + --queue"
    )
    p.add_argument(
        "--queue", type=int_in(1, 65536), help="older flag: --max-connections is --workers + --queue"
    )
    p.add_argument(
        "--read-timeout",
        type=float_in(0, 3600, lo_open=True),
        default=d.read_timeout,
        help="seconds for a whole request (line, headers, body) to arrive; idle connections close after it",
    )
    p.add_argument(
        "--grace-period",
        type=float_in(0, 86400),
        default=d.grace_period,
        help="on SIGTERM: seconds to finish the requests in flight before exiting 75 (after them: exit 0)",
    )


def _limits(args: argparse.Namespace) -> ServerLimits:
    connections = args.max_connections
    if args.workers is not None or args.queue is not None:
        if connections is not None:
            raise ValueError("--max-connections replaces --workers/--queue; give one or the other")
        connections = (args.workers or 8) + (args.queue or 64)
    d = ServerLimits()
    return ServerLimits(
        max_connections=connections or d.max_connections,
        read_timeout=args.read_timeout,
        grace_period=args.grace_period,
    )


def run_serve(args: argparse.Namespace) -> int:
    try:
        t0 = time.perf_counter()
        gen = ChatGenerator.from_checkpoint(
            args.checkpoint, args.template, args.tokenizer, dtype=args.dtype, weights_dtype=args.weights_dtype
        )
        log.info(f"loaded {args.checkpoint} in {time.perf_counter() - t0:.1f}s")
        api_key = os.environ.get(args.api_key_env) or None
        service = ChatService(
            gen,
            model_name=args.model_name,
            default_max_tokens=args.default_max_tokens,
            max_n=args.max_n,
            api_key=api_key,
            log=log.info,
            max_program_shapes=args.max_program_shapes,
        )
        if args.warmup:
            t0 = time.perf_counter()
            gen.complete([[{"role": "user", "content": "hi"}]], max_new_tokens=2)
            log.info(f"warm-up compile done in {time.perf_counter() - t0:.1f}s")
        server = make_server(service, args.host, args.port, _limits(args))
    except (ValueError, FileNotFoundError, OSError) as e:
        return fail("inference", e)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(f"serving on {args.host} without an API key (set ${args.api_key_env})")
    host, port = server.server_address[:2]
    # The exact line tests and scripts wait for; stdout carries nothing else.
    print(f"serving {service.model_name!r} on http://{host}:{port}/v1", flush=True)
    # SIGTERM drains (stop accepting, finish what is in flight); Ctrl-C stops at once.
    signal.signal(signal.SIGTERM, lambda *_: server.drain())
    signal.signal(signal.SIGINT, lambda *_: server.interrupt())
    try:
        outcome = server.serve_forever()
    finally:
        server.server_close()
    if outcome.interrupted:
        raise KeyboardInterrupt  # cli_errors.run_main: one line, exit 130
    if outcome.unfinished:
        log.warning(
            f"stopped: the grace period of {args.grace_period:g} s ended with {outcome.unfinished} "
            "request(s) unfinished (answered 503 server_shutting_down)"
        )
        # A generation may still be inside XLA on the model thread: leave without finalizing the
        # interpreter under it (that aborted with "terminate called ...", exit 134).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(TERMINATED)  # SIGTERM's grace period ended with requests unfinished
    log.info("stopped: every request in flight was answered")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup("inference", args)
    if args.command == "serve":
        return run_serve(args)
    try:
        return run_before_after(args) if args.command == "before-after" else run_generate(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        return fail("inference", e)
