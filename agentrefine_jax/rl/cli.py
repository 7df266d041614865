"""Command line for GRPO on the one episode engine: `python -m agentrefine_jax.rl --config F`.

Errors follow the house convention (agentrefine_jax.cli_errors): one line on stderr, exit 2 for
a bad command line, config or model directory, exit 1 when the run itself stops on an error, 75
when SIGTERM stopped it cleanly (rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import logging
import os

from agentrefine_jax import logs
from agentrefine_jax.cli_errors import OneLineParser, add_config_flags, fail
from agentrefine_jax.outputs import json_dumps

TOOL = "rl"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m agentrefine_jax.rl",
        description="Multi-turn GRPO on the one episode engine: rollouts in the trainer's own process, "
        "then optimizer steps on them, phase after phase (docs/rl.md).",
        epilog="example: python -m agentrefine_jax.rl --config grpo_demo --set train.max_steps=4 "
        "(add --print-config to see the resolved config)",
    )
    add_config_flags(p, "rl.group_size=8")
    p.add_argument(
        "--print-config", action="store_true", help="validate and print the resolved config, then exit"
    )
    logs.add_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(TOOL, args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from agentrefine_jax.train import aot

    aot.prepare_tpu_env()  # with libtpu installed but no TPU here, keep its start-up quiet
    from agentrefine_jax.config import ConfigError, load_config, to_dict
    from agentrefine_jax.config_checks import check_outputs
    from agentrefine_jax.hf import model_source
    from agentrefine_jax.rl.loop import TrainingInputError, prepare

    try:
        cfg = load_config(args.config, args.overrides)  # validated: nothing is read before this passes
        cfg = prepare(model_source.resolve(cfg))  # the model from init_from_hf; the phases' shape
        model_source.check(cfg)  # the run's own checks of its model, so --print-config fails as the run
    except (ConfigError, TrainingInputError) as e:
        return fail(TOOL, e)
    if args.print_config:
        print(json_dumps(to_dict(cfg), indent=2))
        return 0
    try:
        check_outputs(cfg)  # a run dir or export target that cannot be written: before any work
    except ConfigError as e:
        return fail(TOOL, e)

    from agentrefine_jax.checkpoint import CheckpointSaveError
    from agentrefine_jax.cli_errors import TERMINATED
    from agentrefine_jax.outputs import OutputError
    from agentrefine_jax.rl.loop import Preempted, TrainingError, train

    try:
        train(cfg)
    except Preempted as e:  # state saved; rerun to resume
        logging.getLogger("agentrefine_jax.rl").info(str(e))
        return TERMINATED
    except TrainingInputError as e:
        return fail(TOOL, e)
    except (TrainingError, CheckpointSaveError, OutputError) as e:  # OutputError: the end-of-run export
        fail(TOOL, e)
        return 1
    return 0
