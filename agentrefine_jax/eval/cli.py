"""`python -m agentrefine_jax.eval`: the one evaluation CLI (see docs/eval.md).

Episode source: AgentBoard's (its episodes, prompts and rules, read from `--agentboard-dir`; the default
whenever that is given) or built-in (episodes generated from the PyPI simulators).

python -m agentrefine_jax.eval --policy oracle --tasks babyai,pddl --episodes 5 --out oracle.json
python -m agentrefine_jax.eval --checkpoint runs/demo --episodes 20 --best-of 4 --perturb --out r.json
python -m agentrefine_jax.eval --agentboard-dir ~/AgentBoard --tasks pddl --policy oracle --max-steps 200
python -m agentrefine_jax.eval --agentboard-dir ~/AgentBoard --checkpoint runs/x --best-of 4 --temperature 1
python -m agentrefine_jax.eval onpolicy --checkpoint runs/x --tasks demo_world,babyai,pddl --episodes 64 \
    --out onpolicy.jsonl   # on-policy refinement data (eval/onpolicy.py; docs/data.md)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shutil
import signal
import sys
import tempfile
from typing import Any

from agentrefine_jax import logs, outputs
from agentrefine_jax.cli_errors import TERMINATED, OneLineParser, Terminated, fail, raise_terminated
from agentrefine_jax.eval import progress
from agentrefine_jax.eval.config import PAPER_PERTURBATIONS, EvalConfig
from agentrefine_jax.eval.journal import Journal, journal_path
from agentrefine_jax.eval.model_identity import identify
from agentrefine_jax.eval.policies import (
    DEFAULT_STOP,
    CheckpointPolicy,
    OpenAIChatPolicy,
    OraclePolicy,
    Policy,
    RandomPolicy,
    SamplingParams,
)
from agentrefine_jax.eval.registry import SOURCES, default_tasks
from agentrefine_jax.eval.runner import TASK_NAMES, run_eval
from agentrefine_jax.eval.tables import format_table
from agentrefine_jax.models.config import DTYPES
from agentrefine_jax.paths import as_path

BEST_OF_TEMPERATURE = 0.7
# --request-timeout's default (seconds). A CPU endpoint is slow: SmolLM2-135M served by our own server
# on a loaded 2-core machine decodes ~5 tokens/s per sequence, and eight concurrent requests share it,
# so one 256-token reply can take several minutes; the old 120 s failed such episodes as errors.
REQUEST_TIMEOUT = 600.0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m agentrefine_jax.eval",
        description="Evaluate an agent on the paper's tasks: AgentBoard's episodes (--agentboard-dir) "
        "or built-in ones (BabyAI, ScienceWorld, PDDL, TextWorld for Jericho).",
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
        "--source",
        choices=SOURCES,
        help="episode source: agentboard (AgentBoard's episodes and rules on --agentboard-dir; the default "
        "when it is given) or builtin (episodes generated from the PyPI simulators; the default otherwise)",
    )
    # Older spelling of --source (ours = builtin).
    p.add_argument("--protocol", choices=("ours", "agentboard"), help=argparse.SUPPRESS)
    p.add_argument("--agentboard-dir", help="an AgentBoard checkout with its data in DIR/data")
    p.add_argument("--name", help="a label for this run, stored as config.name in the results JSON")
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
        help="comma-separated task names (default: the paper's tasks of the source: "
        f"{','.join(default_tasks('agentboard'))} with --agentboard-dir, else {','.join(TASK_NAMES)}; "
        "jericho's built-in source is TextWorld games, reported as textworld)",
    )
    p.add_argument(
        "--episodes",
        type=int,
        help="episodes per task (default 10; AgentBoard protocol: the first N of AgentBoard's list, "
        "default all)",
    )
    p.add_argument(
        "--best-of",
        type=int,
        default=1,
        help="samples per episode; success if any succeeds, progress the max (AgentBoard source: the greedy "
        "run is reported beside it with the difference, the paper's Table 4)",
    )
    p.add_argument("--perturb", action="store_true", help="also run reworded-action variants (robustness)")
    p.add_argument(
        "--num-perturbations",
        type=int,
        help=f"with --perturb: at most P reworded variants per task (default {PAPER_PERTURBATIONS}, the "
        "paper's Table 3), as many as the task defines (each built-in task: 3; AgentBoard: ALFWorld's 5)",
    )
    _add_run_args(p)
    p.add_argument("--out", help="write the results JSON (metrics + per-episode transcripts) here")
    logs.add_flags(p)  # -q: no per-episode progress lines
    return p


def _add_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="--checkpoint: the compute dtype (default: the model's own: a trainer checkpoint's model.dtype, "
        "bfloat16 for a Hugging Face directory); models compared must be evaluated alike (docs/eval.md)",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """How episodes run: seed, step limit, batching, sampling, request timeout, tools and prompts."""
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
    p.add_argument(
        "--no-kv-reuse",
        dest="kv_reuse",
        action="store_false",
        help="--checkpoint: prefill every turn's whole prompt again instead of keeping each episode's KV "
        "cache between turns (same greedy actions, slower; for comparison)",
    )
    _add_dtype_arg(p)
    p.add_argument(
        "--tool-calls",
        action="store_true",
        help="--base-url: drive a tool-calling model: the action is offered as one `act` tool (the function "
        "tool-call training rows use), earlier turns are sent as its calls and results, and the reply's "
        "call is read back as the turn's action (docs/eval.md)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT,
        help=f"--base-url: seconds one HTTP request may take, connect to the last byte of the reply "
        f"(default {REQUEST_TIMEOUT:.0f}: sized for a CPU endpoint, where one --max-new-tokens 256 reply "
        "among 8 concurrent requests to a small model on a busy 2-core machine takes minutes; a hosted "
        "GPU endpoint answers in seconds, so lower it there to fail a hung request sooner)",
    )
    p.add_argument(
        "--progress-every",
        type=float,
        default=progress.DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"print a progress line (episodes done/total, in flight, steps, how long the current policy "
        f"call has been waiting, elapsed) every SECONDS while episodes run, even when none ends (default "
        f"{progress.DEFAULT_INTERVAL:.0f}; -q turns it off with the other progress lines)",
    )
    p.add_argument("--sciworld-simplification", default="easy", help="ScienceWorld simplification string")
    p.add_argument(
        "--workdir",
        help="where games, tool caches and scratch files go (default: a temp dir, deleted afterwards)",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        help="import MODULE first; it may call agentrefine_jax.eval.register_task (repeatable)",
    )
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="TASK.KEY=VALUE",
        help="an option passed (as a string) to TASK's built-in episode source, e.g. hotpotqa.file=dev.json",
    )
    p.add_argument(
        "--prompt-style",
        choices=("chat", "agentboard"),
        default="chat",
        help="our harness's prompt layout (agentrefine_jax.layout): chat = multi-turn, as `synth convert "
        "--prompt-style chat` writes; agentboard = AgentBoard's single user message with the history",
    )


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
    if getattr(args, "tool_calls", False) and not args.base_url:
        raise ValueError("--tool-calls needs --base-url (an endpoint that answers tool calls)")
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
            tool_calls=getattr(args, "tool_calls", False),
        )
    return CheckpointPolicy(
        args.checkpoint,
        sampling,
        template=args.template,
        kv_reuse=args.kv_reuse,
        load_from=getattr(args, "load_from", None),
        dtype=args.dtype,
    )


def source_of(args: argparse.Namespace) -> str:
    if args.protocol and args.source and {"ours": "builtin"}.get(args.protocol, args.protocol) != args.source:
        raise ValueError("--protocol and --source disagree")
    source = args.source or {"ours": "builtin", "agentboard": "agentboard", None: None}[args.protocol]
    return source or ("agentboard" if args.agentboard_dir else "builtin")


def task_options(specs: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        task, dot, name = key.partition(".")
        if not (eq and dot and task and name):
            raise ValueError(f"--task-option {spec!r}: expected TASK.KEY=VALUE")
        out.setdefault(task, {})[name] = value
    return out


def task_names(args: argparse.Namespace, source: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in (args.tasks or ",".join(default_tasks(source))).split(",") if t.strip())


def eval_config(args: argparse.Namespace, source: str, **extra: Any) -> EvalConfig:
    """The one config of a run under either source, validated (every bad flag fails before a model loads)."""
    if args.num_perturbations is not None and not args.perturb:
        raise ValueError("--num-perturbations needs --perturb")
    if args.perturb and args.num_perturbations is not None and args.num_perturbations < 1:
        raise ValueError(f"--num-perturbations must be >= 1, got {args.num_perturbations}")
    temperature = args.temperature
    if args.best_of > 1 and temperature is None:
        temperature = BEST_OF_TEMPERATURE
    config = EvalConfig(
        tasks=task_names(args, source),
        source=source,
        episodes=args.episodes,
        best_of=args.best_of,
        temperature=temperature,
        top_p=args.top_p,
        perturbations=(args.num_perturbations or PAPER_PERTURBATIONS) if args.perturb else 0,
        seed=args.seed,
        max_steps=args.max_steps,
        # a policy gains nothing from batching and would start one ScienceWorld JVM per episode
        batch_size=args.batch_size or (1 if args.policy else 8),
        prompt_style=args.prompt_style,
        name=args.name,
        **extra,
    )
    config.validate()
    return config


# Settings that do not change what the episodes do: a journal is resumed across them.
_NOT_RESULTS = ("quiet", "verbose", "workdir", "progress_every")
# Named by the journal's model identity instead (model_identity.py): a step directory resumes the journal
# its run directory began, a run directory that now names a newer step does not.
_THE_MODEL = ("checkpoint", "base_url", "model")


def pin_model(args: argparse.Namespace) -> dict[str, Any] | None:
    """Resolve --checkpoint to one step now (`args.load_from`: what is loaded, whatever the run saves
    meanwhile) and return the identity the journal is bound to and the results record."""
    args.load_from = None
    if args.checkpoint and args.all_checkpoints:  # each step is identified as it is evaluated
        return {"run": str(as_path(args.checkpoint)), "all_checkpoints": True}
    identity = identify(args.checkpoint, args.base_url, args.model)
    if args.checkpoint and identity is not None:
        args.load_from = identity["checkpoint"]
    return identity


def open_journal(args: argparse.Namespace, model: dict[str, Any] | None = None) -> Journal | None:
    """The journal beside --out (none without --out: nowhere to resume to), bound to `model`."""
    if not args.out:
        return None
    hidden = _NOT_RESULTS + (_THE_MODEL if model is not None else ()) + ("load_from",)
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in hidden}
    journal = Journal(journal_path(args.out), settings, model)
    if journal.resumed:
        logging.getLogger("agentrefine_jax.eval").info(
            f"resuming: {journal.resumed} finished episodes read from {journal.path}"
        )
    return journal


def run(args: argparse.Namespace) -> int:
    # Output paths first: a long evaluation must never end in results that cannot be written.
    if args.out:
        outputs.check_file(args.out)
    if args.log_dir:
        outputs.check_writable_dir(args.log_dir, flag="--log-dir")
    source = source_of(args)
    for module in args.plugin:
        importlib.import_module(module)
    if not args.progress_every > 0:
        raise ValueError(f"--progress-every must be > 0 seconds, got {args.progress_every}")
    model = pin_model(args)
    journal = _JOURNAL.journal = open_journal(args, model)
    try:
        with progress.Progress(args.progress_every, logging.getLogger("agentrefine_jax.eval").info):
            if source == "agentboard":
                code = run_agentboard(args, journal, model)
            else:
                code = run_builtin(args, journal, model)
    finally:
        if journal is not None:
            journal.close()
    if journal is not None:
        journal.remove()  # the results are written: a rerun starts afresh
    return code


def run_builtin(
    args: argparse.Namespace, journal: Journal | None, model: dict[str, Any] | None = None
) -> int:
    if args.agentboard_dir or args.context_length or args.log_dir or args.all_checkpoints:
        raise ValueError(
            "--agentboard-dir/--context-length/--log-dir/--all-checkpoints need the agentboard source"
        )
    options = task_options(args.task_option)
    options.setdefault("sciworld", {}).setdefault("simplification", args.sciworld_simplification)
    own_workdir = args.workdir is None
    # A placeholder until the arguments are known to be good, so a bad call leaves no temp dir behind.
    workdir = args.workdir or "<temporary>"
    config = eval_config(args, "builtin", workdir=workdir, task_options=options)
    if args.policy is None and args.best_of > 1:
        _sampling(args)  # fail before loading a model
    log = logging.getLogger("agentrefine_jax.eval").info
    policy = make_policy(args)
    dtype = _compute_dtype(policy)
    if own_workdir:
        config.workdir = workdir = tempfile.mkdtemp(prefix="agentrefine-eval-")
    try:
        doc = run_eval(policy, config, log=log, journal=journal)
    finally:
        policy.close()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(doc), flush=True)
    _write(args.out, _with_model(doc, model, dtype), len(doc["episodes"]))
    return 0


def _compute_dtype(policy: Policy) -> str | None:
    """The compute dtype a local model was loaded with (None for an endpoint or a policy): an HF directory
    and a trainer checkpoint of the same weights load with different defaults and play differently."""
    return policy.compute_dtype if isinstance(policy, CheckpointPolicy) else None


def _with_model(
    doc: dict[str, Any], model: dict[str, Any] | None, dtype: str | None = None
) -> dict[str, Any]:
    """The results with the model they came from (`model`: checkpoint step and fingerprint, or endpoint;
    the journal is bound to the same record) and, for a local model, the dtype it computed in."""
    if model is None:
        return doc
    head = {k: v for k, v in doc.items() if k != "episodes"}
    if dtype is not None:
        head["compute_dtype"] = dtype
    return {**head, "model": model, "episodes": doc["episodes"]}


def run_agentboard(
    args: argparse.Namespace, journal: Journal | None = None, model_identity: dict[str, Any] | None = None
) -> int:
    """The AgentBoard source: its episodes, prompts and rules, read from the user's checkout."""
    from agentrefine_jax.eval.agentboard import runner as ab
    from agentrefine_jax.eval.agentboard.checkout import Checkout

    if not args.agentboard_dir:
        raise ValueError("the agentboard source needs --agentboard-dir DIR (an AgentBoard checkout)")
    config = eval_config(args, "agentboard", log_dir=args.log_dir)
    checkout = Checkout(args.agentboard_dir)
    log = logging.getLogger("agentrefine_jax.eval").info
    if args.all_checkpoints and not args.checkpoint:
        raise ValueError("--all-checkpoints needs --checkpoint RUN_DIR")
    if args.checkpoint and args.all_checkpoints:
        steps = ab.kept_checkpoints(args.checkpoint)
        doc = ab.run_checkpoints(
            checkout,
            config,
            steps,
            lambda path: ab.checkpoint_model(
                path, args.template, args.context_length, kv_reuse=args.kv_reuse, dtype=args.dtype
            ),
            log=log,
            journal=journal,
        )
        print(format_table(doc), flush=True)
        _write(args.out, doc, sum(len(r["result"]["episodes"]) for r in doc["checkpoints"]))
        return 0
    model, dtype = None, None
    if not args.policy:
        actor = make_policy(args)
        dtype = _compute_dtype(actor)
        try:
            model = ab.template_model(actor, args.template, args.context_length)
        except ValueError:
            actor.close()
            raise
    try:
        doc = ab.run(checkout, config, model=model, policy=args.policy, log=log, journal=journal)
    finally:
        if model is not None:
            model.close()
    print(format_table(doc), flush=True)
    _write(args.out, _with_model(doc, model_identity, dtype), len(doc["episodes"]))
    return 0


