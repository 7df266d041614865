"""The paper in miniature: refinement-tune one base model under Table 2's settings and measure them.

    python benchmarks/mini_paper.py --base ~/.cache/agentrefine_jax/smollm2-135m --out mini_paper \\
        --tokens 200000 --episodes 20

Given a Hugging Face model directory (`--base`, e.g. the SmolLM2-135M-Instruct directory `python -m
agentrefine_jax.export from-gguf` writes; any HF directory the trainer can initialise from), it

1. trains one run per Table 2 setting on the shipped demo trajectories (agentrefine_jax/data/demo/
   train.jsonl), every run for the same token budget (`--tokens`: train steps = ceil(tokens / (batch x
   length)), packed rows of `--max-length` token slots), each a `python -m agentrefine_jax.train
   --config tiny` subprocess whose `--set` overrides are built in `train_command`:
     agentrefine           data.loss_on=correct,refinement (the AgentRefine loss)
     no_refinement_loss    data.loss_on=correct
     erroneous_loss        data.loss_on=correct,refinement,erroneous
     no_refinement_data    data.drop_refinement_data=true
     sft_dpo               train.objective=sft+dpo (only where agentrefine_jax.config has that key)
2. evaluates the base and every tuned model (in this process, `agentrefine_jax.eval`'s CLI) on held-out
   worlds of the demo's own generator (task `demo_world`: unseen seeds, the same action grammar and
   simulator; `--demo-episodes`) and on the built-in held-out tasks (`--tasks`, default babyai, pddl,
   sciworld, textworld; `--episodes` each), greedy;
3. prints, per model and task, success with its Wilson 95% interval, progress, the valid-action rate and
   the format-error rate, and writes Tables 1 and 2 (plus the episodes table: counts, intervals, why
   episodes ended) through `python -m agentrefine_jax.analyze report`, rows named by setting.

Everything goes under `--out`: `runs/<setting>/` (training runs and logs), `eval/<model>/<task>.json`
(one eval result per model and task), `results/<model>.json` (a model's tasks merged into one eval
result), `report/report.md`, `summary.md` / `summary.json` (the printed table, run time, machine). The
run is resumable: a setting whose training finished and an (model, task) evaluation whose result exists
are skipped, so the same command continues an interrupted run. `--out` must be new, empty, or an earlier
mini-paper output with the same settings (`mini_paper.json` records them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))

from agentrefine_jax.analyze.tables import wilson_interval  # noqa: E402
from agentrefine_jax.cli_errors import TERMINATED  # noqa: E402 - the trainer's and eval's exit after SIGTERM
from agentrefine_jax.outputs import write_json, write_text  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402

TOOL = "mini_paper"
MANIFEST = "mini_paper.json"
HELD_OUT = ("babyai", "pddl", "sciworld", "textworld")
DEMO_TASK = "demo_world"
BASE = "base"
# Table 2's settings: name -> the `--set` overrides that make it (the rest of the recipe is shared).
SETTINGS: dict[str, tuple[str, ...]] = {
    "agentrefine": ("data.loss_on=correct,refinement",),
    "no_refinement_loss": ("data.loss_on=correct",),
    "erroneous_loss": ("data.loss_on=correct,refinement,erroneous",),
    "no_refinement_data": ("data.loss_on=correct,refinement", "data.drop_refinement_data=true"),
}
OPTIONAL_SETTINGS: dict[str, tuple[str, ...]] = {
    "sft_dpo": ("data.loss_on=correct,refinement", "train.objective=sft+dpo"),
}


class MiniPaperError(Exception):
    """Bad input or a refused --out: one line, exit 2."""


class Stopped(Exception):
    """SIGTERM: the stage running kept its work (the trainer its checkpoint, eval its finished
    episodes); no later stage starts. Exit 75 (EX_TEMPFAIL, as the trainer and eval): rerun the
    same command to resume."""


class _Sigterm:
    """While installed, SIGTERM is forwarded to the running training subprocess (which saves
    and exits 75) and remembered; eval, run in-process, installs its own handler meanwhile and
    restores this one. `check` raises Stopped once SIGTERM has arrived."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.received = False

    def __enter__(self) -> _Sigterm:
        self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def check(self, what: str, rc: int = 0) -> None:
        if self.received or rc == TERMINATED:
            raise Stopped(f"stopped (SIGTERM) during {what}; rerun the same command to resume")


