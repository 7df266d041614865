"""`python -m agentrefine_jax.plan`: per-device memory, FLOPs and step time of a config on a TPU mesh,
and with `--topology T --compile` the XLA TPU compiler's own figures beside the planner's.

    python -m agentrefine_jax.plan --config llama3_8b --mesh fsdp=32 --chip v5p [--json]
    python -m agentrefine_jax.plan --config llama3_8b --topology v5p-64 --compile [--json]
"""

from __future__ import annotations

import argparse

from agentrefine_jax import logs
from agentrefine_jax.cli_errors import OneLineParser, add_config_flags, fail, int_in
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.train import planner
from agentrefine_jax.train.topology import HBM_BYTES


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m agentrefine_jax.plan",
        description="Per-device memory, FLOPs and step time of a training config on a TPU mesh.",
    )
    add_config_flags(ap, "model.remat_policy=full")
    ap.add_argument(
        "--mesh",
        help="mesh axis sizes, e.g. fsdp=64 or fsdp=32,tensor=4,data=2 (unnamed axes keep the config's)",
    )
    ap.add_argument("--devices", type=int, help="total devices (chips); resolves a -1 mesh axis")
    ap.add_argument("--chip", default="v5p", choices=sorted(HBM_BYTES))
    logs.add_flags(ap)
    ap.add_argument("--global-batch", type=int_in(1), help="default: train.global_batch_size")
    ap.add_argument(
        "--micro-batch", type=int_in(1), help="default: train.micro_batch_size (or the global batch)"
    )
    ap.add_argument("--seq-len", type=int_in(1), help="default: data.max_length")
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time")
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of HBM kept free for the runtime and unmodelled temporaries (default 0.1)",
    )
    ap.add_argument(
        "--topology",
        help="Cloud TPU slice (v5p-64, v5e-256, v6e-64, v4-32, ...): sets --chip and --devices",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="with --topology: compile the real train step with the XLA TPU compiler (libtpu; no TPU "
        "needed) and print its per-device memory beside the plan",
    )
    ap.add_argument("--num-slices", type=int, default=1, help="with --compile: slices joined over DCN")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--leaves", action="store_true", help="with --json: include every parameter's shard")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import os

    from agentrefine_jax.train import aot
    from agentrefine_jax.train.topology import UnknownTopology, get_slice

    logs.setup("plan", args)
    if args.compile:
        from agentrefine_jax.train.cli import compile_only

        return compile_only(args.config, args.overrides, args.topology, args.num_slices, args.json, "plan")
    if args.num_slices != 1:
        return fail("plan", "--num-slices goes with --compile")
    chip, devices = args.chip, args.devices
    if args.topology:
        try:
            sl = get_slice(args.topology)
        except UnknownTopology as e:
            return fail("plan", e)
        chip, devices = sl.chip.name, sl.chips
    # Planning only traces shapes; keep it off accelerators and quiet.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    aot.prepare_tpu_env()
    from agentrefine_jax.config import load_config

    try:
        if not 0 < args.mfu <= 1 or not 0 <= args.headroom < 1:
            raise planner.PlanError(
                f"--mfu must be in (0, 1] and --headroom in [0, 1); got {args.mfu}, {args.headroom}"
            )
        cfg = load_config(args.config, args.overrides)
        default = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
        mesh = planner.parse_mesh(args.mesh, default, devices)
        result = planner.plan(
            cfg,
            mesh,
            chip,
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            mfu=args.mfu,
            headroom=args.headroom,
            name=args.config,
        )
    except (planner.PlanError, FileNotFoundError, KeyError, ValueError, TypeError) as e:
        return fail("plan", e)
    if args.json:
        if not args.leaves:
            result.pop("param_leaves")
        print(json_dumps(result, indent=2))
    else:
        print(planner.format_plan(result, args.config))
    return 0