def _write(out: str | None, doc: dict, episodes: int) -> None:
    """The results JSON, written to a temporary sibling and renamed into place."""
    if not out:
        return
    outputs.write_json(out, doc)
    logging.getLogger("agentrefine_jax.eval").info(f"wrote {out} ({episodes} episode records)")


class _JournalHolder:
    journal: Journal | None = None


_JOURNAL = _JournalHolder()


def build_onpolicy_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m agentrefine_jax.eval onpolicy",
        description="On-policy refinement data: a checkpoint plays training worlds (never an eval episode); "
        "the expert answers each rejected turn; canonical trajectory JSONL (docs/data.md).",
    )
    p.add_argument("--checkpoint", required=True, help="project checkpoint / run dir or HF model dir")
    p.add_argument("--template", help="chat template (default: the checkpoint's)")
    p.add_argument(
        "--tasks",
        default="demo_world",
        help="comma-separated tasks with a training split: demo_world, babyai, pddl (default %(default)s)",
    )
    p.add_argument("--episodes", type=int, required=True, help="training episodes per task")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="which training episodes (demo_world: worlds SEED..SEED+N-1 of the demo's training seeds) and "
        "the sampling seeds (default 0)",
    )
    p.add_argument("--max-steps", type=int, help="steps per episode (default: each task's own)")
    p.add_argument("--batch-size", type=int, default=8, help="episodes in flight (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--no-kv-reuse", dest="kv_reuse", action="store_false", help="prefill every turn's whole prompt"
    )
    _add_dtype_arg(p)
    p.add_argument(
        "--progress-every",
        type=float,
        default=progress.DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"a progress line every SECONDS (default {progress.DEFAULT_INTERVAL:.0f})",
    )
    p.add_argument("--workdir", help="scratch files (default: a temp dir, deleted afterwards)")
    p.add_argument("--out", required=True, help="the trajectory JSONL (written at the end; a journal beside)")
    logs.add_flags(p)
    return p


