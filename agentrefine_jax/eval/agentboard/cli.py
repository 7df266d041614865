"""`python -m agentrefine_jax.eval --protocol agentboard ...`: the AgentBoard branch of the eval CLI."""

from __future__ import annotations

import argparse
import json
import os
import sys

from agentrefine_jax.eval.agentboard.checkout import Checkout
from agentrefine_jax.eval.agentboard.protocol import DEFAULT_MAX_STEPS
from agentrefine_jax.eval.agentboard.runner import TASKS, RunConfig, format_table, run

# Options of our harness that AgentBoard's protocol fixes (greedy, 100 tokens, one sample, no rewording).
_NOT_HERE = ("best_of", "temperature", "plugin")


def run_agentboard(args: argparse.Namespace) -> int:
    if not args.agentboard_dir:
        raise ValueError("--protocol agentboard needs --agentboard-dir DIR (an AgentBoard checkout)")
    for name in _NOT_HERE:
        value = getattr(args, name, None)
        if value not in (None, False, [], 1):
            raise ValueError(f"--{name.replace('_', '-')} is not available with --protocol agentboard")
    tasks = tuple(t.strip() for t in (args.tasks or ",".join(TASKS)).split(",") if t.strip())
    config = RunConfig(
        tasks=tasks,
        max_steps=DEFAULT_MAX_STEPS if args.max_steps is None else args.max_steps,
        batch_size=args.batch_size or (1 if args.policy else 8),
        seed=args.seed,
        log_dir=args.log_dir,
        limit=args.episodes,
        perturbations=(5 if args.num_perturbations is None else args.num_perturbations)
        if args.perturb
        else 0,
    )
    config.validate()
    checkout = Checkout(args.agentboard_dir)
    log = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.all_checkpoints and not args.checkpoint:
        raise ValueError("--all-checkpoints needs --checkpoint RUN_DIR")
    if args.checkpoint and args.all_checkpoints:
        from agentrefine_jax.eval.agentboard.runner import (
            checkpoint_model,
            format_run_table,
            kept_checkpoints,
            run_checkpoints,
        )

        steps = kept_checkpoints(args.checkpoint)
        doc = run_checkpoints(
            checkout,
            config,
            steps,
            lambda path: checkpoint_model(path, args.template, args.context_length),
            log=log,
        )
        print(format_run_table(doc), flush=True)
        _write(args.out, doc, sum(len(r["result"]["episodes"]) for r in doc["checkpoints"]))
        return 0
    model = None
    if args.checkpoint:
        from agentrefine_jax.eval.agentboard.runner import checkpoint_model

        model = checkpoint_model(args.checkpoint, args.template, args.context_length)
    elif args.base_url:
        from agentrefine_jax.eval.agentboard.runner import endpoint_model

        if not args.model:
            raise ValueError("--base-url needs --model")
        if not args.template or not args.context_length:
            raise ValueError(
                "--protocol agentboard with --base-url needs --template (llama3|mistral) and "
                "--context-length: history is truncated on the templated prompt's token count"
            )
        model = endpoint_model(
            args.base_url,
            args.model,
            args.template,
            args.context_length,
            args.api_key_env,
            args.request_timeout,
        )
    try:
        doc = run(checkout, config, model=model, policy=args.policy, log=log)
    finally:
        if model is not None:
            model.close()
    print(format_table(doc), flush=True)
    _write(args.out, doc, len(doc["episodes"]))
    return 0


def _write(out: str | None, doc: dict, episodes: int) -> None:
    if not out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
    os.replace(tmp, out)
    print(f"[eval] wrote {out} ({episodes} episodes)", file=sys.stderr, flush=True)