# ------------------------------------------------------------------------------------------- settings


def available_settings() -> dict[str, tuple[str, ...]]:
    """Table 2's settings, plus SFT+DPO where the trainer has a `train.objective` key."""
    from agentrefine_jax.config import TrainConfig

    out = dict(SETTINGS)
    if "objective" in {f.name for f in dataclasses.fields(TrainConfig)}:
        out.update(OPTIONAL_SETTINGS)
    return out


def model_settings(base_dir: str | pathlib.Path) -> list[str]:
    """The `--set` overrides that make a run train the model of `base_dir` (an HF directory): the
    trainer takes the whole model from it (`train.model_source=init_from_hf`: architecture, special
    tokens, context, tokenizer and chat template; hf/model_source.py). Checked here first, so a
    directory the trainer cannot start from fails with one line before any subprocess."""
    from agentrefine_jax.hf.io import read_hf_config

    d = pathlib.Path(base_dir).resolve()
    try:
        read_hf_config(d)
    except (OSError, ValueError) as e:
        raise MiniPaperError(f"--base {d}: not a model directory the trainer can start from ({e})") from None
    return [f"train.init_from_hf={d}", "train.model_source=init_from_hf"]


def train_steps(tokens: int, batch: int, length: int) -> int:
    return max(1, math.ceil(tokens / (batch * length)))


def remat_policy(run_dir: pathlib.Path) -> str:
    """`full`: each layer's input kept, the rest recomputed; without it a 4 x 512 SmolLM2 trainer
    peaked at 8-11 GB RSS on CPU (docs/scale.md, "CPU memory of a real model"). A run started
    before keeps the policy it started with: resuming refuses a changed model config."""
    try:
        return str(json.loads((run_dir / "config.json").read_text())["model"]["remat_policy"])
    except (OSError, ValueError, KeyError, TypeError):
        return "full"


def train_command(args: argparse.Namespace, setting: str, run_dir: pathlib.Path, steps: int) -> list[str]:
    """`python -m agentrefine_jax.train` for one setting: the shared recipe, the model, the setting."""
    recipe = [
        f"train.run_dir={run_dir}",
        f"train.max_steps={steps}",
        "train.num_epochs=100000",  # the step count (the token budget) ends every run, not epochs
        f"train.global_batch_size={args.batch}",
        f"data.max_length={args.max_length}",
        f"optim.learning_rate={args.lr!r}",
        "optim.warmup_steps=0",
        # About five saves a run: an interrupted run loses at most a fifth (the trainer resumes).
        f"train.checkpoint_every={math.ceil(steps / 5)}",
        "train.keep_checkpoints=1",
        "train.eval_every=0",
        "train.export_hf_at_end=null",
        f"train.seed={args.seed}",
        f"data.seed={args.seed}",
        f"model.param_dtype={args.dtype}",
        f"model.dtype={args.dtype}",
        f"model.remat_policy={remat_policy(run_dir)}",
    ]
    sets = [*model_settings(args.base), *recipe, *available_settings()[setting]]
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny"]
    return cmd + [a for s in sets for a in ("--set", s)]


# ------------------------------------------------------------------------------------------- output dir


def _manifest(args: argparse.Namespace, settings: Sequence[str], steps: int) -> dict[str, Any]:
    """What the results depend on: a resumed run must have the same."""
    return {
        "base": str(pathlib.Path(args.base).resolve()),
        "tokens": args.tokens,
        "steps": steps,
        "batch": args.batch,
        "max_length": args.max_length,
        "lr": args.lr,
        "dtype": args.dtype,
        "seed": args.seed,
        "settings": list(settings),
        "tasks": list(args.tasks),
        "episodes": args.episodes,
        "demo_episodes": args.demo_episodes,
        "max_steps": args.max_steps,
        "max_new_tokens": args.max_new_tokens,
    }


