"""GRPO on the real model, measured: success on unseen demo worlds before and after, the reward curve,
rollout vs training throughput (issue 42, item 5; docs/rl.md, "Measured on the real model").

    python benchmarks/grpo_real.py --start /work/mini_paper_run/runs/agentrefine --out grpo_real

`--start` is the refinement-tuned model: a trainer run directory, checkpoint root or step directory
(e.g. the mini paper's `runs/agentrefine`), or a Hugging Face directory. The script

1. pins the start: a checkpoint is resolved once to its step (recorded in `start.json`, so a rerun
   after the run directory has moved on still starts from the same parameters) and exported to
   `start_hf/` by `python -m agentrefine_jax.export to-hf` (float32 stays float32: the export keeps
   the dtype the run imported); an HF directory is used as it is. The rl stage initialises from an HF
   directory (`train.init_from_hf`), as every run of the trainer does;
2. evaluates the start on `--eval-episodes` unseen demo worlds (`python -m agentrefine_jax.eval`'s
   held-out demo_world seeds, greedy; as benchmarks/mini_paper.py does, but each stage in its own
   process, so an evaluation's memory is freed before GRPO loads): `eval/before.json`, `eval/before.log`;
3. runs GRPO (`python -m agentrefine_jax.rl --config grpo_demo`, initialised from the start, the
   knobs below) on demo_world's training worlds only (the rl stage plays the task's training split):
   `rl/` (its run directory: checkpoints, metrics.jsonl with a row per phase, the rollout journals);
4. evaluates the GRPO result the same way: `eval/after.json`. Both evaluations pass eval's `--dtype
   float32`: left to its default eval computes an HF directory in bfloat16 and a checkpoint in its run's
   dtype (the smoke run's identical parameters played differently the two ways). A checkpoint start is
   evaluated as the pinned checkpoint and the result as the run's last checkpoint; an HF start as itself
   and the result as the run's HF export;
5. writes `reward_curve.png` (matplotlib, Agg) from the run's phase rows, and `summary.json` /
   `summary.md`: success before and after with Wilson 95% intervals, the phases' rewards, rollout
   tokens/s (sampled tokens over rollout seconds) against training tokens/s (the updates' row tokens over
   their seconds), and the verdict: whether the after interval lies wholly above the before interval.

Resumable: rerunning the same command continues. An export, evaluation or GRPO run that finished
(its file or `rl.done.json` exists) is skipped; an interrupted GRPO run resumes from its run
directory (its checkpoints and rollout journals, docs/rl.md "Resume"); an interrupted evaluation
resumes from its journal (eval's own: finished episodes are kept). `--out` must be new, empty, or
an earlier grpo_real output with the same settings (`grpo_real.json`). SIGTERM: the running stage
keeps its work, exit 75; rerun to resume.

Default size (docs/rl.md, "Measured on the real model", has the arithmetic from a smoke run): 8 phases
x 4 worlds x 8 episodes (256 episodes), 2 optimizer steps of 16 episodes per phase (16 steps, gradients
accumulated over micro-batches of 4), at most 12 actions of 64 tokens per episode, rows of 1536 tokens;
64 unseen worlds before and after (at most 20 actions of 128 tokens, demo_world's limit).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))

from agentrefine_jax import host_memory  # noqa: E402
from agentrefine_jax.analyze.tables import wilson_interval  # noqa: E402
from agentrefine_jax.cli_errors import TERMINATED, leave, redeliver_swallowed_signals  # noqa: E402 - the trainer's and eval's exit after SIGTERM
from agentrefine_jax.outputs import atomic_path, write_json, write_text  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402
import _mini_data  # noqa: E402
import _outdir  # noqa: E402
import mini_paper  # noqa: E402 - its SIGTERM forwarding, machine record, eval-result rows and quiet start-up

TOOL = "grpo_real"
TASK = "demo_world"
EVAL_DTYPE = "float32"  # the mini paper's: every model of a comparison computes alike
BEFORE, AFTER = "before", "after"  # the evaluations: eval/<label>.json
RL_CONFIG = "grpo_demo"  # the shipped GRPO config: SmolLM2's execution settings; the model comes from --start


class GrpoRealError(Exception):
    """Bad input or a refused --out: one line, exit 2."""


# ------------------------------------------------------------------------------------------- start model


def classify_start(start: str) -> dict[str, Any]:
    """What `--start` names now: a checkpoint's root, step and compute dtype (a checkpoint is tried
    first: a run directory holds a config.json too, the trainer's, not an HF one), or an HF directory."""
    from agentrefine_jax.checkpoint import read_meta, resolve_checkpoint
    from agentrefine_jax.hf.io import read_hf_config

    src = pathlib.Path(start).resolve()
    try:
        root, step = resolve_checkpoint(src)
        dtype = read_meta(root, step).model.dtype  # the compute dtype eval will load it in
    except (FileNotFoundError, ValueError) as ckpt_error:
        try:
            read_hf_config(src)
        except (OSError, ValueError) as e:
            raise GrpoRealError(
                f"--start {src}: neither a checkpoint ({ckpt_error}) nor a Hugging Face model directory ({e})"
            ) from None
        return {"kind": "hf", "path": str(src)}
    return {"kind": "checkpoint", "path": str(src), "root": str(root), "step": int(step), "dtype": dtype}