def run_onpolicy(args: argparse.Namespace) -> int:
    """The collector's command: checks, journal, the episodes, the JSONL, a summary on stdout."""
    from agentrefine_jax.eval.onpolicy import collect, plan

    outputs.check_file(args.out)
    if not args.progress_every > 0:
        raise ValueError(f"--progress-every must be > 0 seconds, got {args.progress_every}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:
        raise ValueError("need --temperature >= 0, 0 < --top-p <= 1 and --max-new-tokens >= 1")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    log = logging.getLogger("agentrefine_jax.eval").info
    own_workdir = args.workdir is None
    workdir = args.workdir or tempfile.mkdtemp(prefix="agentrefine-onpolicy-")
    episodes = policy = journal = None
    try:
        # every episode is checked against the eval split before the model loads
        episodes = plan(tasks, args.episodes, seed=args.seed, workdir=workdir, max_steps=args.max_steps)
        # Pinned to one step now, and the journal bound to that model's identity (as eval's run is), not to
        # the --checkpoint string: a run directory that names a newer step, or a model trained again in
        # its place, must not resume episodes another model played into one file of rows.
        model = identify(args.checkpoint, None, None)
        args.load_from = model["checkpoint"]
        journal = _JOURNAL.journal = open_journal(args, model)
        with progress.Progress(args.progress_every, log):
            sampling = SamplingParams(args.temperature, args.top_p, args.max_new_tokens, DEFAULT_STOP)
            policy = CheckpointPolicy(
                args.load_from, sampling, template=args.template, kv_reuse=args.kv_reuse, dtype=args.dtype
            )
            result = collect(policy, episodes, batch_size=args.batch_size, journal=journal)
    finally:
        for done in (policy, episodes, journal):
            if done is not None:
                done.close()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    with outputs.open_atomic(args.out, newline="\n") as f:
        for row in result.rows:
            f.write(outputs.json_dumps(row, ensure_ascii=False) + "\n")
    if journal is not None:
        journal.remove()  # the rows are written: a rerun starts afresh
    print(outputs.json_dumps(result.summary(), indent=1), flush=True)
    log(f"wrote {args.out} ({len(result.rows)} rows from {len(result.episodes)} episodes)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    onpolicy = bool(argv) and argv[0] == "onpolicy"
    args = build_onpolicy_parser().parse_args(argv[1:]) if onpolicy else build_parser().parse_args(argv)
    logs.setup("eval", args)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        return run_onpolicy(args) if onpolicy else run(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        return fail("eval", e)
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the message
        j = _JOURNAL.journal
        kept = (
            f"{len(j.records)} finished episodes kept in {j.path}; rerun the same command to resume"
            if j is not None
            else "no --out, so no journal: nothing kept"
        )
        print(f"[eval] terminated (SIGTERM): {kept}", file=sys.stderr, flush=True)
        return TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)
