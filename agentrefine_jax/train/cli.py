"""Command line for training, including the multi-host (jax.distributed) settings."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agentrefine_jax.train",
        description="Refinement tuning (AgentRefine) of a LLaMA/Mistral model.",
    )
    p.add_argument("--config", required=True, help="config file, or a bare name inside configs/ (e.g. demo)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.max_steps=100 (repeatable)",
    )
    dist = p.add_argument_group("multi-host (jax.distributed)")
    dist.add_argument("--coordinator-address", help="HOST:PORT of process 0's coordinator")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    dist.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with auto-detection (TPU pods)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    aot = p.add_argument_group("compile only (XLA TPU compiler via libtpu; no TPU needed)")
    aot.add_argument(
        "--compile-only",
        action="store_true",
        help="compile this config's train step for --topology, print per-device memory, train nothing",
    )
    aot.add_argument("--topology", help="Cloud TPU slice for --compile-only, e.g. v5p-64")
    aot.add_argument("--num-slices", type=int, default=1, help="slices joined over DCN (data axis)")
    aot.add_argument("--json", action="store_true", help="--compile-only report as JSON")
    return p


def init_distributed(args: argparse.Namespace) -> None:
    import jax

    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise SystemExit("--coordinator-address, --num-processes and --process-id go together")
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    elif args.distributed:
        jax.distributed.initialize()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from agentrefine_jax.train import aot

    if args.compile_only:
        return aot.run(args.config, args.overrides, args.topology, args.num_slices, args.json)
    if args.topology or args.num_slices != 1 or args.json:
        print("error: --topology, --num-slices and --json go with --compile-only", file=sys.stderr)
        return 2
    # With libtpu installed but no TPU here, keep its start-up quiet.
    aot.prepare_tpu_env()
    from agentrefine_jax.config import load_config, to_dict

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import json

        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    init_distributed(args)
    from agentrefine_jax.train.loop import TrainingError, train

    try:
        train(cfg)
    except TrainingError as e:
        print(f"error: {e}", flush=True)
        return 1
    return 0