def pin_start(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    """`--start` fixed at the first invocation (`start.json`): a run directory's latest step changes
    while its run goes on; a rerun keeps the step it started from."""
    record = out / "start.json"
    if record.exists():
        return json.loads(record.read_text())
    pinned = classify_start(args.start)
    write_json(record, pinned)
    return pinned


def start_hf(pinned: dict[str, Any], out: pathlib.Path, log: Any) -> pathlib.Path:
    """The start as an HF directory: itself, or the pinned checkpoint step exported to start_hf/
    (written to a sibling, renamed into place once whole)."""
    if pinned["kind"] == "hf":
        return pathlib.Path(pinned["path"])
    step_dir = pathlib.Path(pinned["root"]) / str(pinned["step"])
    try:
        return _mini_data.export_hf(step_dir, out / "start_hf", lambda msg: log(f"start: {msg}"))
    except RuntimeError as e:
        raise GrpoRealError(f"--start {e}") from None


# ------------------------------------------------------------------------------------------- stages


def evaluate(
    args: argparse.Namespace, label: str, checkpoint: pathlib.Path, out: pathlib.Path, log: Any, sigterm: Any
) -> pathlib.Path:
    """`--eval-episodes` unseen demo worlds, greedy (eval's defaults), skipped when the result exists;
    `python -m agentrefine_jax.eval` in its own process, its output in eval/<label>.log."""
    path = out / "eval" / f"{label}.json"
    if path.exists():
        log(f"{label}: evaluated earlier ({path}), skipped")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--checkpoint", str(checkpoint), "--tasks", TASK, "--episodes", str(args.eval_episodes)]
    argv += ["--out", str(path), "--workdir", str(out / "work" / label), "--name", label]
    argv += ["--seed", str(args.seed), "--max-new-tokens", str(args.eval_max_new_tokens)]
    # Both evaluations compute in float32 whatever was loaded (an HF directory would default to bfloat16).
    argv += ["--dtype", EVAL_DTYPE, "--batch-size", str(args.eval_batch)] + (["-q"] if args.quiet else [])
    if args.eval_max_steps:
        argv += ["--max-steps", str(args.eval_max_steps)]
    log_file = out / "eval" / f"{label}.log"
    log(f"{label}: evaluating {checkpoint} on {args.eval_episodes} unseen {TASK} worlds (log {log_file})")
    t0 = time.perf_counter()
    # Each stage its own process: an evaluation's model and KV caches are freed before the GRPO run loads
    # its own (in one process the two together were OOM-killed beside the mini paper's trainer).
    rc = sigterm.run([sys.executable, "-m", "agentrefine_jax.eval", *argv], log_file)
    sigterm.check(f"{label}'s evaluation", rc)
    if rc != 0:
        raise RuntimeError(f"{label}: eval exited {rc}: {mini_paper.log_tail(log_file)}")
    log(f"{label}: evaluated in {time.perf_counter() - t0:.1f}s")
    return path


def rl_command(
    args: argparse.Namespace, hf: pathlib.Path, run_dir: pathlib.Path, export_hf: bool
) -> list[str]:
    """`python -m agentrefine_jax.rl` from the start's HF directory with this benchmark's knobs;
    `export_hf`: also write the result as an HF directory (run_dir/hf), to be evaluated as the start was."""
    sets = [
        f"train.init_from_hf={hf}",
        "train.init_from_gguf=none",
        "train.model_source=init_from_hf",
        f"train.run_dir={run_dir}",
        f"train.max_steps={args.phases * args.updates_per_phase}",
        f"train.checkpoint_every={args.updates_per_phase}",  # after each phase
        "train.keep_checkpoints=1",
        f"train.export_hf_at_end={'hf' if export_hf else 'none'}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.seed={args.seed}",
        f"data.max_length={args.max_length}",
        f"optim.learning_rate={args.lr!r}",
        "rl.task=demo_world",
        f"rl.worlds_per_phase={args.worlds_per_phase}",
        f"rl.group_size={args.group_size}",
        f"rl.updates_per_phase={args.updates_per_phase}",
        f"rl.max_turns={args.max_turns}",
        f"rl.max_new_tokens={args.max_new_tokens}",
        f"rl.temperature={args.temperature!r}",
        f"rl.reward={args.reward}",
        f"rl.seed={args.seed}",
    ]
    cmd = [sys.executable, "-m", "agentrefine_jax.rl", "--config", RL_CONFIG]
    return cmd + [a for s in sets for a in ("--set", s)]


def run_grpo(
    args: argparse.Namespace, hf: pathlib.Path, export_hf: bool, out: pathlib.Path, log: Any, sigterm: Any
) -> dict[str, Any]:
    """The GRPO run (skipped when rl.done.json exists; resumed from its run directory otherwise).
    `final`: what the after evaluation loads — the last checkpoint, or (`export_hf`) its HF export."""
    run_dir, done = out / "rl", out / "rl.done.json"
    if done.exists():
        log(f"GRPO: finished earlier ({done}), skipped")
        return json.loads(done.read_text())
    steps = args.phases * args.updates_per_phase
    log(f"GRPO: {args.phases} phases x {args.worlds_per_phase} worlds x {args.group_size} episodes, "
        f"{steps} optimizer steps ({run_dir}; log {out / 'rl.log'})")  # fmt: skip
    t0 = time.perf_counter()
    rc = sigterm.run(rl_command(args, hf, run_dir, export_hf), out / "rl.log")
    seconds = round(time.perf_counter() - t0, 1)
    sigterm.check("the GRPO run", rc)
    if rc != 0:
        raise RuntimeError(f"GRPO exited {rc} after {seconds}s: {mini_paper.log_tail(out / 'rl.log')}")
    final = run_dir / "hf" if export_hf else run_dir / "checkpoints" / str(steps)
    record = {"run_dir": str(run_dir), "steps": steps, "final": str(final)}
    record["seconds_last_invocation"] = seconds
    write_json(done, record)
    log(f"GRPO: done in {seconds}s")
    return record


# ------------------------------------------------------------------------------------------- report


def phase_rows(run_dir: pathlib.Path, updates: int) -> list[dict[str, Any]]:
    """The run's phase rows, each with its updates' row tokens and seconds (from the step rows and
    the phase's training tokens/s)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    phases = [r for r in rows if "phase" in r]
    for p in phases:
        steps = [
            r for r in rows if "phase" not in r and "loss" in r and (r["step"] - 1) // updates == p["phase"]
        ]
        p["train_tokens"] = float(sum(r["tokens"] for r in steps))
        p["train_seconds"] = p["train_tokens"] / max(p["train_tokens_per_sec"], 1e-9)
    return sorted(phases, key=lambda r: r["phase"])


def throughput(phases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rollout vs training tokens/s over the run, and without phase 0 (its rollouts include the
    engine's first compilation)."""

    def over(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
        rs, ts = sum(r["rollout_seconds"] for r in rows), sum(r["train_seconds"] for r in rows)
        return {
            "rollout_tokens_per_sec": sum(r["sampled_tokens"] for r in rows) / rs if rs > 0 else None,
            "train_tokens_per_sec": sum(r["train_tokens"] for r in rows) / ts if ts > 0 else None,
            "rollout_seconds": rs,
            "train_seconds": ts,
        }

    def median_phase(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        # Totals weigh a phase by its seconds, so one phase stretched by a paused or loaded host
        # (a shared box) drags them; the median phase's rates do not move with one such phase.
        return {
            "rollout_tokens_per_sec": statistics.median(r["rollout_tokens_per_sec"] for r in rows),
            "train_tokens_per_sec": statistics.median(r["train_tokens_per_sec"] for r in rows),
            "phases": len(rows),
        }

    later = phases[1:]
    return {
        "all_phases": over(phases),
        "after_phase_0": over(later) if later else None,
        "median_phase_after_0": median_phase(later) if later else None,
    }


def success(path: pathlib.Path) -> dict[str, Any]:
    """Success on the unseen worlds with its Wilson 95% interval (mini_paper's row of the eval result)."""
    (row,) = [
        r for r in mini_paper.summary_rows({"m": path}) if r["task"] == TASK and r["variant"] == "original"
    ]
    n = row["episodes"]
    k = round(row["success_rate"] * n)
    doc = json.loads(path.read_text())
    return {
        "episodes": n,
        "successes": k,
        "success_rate": row["success_rate"],
        "success_ci95": list(wilson_interval(k, n) or (None, None)),
        "progress_rate": row["progress_rate"],
        "format_error_rate": row["format_error_rate"],
        "valid_action_rate": row["valid_action_rate"],
        "eval_seconds": doc.get("seconds"),
    }


def verdict(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One sentence: whether the after interval lies wholly above (or below) the before interval."""

    def cell(s: dict[str, Any]) -> str:
        lo, hi = s["success_ci95"]
        return f"{100 * s['success_rate']:.1f}% [{100 * lo:.1f}-{100 * hi:.1f}]"

    (blo, bhi), (alo, ahi) = before["success_ci95"], after["success_ci95"]
    a, b = cell(after), cell(before)
    where = f"{before['episodes']} unseen demo worlds, Wilson 95%"
    if alo > bhi:
        return f"GRPO raised success: after {a} lies above before {b} ({where})."
    if ahi < blo:
        return f"GRPO lowered success: after {a} lies below before {b} ({where})."
    return (
        f"No difference shown: the after interval {a} does not lie above the before interval {b} ({where})."
    )


def plot_rewards(phases: Sequence[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    """Reward mean ± std and success per phase (training worlds, sampled), written atomically."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    x = [r["phase"] for r in phases]
    mean = [r["reward_mean"] for r in phases]
    std = [r["reward_std"] for r in phases]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.errorbar(x, mean, yerr=std, marker="o", capsize=3, label="reward mean ± std")
    ax.plot(x, [r["success_rate"] for r in phases], marker="s", linestyle="--", label="success rate")
    ax.set_xlabel("phase")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("reward (training worlds, sampled)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def compute_dtypes(out: pathlib.Path) -> dict[str, str | None]:
    """The dtype each evaluation computed in, as its results record it (eval's `compute_dtype`)."""
    return {
        label: json.loads((out / "eval" / f"{label}.json").read_text()).get("compute_dtype")
        for label in ("before", "after")
    }


def format_summary(doc: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}"

    lines = ["| model | unseen worlds | success % (Wilson 95%) | progress % | format-error % | eval s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for label, s in (("start (before)", doc["before"]), ("GRPO (after)", doc["after"])):
        lo, hi = s["success_ci95"]
        lines.append(
            f"| {label} | {s['episodes']} | {pct(s['success_rate'])} [{pct(lo)}–{pct(hi)}] | "
            f"{pct(s['progress_rate'])} | {pct(s['format_error_rate'])} | {s['eval_seconds'] or '–'} |"
        )
    head = (
        "| phase | reward mean ± std | success % | progress | groups with signal | sampled tokens "
        "| rollout s | rollout tok/s | train tokens | train s | train tok/s |"
    )
    lines += ["", head, "|---" * 11 + "|"]
    for r in doc["phases"]:
        lines.append(
            f"| {r['phase']} | {r['reward_mean']:.3f} ± {r['reward_std']:.3f} | {pct(r['success_rate'])} | "
            f"{r['progress_mean']:.2f} | {r['groups_with_signal']:.2f} | {r['sampled_tokens']} | "
            f"{r['rollout_seconds']:.0f} | {r['rollout_tokens_per_sec']:.1f} | {r['train_tokens']:.0f} | "
            f"{r['train_seconds']:.0f} | {r['train_tokens_per_sec']:.1f} |"
        )
    t = doc["throughput"]["all_phases"]
    lines += ["", f"Rollouts {t['rollout_tokens_per_sec']:.1f} sampled tok/s vs updates "
              f"{t['train_tokens_per_sec']:.1f} row tok/s over all phases "
              f"({t['rollout_seconds']:.0f} s rollouts, {t['train_seconds']:.0f} s updates)."]  # fmt: skip
    later = doc["throughput"]["after_phase_0"]
    if later:
        lines[-1] += (f" Without phase 0 (compilation): {later['rollout_tokens_per_sec']:.1f} vs "
                      f"{later['train_tokens_per_sec']:.1f}.")  # fmt: skip
    med = doc["throughput"]["median_phase_after_0"]
    if med:
        lines[-1] += (f" Median phase of phases 1–{med['phases']} (one paused or loaded phase does not "
                      f"move it): {med['rollout_tokens_per_sec']:.1f} vs "
                      f"{med['train_tokens_per_sec']:.1f}.")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see docs/rl.md")
    p.add_argument(
        "--start", required=True, help="the refinement-tuned model: trainer run dir / checkpoint, or HF dir"
    )
    p.add_argument("--out", required=True, help="where everything goes (new, empty, or a run to resume)")
    g = p.add_argument_group("GRPO (python -m agentrefine_jax.rl --config grpo_demo, these overrides)")
    g.add_argument("--phases", type=_positive, default=8, help="rollout phases")
    g.add_argument("--worlds-per-phase", type=_positive, default=4, help="training worlds per phase")
    g.add_argument("--group-size", type=_positive, default=8, help="sampled episodes per world (>= 2)")
    g.add_argument("--updates-per-phase", type=_positive, default=2, help="optimizer steps per phase")
    g.add_argument(
        "--micro-batch",
        type=_positive,
        default=4,
        help="episodes per forward/backward (gradients accumulate)",
    )
    g.add_argument("--max-turns", type=_positive, default=12, help="actions per training episode")
    g.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens per reply in the rollouts")
    g.add_argument("--max-length", type=_positive, default=1536, help="an episode's token row (longer: cut)")
    g.add_argument("--lr", type=float, default=5e-6, help="learning rate (constant, no warm-up)")
    g.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    g.add_argument("--reward", default="progress", choices=("success", "progress"), help="rl.reward")
    e = p.add_argument_group("evaluation (python -m agentrefine_jax.eval, greedy, unseen demo worlds)")
    e.add_argument("--eval-episodes", type=_positive, default=64, help="unseen demo worlds, before and after")
    e.add_argument("--eval-max-steps", type=_positive, help="actions per episode (default: demo_world's)")
    e.add_argument("--eval-max-new-tokens", type=_positive, default=128, help="tokens per reply")
    e.add_argument("--eval-batch", type=_positive, default=16, help="episodes in flight per model call")
    p.add_argument("--seed", type=int, default=0, help="GRPO's worlds and sampling; eval's world seeds")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-episode lines from eval")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.group_size < 2:
        raise GrpoRealError(
            f"--group-size must be >= 2 (a group's advantages need two episodes), got {args.group_size}"
        )
    if (args.worlds_per_phase * args.group_size) % args.updates_per_phase:
        raise GrpoRealError(
            f"--updates-per-phase {args.updates_per_phase} does not divide a phase's "
            f"{args.worlds_per_phase * args.group_size} episodes (worlds x group size)"
        )
    rows = args.worlds_per_phase * args.group_size // args.updates_per_phase
    if rows % args.micro_batch:
        raise GrpoRealError(
            f"--micro-batch {args.micro_batch} does not divide an optimizer step's {rows} episodes"
        )
    if args.lr <= 0 or args.temperature <= 0:
        raise GrpoRealError("--lr and --temperature must be > 0")
    if args.seed < 0:
        raise GrpoRealError(f"--seed must be >= 0, got {args.seed}")
    if not pathlib.Path(args.start).exists():
        raise GrpoRealError(f"--start {args.start} does not exist")
    classify_start(args.start)  # neither a checkpoint nor an HF directory: one line before --out is made


def _manifest(args: argparse.Namespace) -> dict[str, Any]:
    """What the results depend on: a resumed run must have the same."""
    keep = ("phases", "worlds_per_phase", "group_size", "updates_per_phase", "micro_batch", "max_turns",
            "max_new_tokens", "max_length", "lr", "temperature", "reward", "eval_episodes", "eval_max_steps",
            "eval_max_new_tokens", "seed")  # fmt: skip
    return {"start": str(pathlib.Path(args.start).resolve())} | {k: getattr(args, k) for k in keep}


_positive = _outdir.positive  # an argparse type: an integer >= 1


def prepare_out(out: pathlib.Path, manifest: dict[str, Any]) -> None:
    """New or empty: start; an earlier grpo_real output with the same settings: resume; else refuse."""
    try:
        _outdir.prepare_out(out, manifest, tool=TOOL, what="grpo_real")
    except _outdir.OutDirError as e:
        raise GrpoRealError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    check_args(args)
    out = pathlib.Path(args.out).absolute()
    prepare_out(out, _manifest(args))

    def log(msg: str) -> None:
        print(f"[{TOOL}] {msg}", flush=True)

    info = _machine.machine()  # the CPU, its ISA, the XLA flags (every benchmark's JSON and header)
    log(_machine.header(info))
    try:
        with mini_paper._Sigterm() as sigterm:
            pinned = pin_start(args, out)
            hf = start_hf(pinned, out, log)
            # Before and after are loaded the same way, so they compute in the same dtype: eval loads
            # an HF directory in the model config's default compute dtype (bfloat16) and a checkpoint in
            # the dtype its run recorded (float32 for the mini paper's runs and the GRPO run).
            from_checkpoint = pinned["kind"] == "checkpoint"
            before_model = pathlib.Path(pinned["root"]) / str(pinned["step"]) if from_checkpoint else hf
            before_path = evaluate(args, BEFORE, before_model, out, log, sigterm)
            sigterm.check("the start's evaluation")
            grpo = run_grpo(args, hf, not from_checkpoint, out, log, sigterm)
            after_path = evaluate(args, AFTER, pathlib.Path(grpo["final"]), out, log, sigterm)
    except mini_paper.Stopped as e:
        log(str(e))
        return TERMINATED
    except RuntimeError as e:
        log(f"error: {e} (rerun the same command to retry)")
        return 1
    phases = phase_rows(out / "rl", args.updates_per_phase)
    start_name = pinned["path"] + (f" step {pinned['step']}" if pinned["kind"] == "checkpoint" else "")
    short = "/".join(pathlib.Path(pinned["path"]).parts[-2:])  # the full path is in summary.md
    short += f" step {pinned['step']}" if pinned["kind"] == "checkpoint" else ""
    plot_rewards(phases, out / "reward_curve.png", f"GRPO on demo_world training worlds from {short}")
    before, after = success(before_path), success(after_path)
    seconds = round(time.perf_counter() - t0, 1)
    doc = {
        "command": " ".join(sys.argv),
        "machine": info,
        "runtime": {k: v for k, v in mini_paper.machine().items() if k not in info},  # jax, python, device
        "seconds_this_invocation": seconds,
        "start": pinned,
        "settings": _manifest(args),
        "before": before,
        "after": after,
        "verdict": verdict(before, after),
        "compute_dtypes": compute_dtypes(out),
        "phases": phases,
        "throughput": throughput(phases),
        "grpo": grpo,
        "reward_curve": str(out / "reward_curve.png"),
    }
    write_json(out / "summary.json", doc)
    table = format_summary(doc)
    dt = doc["compute_dtypes"]
    table += f"\n\nEvaluations computed in {dt['before']} (before) and {dt['after']} (after)" + (
        "." if dt["before"] == dt["after"] else ": NOT the same dtype, the comparison mixes two numerics."
    )
    write_text(
        out / "summary.md",
        f"# GRPO on the real model\n\nstart `{start_name}`; {args.phases} phases x {args.worlds_per_phase} "
        f"worlds x {args.group_size} episodes, {args.updates_per_phase} updates per phase; machine: "
        f"{_machine.header(info)}; this invocation {seconds} s.\n\n{table}\n\n{doc['verdict']}\n\n"
        f"![reward curve](reward_curve.png)\n",
    )
    print(table)
    log(doc["verdict"])
    log(f"done in {seconds}s; {out / 'summary.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except GrpoRealError as e:
        print(f"[{TOOL}] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    host_memory.bound_heap()  # eval runs in this process: its heap gives freed caches back (eval's entry)
    redeliver_swallowed_signals()  # eval, run in-process, stops by raising from its SIGTERM handler
    leave(main())