def prepare_out(out: pathlib.Path, manifest: dict[str, Any]) -> None:
    """New or empty: start; an earlier mini paper with the same settings: resume; anything else: refuse."""
    if os.path.lexists(out) and not out.is_dir():
        raise MiniPaperError(f"--out {out} exists and is not a directory")
    path = out / MANIFEST
    if out.is_dir() and any(out.iterdir()):
        try:
            old = json.loads(path.read_text())["settings"]
        except (OSError, ValueError, KeyError, TypeError):
            raise MiniPaperError(
                f"--out {out} is not empty and holds no {MANIFEST} (not a mini-paper output); "
                "choose a new directory"
            ) from None
        changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in manifest.items() if old.get(k) != v]
        if changed:
            raise MiniPaperError(
                f"--out {out} holds a mini paper with other settings ({'; '.join(changed)}); "
                "use the same flags to resume, or a new --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, {"written_by": f"agentrefine_jax benchmarks/{TOOL}.py", "settings": manifest})


# ------------------------------------------------------------------------------------------- stages


def train_setting(
    args: argparse.Namespace, setting: str, out: pathlib.Path, steps: int, log: Any, sigterm: _Sigterm
) -> dict[str, Any]:
    """Train one setting (skipped when its `done.json` exists); the record of its run."""
    run_dir = out / "runs" / setting
    done = run_dir.parent / f"{setting}.done.json"
    if done.exists():
        log(f"{setting}: trained earlier ({done}), skipped")
        return json.loads(done.read_text())
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = train_command(args, setting, run_dir, steps)
    log(f"{setting}: training {steps} steps ({run_dir})")
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{setting}.log", "a", encoding="utf-8") as f:
        sigterm.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = sigterm.child.wait()
        finally:
            sigterm.child = None
    seconds = round(time.perf_counter() - t0, 1)
    sigterm.check(f"{setting}'s training", rc)
    if rc != 0:
        tail = (run_dir.parent / f"{setting}.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{setting}: training exited {rc} after {seconds}s: " + " | ".join(tail))
    record = {"setting": setting, "run_dir": str(run_dir), "steps": steps, "train_seconds": seconds}
    write_json(done, record)
    log(f"{setting}: trained in {seconds}s")
    return record


def eval_model(
    args: argparse.Namespace, label: str, checkpoint: str, out: pathlib.Path, log: Any, sigterm: _Sigterm
) -> pathlib.Path:
    """Evaluate one model on every task (one eval result per task, skipped when it exists) and merge
    them into results/<label>.json, the file `analyze report` reads for this row."""
    from agentrefine_jax.eval.cli import main as eval_main

    files = []
    for task in (DEMO_TASK, *args.tasks):
        path = out / "eval" / label / f"{task}.json"
        files.append(path)
        if path.exists():
            log(f"{label}/{task}: evaluated earlier, skipped")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        episodes = args.demo_episodes if task == DEMO_TASK else args.episodes
        argv = ["--checkpoint", checkpoint, "--tasks", task, "--episodes", str(episodes)]
        argv += ["--out", str(path), "--workdir", str(out / "work" / label / task), "--name", label]
        argv += ["--seed", str(args.seed), "--max-new-tokens", str(args.max_new_tokens)]
        argv += ["--batch-size", str(args.eval_batch)] + (["-q"] if args.quiet else [])
        if args.max_steps:
            argv += ["--max-steps", str(args.max_steps)]
        log(f"{label}/{task}: evaluating {episodes} episodes")
        t0 = time.perf_counter()
        rc = eval_main(argv)
        sigterm.check(f"{label}/{task}'s evaluation", rc)
        if rc != 0:
            raise RuntimeError(f"{label}/{task}: eval exited {rc}")
        log(f"{label}/{task}: evaluated in {time.perf_counter() - t0:.1f}s")
    merged = out / "results" / f"{label}.json"
    merged.parent.mkdir(parents=True, exist_ok=True)
    write_json(merged, merge_results([json.loads(p.read_text()) for p in files]))
    return merged


def merge_results(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One built-in eval result from per-task results of the same agent (metrics recomputed from the
    episode records by eval's own writer, so the merged file has eval's one layout)."""
    from agentrefine_jax.eval.metrics import task_metrics
    from agentrefine_jax.eval.results import results_document

    if any("best_of" in d for d in docs):
        raise ValueError("merge_results: Best-of-N results need their greedy runs merged too (not done here)")
    episodes = [e for d in docs for e in d["episodes"]]
    tasks = [t for d in docs for t in d["config"]["tasks"]]
    config = dict(docs[0]["config"]) | {
        "tasks": tasks,
        "episodes": {t: d["config"]["episodes"] for d in docs for t in d["config"]["tasks"]},
    }
    variants = task_metrics(episodes)
    seconds = round(sum(float(d.get("seconds", 0)) for d in docs), 1)
    return results_document(
        "builtin",
        docs[0]["agent"],
        config,
        tasks=variants.get("original", {}),
        variants=variants,
        episodes=episodes,
        extra={"policy": docs[0]["agent"], "seconds": seconds},
    )


# ------------------------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return {
        **_machine.machine(),  # the CPU's model, ISA and XLA flags, as every benchmark's JSON
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')} x{jax.device_count()}",
    }


def _pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def summary_rows(results: dict[str, pathlib.Path]) -> list[dict[str, Any]]:
    rows = []
    for label, path in results.items():
        doc = json.loads(path.read_text())
        for task, m in doc["variants"]["original"]["tasks"].items():
            n = int(m["episodes"])
            ci = wilson_interval(round(m["success_rate"] * n), n)
            rows.append(
                {
                    "model": label,
                    "task": task,
                    "episodes": n,
                    "success_rate": m["success_rate"],
                    "success_ci95": list(ci) if ci else None,
                    "progress_rate": m["progress_rate"],
                    "valid_action_rate": m.get("valid_action_rate"),
                    "format_error_rate": m.get("format_error_rate"),
                    "terminations": m.get("terminations", {}),
                }
            )
    return rows


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| model | task | n | success % (Wilson 95%) | progress % | valid-action % | format-error % | ends |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["success_ci95"] or (None, None)
        ends = ", ".join(f"{k} {v}" for k, v in r["terminations"].items())
        lines.append(
            f"| {r['model']} | {r['task']} | {r['episodes']} | {_pct(r['success_rate'])} "
            f"[{_pct(lo)}–{_pct(hi)}] | {_pct(r['progress_rate'])} | {_pct(r['valid_action_rate'])} | "
            f"{_pct(r['format_error_rate'])} | {ends} |"
        )
    return "\n".join(lines)


def write_report(results: dict[str, pathlib.Path], out: pathlib.Path) -> int:
    cmd = [sys.executable, "-m", "agentrefine_jax.analyze", "report"]
    cmd += [f"{label}={path}" for label, path in results.items()] + ["--out", str(out / "report")]
    return subprocess.run(cmd, check=False).returncode


# ------------------------------------------------------------------------------------------- CLI


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see docs/mini_paper.md")
    p.add_argument("--base", required=True, help="the base model: a Hugging Face directory")
    p.add_argument("--out", required=True, help="where everything goes (new, empty, or a run to resume)")
    p.add_argument("--tokens", type=_positive, default=200_000, help="training token budget per setting")
    p.add_argument("--batch", type=_positive, default=4, help="sequences per train step")
    p.add_argument("--max-length", type=_positive, default=512, help="token slots per (packed) sequence")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (cosine to 0, no warmup)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="params and compute")
    p.add_argument(
        "--settings",
        help=f"comma-separated subset of {','.join(SETTINGS)},{','.join(OPTIONAL_SETTINGS)} (default: every "
        "available one; sft_dpo only where the trainer has train.objective)",
    )
    p.add_argument("--tasks", default=",".join(HELD_OUT), help="held-out built-in tasks (comma-separated)")
    p.add_argument("--episodes", type=_positive, default=20, help="episodes per held-out task")
    p.add_argument("--demo-episodes", type=_positive, default=50, help="unseen demo worlds per model")
    p.add_argument("--max-steps", type=_positive, help="steps per episode (default: each task's)")
    p.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens per reply")
    p.add_argument("--eval-batch", type=_positive, default=8, help="episodes in flight per model call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="no per-episode lines from eval")
    return p


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    args.tasks = tuple(t for t in args.tasks.split(",") if t and t != DEMO_TASK)  # demo_world always runs
    available = available_settings()
    settings = list(available) if not args.settings else [s for s in args.settings.split(",") if s]
    for s in settings:
        if s not in available:
            extra = " (needs train.objective in agentrefine_jax.config)" if s in OPTIONAL_SETTINGS else ""
            raise MiniPaperError(f"--settings: unknown or unavailable setting {s!r}{extra}; "
                                 f"choose from {', '.join(available)}")  # fmt: skip
    from agentrefine_jax.eval.registry import lookup

    for t in args.tasks:
        try:
            lookup(t, "builtin")
        except ValueError as e:
            raise MiniPaperError(f"--tasks: {e}") from None
    if not pathlib.Path(args.base, "config.json").is_file():
        raise MiniPaperError(f"--base {args.base}: no config.json (expected a Hugging Face model directory)")
    model_settings(args.base)  # a directory the trainer cannot start from fails here, not in a subprocess
    out = pathlib.Path(args.out).absolute()
    steps = train_steps(args.tokens, args.batch, args.max_length)
    prepare_out(out, _manifest(args, settings, steps))

    def log(msg: str) -> None:
        print(f"[{TOOL}] {msg}", flush=True)

    info = machine()
    log(_machine.header(info))
    log(
        f"machine: {info['cpu_count']} CPUs ({info['cpu_model']}), {info['device']}; budget {args.tokens} "
        f"tokens = {steps} steps x {args.batch} x {args.max_length}"
    )
    failures: list[str] = []
    trained: dict[str, dict[str, Any]] = {}
    results: dict[str, pathlib.Path] = {}
    try:
        with _Sigterm() as sigterm:
            for s in settings:
                try:
                    trained[s] = train_setting(args, s, out, steps, log, sigterm)
                # One setting failing (e.g. a missing objective) does not lose the rest.
                except RuntimeError as e:
                    log(f"error: {e}")
                    failures.append(s)
            models = [(BASE, str(pathlib.Path(args.base).resolve()))] + [
                (s, r["run_dir"]) for s, r in trained.items()
            ]
            for label, checkpoint in models:
                try:
                    results[label] = eval_model(args, label, checkpoint, out, log, sigterm)
                except RuntimeError as e:
                    log(f"error: {e}")
                    failures.append(label)
                sigterm.check(f"{label}'s evaluation")
    except Stopped as e:
        log(str(e))
        return TERMINATED
    rows = summary_rows(results)
    table = format_summary(rows)
    rc_report = write_report(results, out) if results else 1
    seconds = round(time.perf_counter() - t0, 1)
    doc = {
        "command": " ".join(sys.argv),
        "machine": info,
        "seconds_this_invocation": seconds,
        "train_seconds": {s: r.get("train_seconds") for s, r in trained.items()},
        "steps": steps,
        "tokens": args.tokens,
        "settings": settings,
        "failures": failures,
        "rows": rows,
    }
    write_json(out / "summary.json", doc)
    write_text(
        out / "summary.md",
        f"# Mini paper\n\nbase `{args.base}`; {args.tokens} tokens per setting "
        f"({steps} steps x {args.batch} x {args.max_length}); machine: {info['cpu_count']} CPUs "
        f"({info['cpu_model']}), {info['device']}; this invocation {seconds} s.\n\n{table}\n",
    )
    print(table)
    where = out / "report" / "report.md"
    log(f"done in {seconds}s on {info['cpu_count']} CPUs ({info['cpu_model']}); tables: {where}")
    if failures:
        log(f"failed: {', '.join(failures)} (rerun the same command to retry them)")
    return 1 if failures or rc_report != 0 else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except MiniPaperError as e:
        print(f"[{TOOL}] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
