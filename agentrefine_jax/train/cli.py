"""Command line for training, including the multi-host (jax.distributed) settings.

Errors follow the house convention (agentrefine_jax.cli_errors): one line on stderr, exit 2 for
a bad command line, config or `train.init_from_hf` directory, exit 1 when training itself stops on an error.
"""

from __future__ import annotations

import argparse
import logging
import os

from agentrefine_jax import logs
from agentrefine_jax.cli_errors import OneLineParser, add_config_flags, fail
from agentrefine_jax.outputs import json_dumps

TOOL = "train"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m agentrefine_jax.train",
        description="Refinement tuning (AgentRefine) of a LLaMA/Mistral model.",
        epilog="example: python -m agentrefine_jax.train --config llama3_8b.py "
        "--set train.init_from_hf=/ckpt/Meta-Llama-3-8B-Instruct "
        "(add --print-config to see the resolved config)",
    )
    add_config_flags(p, "train.max_steps=100")
    dist = p.add_argument_group("multi-host (jax.distributed)")
    dist.add_argument("--coordinator-address", help="HOST:PORT of process 0's coordinator")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    dist.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with auto-detection (TPU pods)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="validate and print the resolved config, then exit"
    )
    aot = p.add_argument_group("compile only (XLA TPU compiler via libtpu; no TPU needed)")
    aot.add_argument(
        "--compile-only",
        action="store_true",
        help="compile this config's train step for --topology, print per-device memory, train nothing",
    )
    aot.add_argument("--topology", help="Cloud TPU slice for --compile-only, e.g. v5p-64")
    aot.add_argument("--num-slices", type=int, default=1, help="slices joined over DCN (data axis)")
    aot.add_argument("--json", action="store_true", help="--compile-only report as JSON")
    logs.add_flags(p)
    return p


def init_distributed(args: argparse.Namespace) -> None:
    import jax

    if args.coordinator_address is not None:
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    elif args.distributed:
        jax.distributed.initialize()


def _check_distributed(args: argparse.Namespace) -> str | None:
    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        return "--coordinator-address, --num-processes and --process-id go together"
    return None


def compile_only(
    config: str, overrides: list[str], topology: str | None, num_slices: int, as_json: bool, tool: str
) -> int:
    """`train --compile-only` and `plan --compile`: 0 fits, 1 does not, 2 bad input."""
    import jax

    # The compile is what this reports (its seconds, the compiler's memory figures): never a program
    # read back from the persistent cache (compile_cache.py). Set before this process's first compile,
    # where jax decides once whether the cache is used.
    jax.config.update("jax_enable_compilation_cache", False)
    from agentrefine_jax.config import ConfigError
    from agentrefine_jax.train import aot
    from agentrefine_jax.train.topology import UnknownTopology

    try:
        result = aot.compile_check(config, overrides, topology, num_slices)
    except (
        aot.CompileError,
        UnknownTopology,
        ConfigError,
        FileNotFoundError,
        KeyError,
        ValueError,
        TypeError,
    ) as e:
        return fail(tool, e)
    print(json_dumps(result, indent=2) if as_json else aot.format_check(result))
    return 0 if result["compiled"]["fits"] else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(TOOL, args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from agentrefine_jax.train import aot

    if args.compile_only:
        return compile_only(args.config, args.overrides, args.topology, args.num_slices, args.json, TOOL)
    if args.topology or args.num_slices != 1 or args.json:
        return fail(TOOL, "--topology, --num-slices and --json go with --compile-only")
    # With libtpu installed but no TPU here, keep its start-up quiet.
    aot.prepare_tpu_env()
    from agentrefine_jax.config import ConfigError, load_config, to_dict
    from agentrefine_jax.config_checks import check_outputs

    if msg := _check_distributed(args):
        return fail(TOOL, msg)
    try:
        cfg = load_config(args.config, args.overrides)  # validated: nothing is read before this passes
        from agentrefine_jax.hf import model_source

        cfg = model_source.resolve(cfg)  # train.model_source: the model from init_from_hf's config.json
        # The run's own checks of its model (weights' headers, tokenizer files and vocabulary),
        # here too, so --print-config fails exactly as the run would.
        model_source.check(cfg)
    except ConfigError as e:
        return fail(TOOL, e)
    from agentrefine_jax.train.run_dir import TrainingInputError, check_trains_on_data

    try:
        check_trains_on_data(cfg)  # an objective of the rl stage: say which command runs it
    except TrainingInputError as e:
        return fail(TOOL, e)
    if args.print_config:
        print(json_dumps(to_dict(cfg), indent=2))
        return 0
    try:
        check_outputs(cfg)  # a run dir or export target that cannot be written: before any work
    except ConfigError as e:
        return fail(TOOL, e)
    init_distributed(args)
    import jax

    from agentrefine_jax.checkpoint import CheckpointSaveError
    from agentrefine_jax.cli_errors import TERMINATED
    from agentrefine_jax.outputs import OutputError
    from agentrefine_jax.train.loop import Preempted, TrainingError, TrainingInputError, train

    if jax.process_index() != 0:  # one voice per run: the other hosts report only problems
        logging.getLogger(logs.ROOT).setLevel(logging.WARNING)
    try:
        train(cfg)
    except Preempted as e:  # state saved; partial outputs removed
        logging.getLogger("agentrefine_jax.train").info(str(e))
        return TERMINATED  # stopped cleanly (checkpoint saved): run the same command again
    except TrainingInputError as e:
        return fail(TOOL, e)
    except (TrainingError, CheckpointSaveError, OutputError) as e:  # OutputError: the end-of-run export
        fail(TOOL, e)
        return 1
    return 0
