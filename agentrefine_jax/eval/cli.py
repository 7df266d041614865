"""`python -m agentrefine_jax.eval`: held-out agent evaluation on offline environments.

python -m agentrefine_jax.eval --policy oracle --tasks babyai,pddl --episodes 5 --out oracle.json
python -m agentrefine_jax.eval --base-url http://127.0.0.1:8000/v1 --model demo --episodes 20 --out r.json
python -m agentrefine_jax.eval --checkpoint runs/demo --episodes 20 --best-of 4 --perturb --out r.json
python -m agentrefine_jax.eval --protocol agentboard --agentboard-dir ~/AgentBoard --tasks pddl \
    --policy oracle --max-steps 200 --out pddl_oracle.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile

from agentrefine_jax.eval.policies import (
    DEFAULT_STOP,
    CheckpointPolicy,
    OpenAIChatPolicy,
    OraclePolicy,
    Policy,
    RandomPolicy,
    SamplingParams,
)
from agentrefine_jax.eval.runner import TASK_NAMES, EvalConfig, format_table, run_eval

BEST_OF_TEMPERATURE = 0.7


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agentrefine_jax.eval",
        description="Evaluate an agent on offline held-out tasks (BabyAI, ScienceWorld, PDDL, TextWorld).",
    )
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--checkpoint", help="project checkpoint / run dir or HF model dir (local generation)")
    who.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    who.add_argument(
        "--policy", choices=("oracle", "random"), help="reference solver or uniform random actions"
    )
    p.add_argument("--model", help="model name sent to --base-url")
    p.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key for --base-url (never logged)",
    )
    p.add_argument(
        "--template",
        help="chat template for --checkpoint (default: the checkpoint's); with --protocol agentboard and "
        "--base-url, the template (llama3|mistral) that counts prompt tokens for history truncation",
    )
    p.add_argument(
        "--protocol",
        choices=("ours", "agentboard"),
        default="ours",
        help="ours: this project's offline tasks; agentboard: AgentBoard's protocol on --agentboard-dir",
    )
    p.add_argument("--agentboard-dir", help="an AgentBoard checkout with its data in DIR/data")
    p.add_argument(
        "--all-checkpoints",
        action="store_true",
        help="AgentBoard protocol, with --checkpoint RUN_DIR: evaluate every kept checkpoint, report each "
        "table and the best (held-out unweighted mean success, then progress)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        help="AgentBoard protocol: the model's context in tokens (history is truncated to fit it; default: "
        "the checkpoint's max_position_embeddings; required with --base-url)",
    )
    p.add_argument(
        "--log-dir",
        help="AgentBoard protocol: write AgentBoard-style logs here (logs/<task>.jsonl, <task>.txt, "
        "all_results.txt)",
    )
    p.add_argument(
        "--tasks",
        help=f"comma-separated subset of {','.join(TASK_NAMES)} (AgentBoard protocol: of "
        "alfworld,babyai,sciworld,pddl,jericho; default: all)",
    )
    p.add_argument(
        "--episodes",
        type=int,
        help="episodes per task (default 10; AgentBoard protocol: the first N of AgentBoard's list, "
        "default all)",
    )
    p.add_argument("--best-of", type=int, default=1, help="samples per episode; success if any succeeds")
    p.add_argument("--perturb", action="store_true", help="also run reworded-action variants (robustness)")
    p.add_argument(
        "--num-perturbations",
        type=int,
        help="reworded variants with --perturb (default 3; AgentBoard protocol: ALFWorld's 5)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-steps",
        type=int,
        help="steps per episode (default: 40 for every task; AgentBoard protocol: 30)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="episodes in flight, answered by one batched model call (default: 8 for models, 1 for "
        "--policy, which gains nothing from batching and would start one ScienceWorld JVM per episode)",
    )
    p.add_argument(
        "--temperature", type=float, help=f"default 0 (greedy); {BEST_OF_TEMPERATURE} with --best-of > 1"
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per HTTP request")
    p.add_argument("--sciworld-simplification", default="easy", help="ScienceWorld simplification string")
    p.add_argument(
        "--workdir",
        help="where games, tool caches and scratch files go (default: a temp dir, deleted afterwards)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="import MODULE first; it may call agentrefine_jax.eval.register_task (e.g. ALFWorld, Jericho)",
    )
    p.add_argument(
        "--prompt-style",
        choices=("chat", "agentboard"),
        default="chat",
        help="our harness's prompt layout (agentrefine_jax.layout): chat = multi-turn, as `synth convert "
        "--prompt-style chat` writes; agentboard = AgentBoard's single user message with the history",
    )
    p.add_argument("--out", help="write the results JSON (metrics + per-episode transcripts) here")
    p.add_argument("--quiet", action="store_true", help="no per-episode progress lines")
    return p


def _sampling(args: argparse.Namespace) -> SamplingParams:
    temperature = args.temperature
    if temperature is None:
        temperature = BEST_OF_TEMPERATURE if args.best_of > 1 else 0.0
    if args.best_of > 1 and temperature == 0.0:
        raise ValueError("--best-of > 1 with temperature 0 would repeat the same greedy run")
    if temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError("need temperature >= 0 and 0 < top-p <= 1")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    return SamplingParams(temperature, args.top_p, args.max_new_tokens, DEFAULT_STOP)


def make_policy(args: argparse.Namespace) -> Policy:
    if args.policy == "oracle":
        return OraclePolicy()
    if args.policy == "random":
        return RandomPolicy()
    sampling = _sampling(args)
    if args.base_url:
        if not args.model:
            raise ValueError("--base-url needs --model")
        return OpenAIChatPolicy(
            args.base_url,
            args.model,
            sampling,
            api_key_env=args.api_key_env,
            concurrency=args.batch_size or 8,
            timeout=args.request_timeout,
        )
    return CheckpointPolicy(args.checkpoint, sampling, template=args.template)


def run(args: argparse.Namespace) -> int:
    if args.protocol == "agentboard":
        from agentrefine_jax.eval.agentboard.cli import run_agentboard

        return run_agentboard(args)
    if args.agentboard_dir or args.context_length or args.log_dir or args.all_checkpoints:
        raise ValueError(
            "--agentboard-dir/--context-length/--log-dir/--all-checkpoints need --protocol agentboard"
        )
    for module in args.plugin:
        importlib.import_module(module)
    tasks = tuple(t.strip() for t in (args.tasks or ",".join(TASK_NAMES)).split(",") if t.strip())
    own_workdir = args.workdir is None
    # A placeholder until the arguments are known to be good, so a bad call leaves no temp dir behind.
    workdir = args.workdir or "<temporary>"
    batch_size = args.batch_size or (1 if args.policy else 8)
    config = EvalConfig(
        tasks=tasks,
        episodes=10 if args.episodes is None else args.episodes,
        best_of=args.best_of,
        perturb=args.perturb,
        num_perturbations=3 if args.num_perturbations is None else args.num_perturbations,
        seed=args.seed,
        max_steps=args.max_steps,
        batch_size=batch_size,
        workdir=workdir,
        task_options={"sciworld": {"simplification": args.sciworld_simplification}},
        prompt_style=args.prompt_style,
    )
    config.validate()
    if args.policy is None and args.best_of > 1:
        _sampling(args)  # fail before loading a model
    log = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    policy = make_policy(args)
    if own_workdir:
        config.workdir = workdir = tempfile.mkdtemp(prefix="agentrefine-eval-")
    try:
        doc = run_eval(policy, config, log=log)
    finally:
        policy.close()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(doc), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
        os.replace(tmp, args.out)
        print(
            f"[eval] wrote {args.out} ({len(doc['episodes'])} episode transcripts)",
            file=sys.stderr,
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"[eval] error: {e}", file=sys.stderr, flush=True)
        return 2
