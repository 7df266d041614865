"""The paper in miniature: refinement-tune one base model under Table 2's settings and measure them.

    python benchmarks/mini_paper.py --base ~/.cache/agentrefine_jax/smollm2-135m --out mini_paper

Given a Hugging Face model directory (`--base`, e.g. the SmolLM2-135M-Instruct directory `python -m
agentrefine_jax.export from-gguf` writes; any HF directory the trainer can initialise from), it

1. generates the training data: worlds 0..N-1 of the demo's own generator (`_mini_data.demo_data`, the
   generator of agentrefine_jax/data/demo/train.jsonl), N grown until the data holds 1.2x the token
   budget even with refinement data dropped, so no setting's budget repeats a row (each run records its
   epochs, which stay under 1);
2. trains one run per setting, every run for the same token budget (`--tokens`: train steps =
   ceil(tokens / (batch x length)), packed rows of `--max-length` token slots), each a `python -m
   agentrefine_jax.train --config tiny` subprocess whose `--set` overrides are built in `train_command`:
     agentrefine           data.loss_on=correct,refinement (the AgentRefine loss)
     no_refinement_loss    data.loss_on=correct
     erroneous_loss        data.loss_on=correct,refinement,erroneous
     no_refinement_data    data.drop_refinement_data=true
     sft_dpo               train.objective=sft+dpo (only where agentrefine_jax.config has that key)
     onpolicy              agentrefine's recipe on data mixing in agentrefine's own mistakes: the trained
                           agentrefine model plays `--onpolicy-episodes` training worlds, the expert refines
                           each rejected action (`eval onpolicy`), and those rows replace demo rows
3. evaluates the base and every tuned model (in this process, `agentrefine_jax.eval`'s CLI) on unseen
   worlds of the demo's own generator (task `demo_world`: held-out seeds, the same action grammar and
   simulator; `--demo-episodes`, also under `--perturbations` reworded action sets) and on the built-in
   held-out tasks (`--tasks`, default babyai, pddl; `--episodes` each), greedy;
4. prints, per model, task and variant, success with its Wilson 95% interval, progress, the valid-action,
   format-error and recovery columns, evaluation episodes per hour, and the plain sentences (which tuned
   rows' success intervals lie above base's; recovery per model), and writes Tables 1 and 2 (plus the
   episodes table) through `agentrefine_jax.analyze report` (in this process), rows named by setting.

Everything goes under `--out`: `data/` (the generated and on-policy data), `runs/<setting>/` (training
runs and logs), `eval/<model>/<task>.json` (one eval result per model and task), `results/<model>.json`
(a model's tasks merged into one eval result), `report/report.md`, `summary.md` / `summary.json` (the
printed table, run time, machine). The run is resumable: data made, a setting whose training finished
and an (model, task) evaluation whose result exists are skipped, and an interrupted training run,
collection or evaluation resumes from its checkpoint or journal, so the same command continues an
interrupted run. `--out` must be new, empty, or an earlier mini-paper output with the same settings
(`mini_paper.json` records them). Models are done one at a time (a setting trained, then evaluated);
`--only` picks which this invocation does, and `--record DIR` keeps what finished stages made (results,
training records, on-policy rows; no checkpoints) for a new `--out` on another machine to go on from
(docs/mini_paper.md, "A run longer than its machine").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(REPO))

from agentrefine_jax import startup  # noqa: E402

# Before JAX starts (the machine record creates its backend): no libtpu start-up lines on a host
# without TPU chips, as every CLI's own start-up does (agentrefine_jax/startup.py).
startup.quiet_start()

from agentrefine_jax import host_memory  # noqa: E402
from agentrefine_jax.analyze.tables import wilson_interval  # noqa: E402
from agentrefine_jax.cli_errors import TERMINATED, float_in, leave, redeliver_swallowed_signals  # noqa: E402 - the trainer's and eval's exit after SIGTERM
from agentrefine_jax.outputs import write_json, write_text  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _machine  # noqa: E402
import _mini_data  # noqa: E402
import _outdir  # noqa: E402
import _record  # noqa: E402

TOOL = "mini_paper"
HELD_OUT = ("babyai", "pddl")
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
# Beyond the paper: the AgentRefine recipe on data that mixes in the `agentrefine` model's own mistakes on
# training worlds, each refined by the expert (`eval onpolicy`; DAgger's first round: aggregate, retrain
# from the base for the same budget). Its data is made after `agentrefine` trains (`_mini_data`).
ONPOLICY = "onpolicy"
ONPOLICY_FROM = "agentrefine"
# What a record (--record) keeps of --out: what finished stages made, small enough to commit. Restored
# into a new --out: all but the summary and report, which every invocation writes afresh. The data a
# run generates (deterministic from the flags) and the checkpoints are made again where needed.
# (eval/*/*.json: each task's result and the `.machine.json` beside it; an evaluation stopped part way
# (SIGTERM) keeps its journal there until it finishes, so a new machine goes on from its episodes; so
# does the on-policy collection, beside its rows.)
JOURNALS = ("eval/*/*.journal.jsonl", "data/onpolicy.jsonl.journal.jsonl")
RESTORED_FILES = ("runs/*.done.json", "runs/*.log", "eval/*/*.json", *JOURNALS, "data/onpolicy.jsonl")
RECORD_FILES = (*RESTORED_FILES, "summary.json", "summary.md", "report/report.md")


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

    def run(self, cmd: list[str], log_file: pathlib.Path) -> int:
        """Run `cmd` as the current child, its output appended to `log_file`; its exit status."""
        with open(log_file, "a", encoding="utf-8") as f:
            self.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_mini_data.child_env())
            try:
                return self.child.wait()
            finally:
                self.child = None

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
    out[ONPOLICY] = SETTINGS[ONPOLICY_FROM]  # the same recipe; only its data differs
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


def train_command(
    args: argparse.Namespace, setting: str, run_dir: pathlib.Path, steps: int, files: Sequence[str]
) -> list[str]:
    """`python -m agentrefine_jax.train` for one setting: the shared recipe, the model, the data, the
    setting."""
    recipe = [
        f"train.run_dir={run_dir}",
        f"data.train_files={json.dumps([str(f) for f in files])}",
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
        "perturbations": args.perturbations,
        "error_rate": args.error_rate,
        "onpolicy_episodes": args.onpolicy_episodes,
    }


_positive = _outdir.positive  # an argparse type: an integer >= 1


def prepare_out(out: pathlib.Path, manifest: dict[str, Any]) -> None:
    """New or empty: start; an earlier mini_paper output with the same settings: resume; else refuse."""
    try:
        _outdir.prepare_out(out, manifest, tool=TOOL, what="mini-paper")
    except _outdir.OutDirError as e:
        raise MiniPaperError(str(e)) from None


# ------------------------------------------------------------------------------------------- stages


def log_tail(log_file: pathlib.Path) -> str:
    """A failed child's last three log lines, for its one-line error."""
    return " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])


def epochs_trained(log_file: pathlib.Path, steps: int) -> float | None:
    """Steps over the trainer's steps per epoch (its start line): under 1 means no row was repeated."""
    found = re.findall(r"\((\d+) steps/epoch", log_file.read_text(errors="replace"))
    return round(steps / int(found[-1]), 3) if found and int(found[-1]) > 0 else None


def final_step(run_dir: pathlib.Path) -> int | None:
    """The newest checkpoint step saved in `run_dir`, or None (no directory, no checkpoint yet)."""
    from agentrefine_jax.checkpoint import resolve_checkpoint

    if not run_dir.is_dir():
        return None
    try:
        return resolve_checkpoint(str(run_dir))[1]
    except (FileNotFoundError, ValueError):
        return None


def train_setting(
    args: argparse.Namespace,
    setting: str,
    out: pathlib.Path,
    steps: int,
    files: Sequence[str],
    log: Any,
    sigterm: _Sigterm,
) -> dict[str, Any]:
    """Train one setting on `files` (resuming its run where one was started); the record of its run."""
    run_dir = out / "runs" / setting
    done = run_dir.parent / f"{setting}.done.json"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = train_command(args, setting, run_dir, steps, files)
    log(f"{setting}: training {steps} steps ({run_dir})")
    t0 = time.perf_counter()
    rc = sigterm.run(cmd, run_dir.parent / f"{setting}.log")
    seconds = round(time.perf_counter() - t0, 1)
    sigterm.check(f"{setting}'s training", rc)
    if rc != 0:
        tail = log_tail(run_dir.parent / f"{setting}.log")
        raise RuntimeError(f"{setting}: training exited {rc} after {seconds}s: {tail}")
    epochs = epochs_trained(run_dir.parent / f"{setting}.log", steps)
    record = {"setting": setting, "run_dir": str(run_dir), "steps": steps, "train_seconds": seconds}
    record |= {"train_files": list(map(str, files)), "epochs": epochs, "machine": machine_line()}
    write_json(done, with_earlier(done, record))
    log(f"{setting}: trained in {seconds}s ({epochs} epochs of its data)")
    return record


def with_earlier(done: pathlib.Path, record: dict[str, Any]) -> dict[str, Any]:
    """`record` with the trainings `done` already recorded under `earlier`, oldest first. A setting is
    trained again where its checkpoint is gone but still needed (another machine, a lost disk): the
    cells its first training played stay attributed to that training's machine and time."""
    try:
        prior = json.loads(done.read_text())
    except FileNotFoundError:
        return record
    earlier = prior.pop("earlier", [])
    return record | {"earlier": [*earlier, prior]}


def eval_model(
    args: argparse.Namespace,
    label: str,
    checkpoint: str,
    out: pathlib.Path,
    log: Any,
    sigterm: _Sigterm,
    keep: Callable[[], None] = lambda: None,
    run_config: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Evaluate one model on every task (one eval result per task, skipped when it exists) and merge
    them into results/<label>.json, the file `analyze report` reads for this row. `keep` runs after
    each task's result is written (the record's save: a machine lost during the next task keeps it)."""
    from agentrefine_jax.eval.cli import main as eval_main

    files = eval_files(args, label, out)
    for task, path in zip((DEMO_TASK, *args.tasks), files, strict=True):
        if path.exists():
            log(f"{label}/{task}: evaluated earlier, skipped")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        episodes = args.demo_episodes if task == DEMO_TASK else args.episodes
        argv = ["--checkpoint", checkpoint, "--tasks", task, "--episodes", str(episodes)]
        if task == DEMO_TASK and args.perturbations:  # the same unseen worlds, reworded action sets
            argv += ["--perturb", "--num-perturbations", str(args.perturbations)]
        argv += ["--out", str(path), "--workdir", str(out / "work" / label / task), "--name", label]
        argv += ["--seed", str(args.seed), "--max-new-tokens", str(args.max_new_tokens)]
        # Every row computes in the training dtype: an HF base would otherwise load in bfloat16 compute, a
        # trainer checkpoint in its run's float32, and the rows would not be evaluated alike.
        batch = args.eval_batch if task == DEMO_TASK else args.task_batch or args.eval_batch
        argv += ["--dtype", args.dtype, "--batch-size", str(batch)] + (["-q"] if args.quiet else [])
        if args.max_steps:
            argv += ["--max-steps", str(args.max_steps)]
        log(f"{label}/{task}: evaluating {episodes} episodes")
        t0 = time.perf_counter()
        rc = eval_main(argv)
        sigterm.check(f"{label}/{task}'s evaluation", rc)
        if rc != 0:
            raise RuntimeError(f"{label}/{task}: eval exited {rc}")
        seconds = round(time.perf_counter() - t0, 1)
        if run_config is not None:  # what analyze's Table 2 reads, kept with the result (and the record)
            write_json(path, json.loads(path.read_text()) | {"run_config": run_config})
        # Which machine played it: a run continued elsewhere (--record) may span several.
        write_json(path.with_suffix(".machine.json"), {"machine": machine_line(), "seconds": seconds})
        log(f"{label}/{task}: evaluated in {seconds}s")
        keep()
    return merged_result(args, label, out)


def merged_result(
    args: argparse.Namespace, label: str, out: pathlib.Path, log: Callable[[str], None] | None = None
) -> pathlib.Path:
    """results/<label>.json: the model's per-task results merged, the file `analyze report` reads; with
    `log`, a warning where its tasks were played by different models."""
    merged = out / "results" / f"{label}.json"
    merged.parent.mkdir(parents=True, exist_ok=True)
    doc = merge_results([json.loads(p.read_text()) for p in eval_files(args, label, out)])
    if log is not None and "models" in doc:
        # A row trained again on another machine (--record) evaluates its remaining tasks with that
        # training; on another kind of CPU it need not come out bit-identical. Said, and kept in the result.
        log(
            f"warning: {label}'s tasks were played by different models ("
            + ", ".join(f"{t}: {f[:12] if f else 'unknown'}" for t, f in doc["models"].items())
            + "): trained again on another machine, it did not come out the same; its cells are not one "
            "model's"
        )
    write_json(merged, doc)
    return merged


def played_by(docs: Sequence[dict[str, Any]]) -> dict[str, str | None]:
    """Task -> the fingerprint of the model that played it (eval's `model` record; None if it has none)."""
    return {t: (d.get("model") or {}).get("fingerprint") for d in docs for t in d["config"]["tasks"]}


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
    known = [d.get("seconds") for d in docs]
    seconds = None if None in known else round(sum(float(x) for x in known), 1)
    # The training settings analyze's Table 2 reads (a tuned row is played as an HF export, which has none).
    run_config = {"run_config": docs[0]["run_config"]} if all("run_config" in d for d in docs) else {}
    # The model every task was played by (eval's record), or, where their fingerprints differ, each task's.
    played = played_by(docs)
    model = {"model": docs[0].get("model")} if len(set(played.values())) == 1 else {"models": played}
    return results_document(
        "builtin",
        docs[0]["agent"],
        config,
        tasks=variants.get("original", {}),
        variants=variants,
        episodes=episodes,
        extra={"policy": docs[0]["agent"], "seconds": seconds, **run_config, **model},
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


def machine_line() -> str:
    """The machine in a few words, recorded with each stage's output."""
    info = _machine.machine()
    return f"{os.cpu_count()} CPUs ({info['cpu_model']})"


def stage_machines(out: pathlib.Path) -> dict[str, str]:
    """Which machine made each training run and evaluation found under `out` (stage -> machine)."""
    found = {}
    for done in sorted((out / "runs").glob("*.done.json")):
        name = done.name.removesuffix(".done.json")
        record = json.loads(done.read_text())
        found[f"train {name}"] = record.get("machine", "?")
        for i, prior in enumerate(record.get("earlier", []), 1):
            found[f"train {name} (earlier {i})"] = prior.get("machine", "?")
    for side in sorted((out / "eval").glob("*/*.machine.json")):
        name = f"{side.parent.name}/{side.name.removesuffix('.machine.json')}"
        found[f"eval {name}"] = json.loads(side.read_text())["machine"]
    return found


def _pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def summary_rows(results: dict[str, pathlib.Path]) -> list[dict[str, Any]]:
    """One row per model, task and variant (`original`, `perturbation_K`): success with its Wilson
    interval, progress, the action columns and the recovery columns (docs/eval.md, "Metrics")."""
    rows = []
    for label, path in results.items():
        doc = json.loads(path.read_text())
        for variant, block in doc["variants"].items():
            for task, m in block["tasks"].items():
                n = int(m["episodes"])
                ci = wilson_interval(round(m["success_rate"] * n), n)
                rows.append(
                    {
                        "model": label,
                        "task": task,
                        "variant": variant,
                        "episodes": n,
                        "success_rate": m["success_rate"],
                        "success_ci95": list(ci) if ci else None,
                        "progress_rate": m["progress_rate"],
                        "valid_action_rate": m.get("valid_action_rate"),
                        "format_error_rate": m.get("format_error_rate"),
                        "recovery_rate": m.get("recovery_rate"),
                        "mean_steps_to_recover": m.get("mean_steps_to_recover"),
                        "repeated_error_rate": m.get("repeated_error_rate"),
                        "after_error_turns": (m.get("recovery_counts") or {}).get("after_error"),
                        "terminations": m.get("terminations", {}),
                    }
                )
    return rows


def episodes_per_hour(results: dict[str, pathlib.Path]) -> dict[str, float | None]:
    """Each model's evaluation speed: its episodes (every task and variant) over eval's own seconds."""
    out: dict[str, float | None] = {}
    for label, path in results.items():
        doc = json.loads(path.read_text())
        seconds = float(doc.get("seconds") or 0)
        out[label] = round(3600 * len(doc["episodes"]) / seconds, 1) if seconds > 0 else None
    return out


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| model | task | variant | n | success % (Wilson 95%) | progress % | valid-action % "
        "| format-error % | recovery % (turns after an error) | repeated-error % | steps to recover | ends |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["success_ci95"] or (None, None)
        ends = ", ".join(f"{k} {v}" for k, v in r["terminations"].items())
        after = "–" if r["after_error_turns"] is None else r["after_error_turns"]
        lines.append(
            f"| {r['model']} | {r['task']} | {r['variant']} | {r['episodes']} | {_pct(r['success_rate'])} "
            f"[{_pct(lo)}–{_pct(hi)}] | {_pct(r['progress_rate'])} | {_pct(r['valid_action_rate'])} | "
            f"{_pct(r['format_error_rate'])} | {_pct(r['recovery_rate'])} ({after}) | "
            f"{_pct(r['repeated_error_rate'])} | {_num(r['mean_steps_to_recover'])} | {ends} |"
        )
    return "\n".join(lines)


def write_report(results: dict[str, pathlib.Path], out: pathlib.Path) -> int:
    """`analyze report` of every merged result, in this process (as the evaluations run)."""
    from agentrefine_jax.analyze.cli import main as analyze_main

    argv = ["report", *(f"{label}={path}" for label, path in results.items()), "--out", str(out / "report")]
    return analyze_main(argv)


# ------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see docs/mini_paper.md")
    p.add_argument("--base", required=True, help="the base model: a Hugging Face directory")
    p.add_argument("--out", required=True, help="where everything goes (new, empty, or a run to resume)")
    p.add_argument("--tokens", type=_positive, default=327_680, help="training token budget per setting")
    p.add_argument("--batch", type=_positive, default=4, help="sequences per train step")
    p.add_argument("--max-length", type=_positive, default=1024, help="token slots per (packed) sequence")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (cosine to 0, no warmup)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="params and compute")
    p.add_argument(
        "--settings",
        help=f"comma-separated subset of {','.join(SETTINGS)},{','.join(OPTIONAL_SETTINGS)},{ONPOLICY} "
        f"(default: every available one; sft_dpo only where the trainer has train.objective; {ONPOLICY} "
        f"needs {ONPOLICY_FROM})",
    )
    p.add_argument("--tasks", default=",".join(HELD_OUT), help="held-out built-in tasks (comma-separated)")
    p.add_argument("--episodes", type=_positive, default=16, help="episodes per held-out task")
    p.add_argument("--demo-episodes", type=_positive, default=64, help="unseen demo worlds per model")
    p.add_argument(
        "--perturbations",
        type=int,
        default=1,
        choices=range(0, 6),
        metavar="P",
        help="reworded action sets the unseen demo worlds are also played under (default 1; 0: none)",
    )
    p.add_argument(
        "--error-rate", type=float, default=0.25, help="the demo generator's mistake rate per step"
    )
    p.add_argument(
        "--onpolicy-episodes",
        type=_positive,
        default=256,
        help=f"training worlds the {ONPOLICY_FROM} model plays to make the {ONPOLICY} row's data",
    )
    p.add_argument("--max-steps", type=_positive, help="steps per episode (default: each task's)")
    p.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens per reply")
    # 32, not eval's general default of 8: more rows per decode step read each weight once for more
    # episodes. SmolLM2 base, 32 demo worlds x 6 turns, float32, AMD EPYC 2 cores beside a trainer:
    # eval's own 294 s at 8 in flight, 234 s at 16, 213 s at 32 (1.38x), every episode identical;
    # peak RSS 5.4, 7.9 and 9.2 GB (docs/mini_paper.md).
    p.add_argument("--eval-batch", type=_positive, default=32, help="episodes in flight per model call")
    # BabyAI's and PDDL's histories run to the model's context (8k tokens for SmolLM2), far longer than a
    # demo world's, and the KV cache grows with them (46 KB per token and episode for SmolLM2 in float32).
    # On a 24 GB host 16 in flight was OOM-killed (docs/mini_paper.md): this bounds those tasks without
    # slowing the demo worlds'.
    p.add_argument(
        "--task-batch",
        type=_positive,
        help="episodes in flight for the built-in tasks (--tasks; default: --eval-batch); a task's "
        "unfinished evaluation resumes only with the value it started with",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only",
        help=f"comma-separated models this invocation trains and evaluates ({BASE} or settings; default "
        "all): the run is the same, this is how much of it to do now (not recorded in mini_paper.json)",
    )
    p.add_argument(
        "--record",
        help="a small durable copy of the run (results, training records and logs, on-policy rows, summary) "
        "kept after every stage and restored into a new --out: to go on with a run on another machine",
    )
    p.add_argument(
        "--record-every",
        type=float_in(0, 86400, lo_open=True),
        default=600,
        metavar="S",
        help="also refresh --record every S seconds while a stage runs (an evaluation's journal: a machine "
        "lost without SIGTERM loses at most S seconds of its episodes; default 600)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no per-episode lines from eval")
    return p


def check_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The settings of the run and the models this invocation works on (`--only`, in the run's order),
    after every check that needs no model: one line each (MiniPaperError)."""
    args.tasks = tuple(t for t in args.tasks.split(",") if t and t != DEMO_TASK)  # demo_world always runs
    available = available_settings()
    settings = list(available) if not args.settings else [s for s in args.settings.split(",") if s]
    for s in settings:
        if s not in available:
            extra = " (needs train.objective in agentrefine_jax.config)" if s in OPTIONAL_SETTINGS else ""
            raise MiniPaperError(f"--settings: unknown or unavailable setting {s!r}{extra}; "
                                 f"choose from {', '.join(available)}")  # fmt: skip
    if ONPOLICY in settings and ONPOLICY_FROM not in settings:
        raise MiniPaperError(
            f"--settings: {ONPOLICY} needs {ONPOLICY_FROM} (its data is {ONPOLICY_FROM}'s own mistakes)"
        )
    if not 0 <= args.error_rate < 1:
        raise MiniPaperError(f"--error-rate must be in [0, 1), got {args.error_rate}")
    from agentrefine_jax.eval.registry import lookup

    for t in args.tasks:
        try:
            lookup(t, "builtin")
        except ValueError as e:
            raise MiniPaperError(f"--tasks: {e}") from None
    if not pathlib.Path(args.base, "config.json").is_file():
        raise MiniPaperError(f"--base {args.base}: no config.json (expected a Hugging Face model directory)")
    model_settings(args.base)  # a directory the trainer cannot start from fails here, not in a subprocess
    models = [BASE, *settings]
    chosen = models if not args.only else [m for m in args.only.split(",") if m]
    unknown = [m for m in chosen if m not in models]
    if unknown:
        raise MiniPaperError(
            f"--only: {', '.join(unknown)} not among this run's models ({', '.join(models)})"
        )
    return settings, [m for m in models if m in chosen]


def onpolicy_data(
    args: argparse.Namespace,
    out: pathlib.Path,
    source: Callable[[], str],
    demo: dict[str, Any],
    log: Any,
    sigterm: _Sigterm,
) -> dict[str, Any]:
    """The onpolicy row's data: the trained agentrefine model (`source()`, its HF export, called only when
    the rows are not collected yet) plays `--onpolicy-episodes` training worlds (seeds 0.., the worlds the
    demo data starts with: only who made the mistakes differs), then its rows are mixed with demo rows to
    the size every row's data has."""
    rows_file = out / "data" / "onpolicy.jsonl"
    if rows_file.exists():
        log(f"{ONPOLICY}: collected earlier ({rows_file}), skipped")
    else:
        argv = [
            "--checkpoint",
            source(),
            "--tasks",
            DEMO_TASK,
            "--episodes",
            str(args.onpolicy_episodes),
        ]
        argv += [
            "--seed",
            "0",
            "--batch-size",
            str(args.eval_batch),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--dtype",
            args.dtype,
        ]
        argv += ["--workdir", str(out / "work" / ONPOLICY)] + (["-q"] if args.quiet else [])
        if args.max_steps:
            argv += ["--max-steps", str(args.max_steps)]
        t0 = time.perf_counter()
        rc = _mini_data.collect_onpolicy(argv, rows_file, log)
        sigterm.check("the on-policy collection", rc)
        if rc != 0:
            raise RuntimeError(f"{ONPOLICY}: the on-policy collection exited {rc}")
        log(f"{ONPOLICY}: collected in {time.perf_counter() - t0:.1f}s")
    try:
        return _mini_data.onpolicy_mix(out, args.base, args.tokens, args.max_length, demo, log)
    except _mini_data.DataError as e:
        raise RuntimeError(f"{ONPOLICY}: {e}") from None


def eval_files(args: argparse.Namespace, label: str, out: pathlib.Path) -> list[pathlib.Path]:
    """One eval result per task for model `label`: `eval_model` writes them."""
    return [out / "eval" / label / f"{task}.json" for task in (DEMO_TASK, *args.tasks)]


class Stages:
    """The run's stages for one invocation, in order: per model, its training (a setting; the onpolicy
    row after its data) and then its evaluation, so that work stopped between models loses nothing
    that a record (--record) does not keep. A model's checkpoint is made only where still needed: its
    evaluation is unfinished, or it is agentrefine and the onpolicy row's rows are not collected."""

    def __init__(
        self,
        args: argparse.Namespace,
        out: pathlib.Path,
        steps: int,
        log: Any,
        sigterm: _Sigterm,
        keep: Callable[[], None],
    ) -> None:
        self.args, self.out, self.steps, self.log, self.sigterm = args, out, steps, log, sigterm
        self.keep = keep  # the record's save, after every stage that made something
        self.data: dict[str, Any] = {}
        self.trained: dict[str, dict[str, Any]] = {}

    def demo(self) -> dict[str, Any]:
        """The demo data, made on first use (an invocation that only evaluates never needs it)."""
        if "demo" not in self.data:
            try:
                a = self.args
                self.data["demo"] = _mini_data.demo_data(
                    self.out, a.base, a.tokens, a.max_length, a.error_rate, self.log
                )
            except _mini_data.DataError as e:
                raise MiniPaperError(f"the demo data: {e}") from None
        return self.data["demo"]

    def train(self, setting: str, *, need_checkpoint: bool) -> dict[str, Any]:
        """`setting`'s run record, training it (and making its data) where needed."""
        run_dir = self.out / "runs" / setting
        # A record of the training is enough unless the checkpoint itself is needed and absent. A run
        # directory holding fewer steps is a training again that was stopped part way (the record's
        # `done` came from another machine): it resumes, it is not the model (stop 65 evaluated such
        # a run's step 47 of 80 before this check).
        usable = final_step(run_dir) == self.steps or not need_checkpoint
        if setting in self.trained and usable:
            return self.trained[setting]
        done = run_dir.parent / f"{setting}.done.json"
        if done.exists() and usable:
            self.log(f"{setting}: trained earlier ({done}), skipped")
            self.trained[setting] = json.loads(done.read_text()) | {"run_dir": str(run_dir)}
            return self.trained[setting]
        if done.exists():
            # Its record came from another machine (--record) without the checkpoint, which is still
            # needed: the trainer is deterministic, so training again gives the same model (on the same
            # CPU kind; its log and record then say so twice).
            self.log(f"{setting}: trained earlier on another machine; its checkpoint is not here, so again")
        if setting == ONPOLICY:
            # The collection plays agentrefine's HF export (trained here, again if need be: deterministic),
            # as its evaluation does: a collection stopped on one machine resumes on the next (its journal
            # is in the record, bound to the parameters' content).
            source = lambda: self.export(ONPOLICY_FROM)[0]  # noqa: E731
            demo = self.demo()
            self.data[ONPOLICY] = onpolicy_data(self.args, self.out, source, demo, self.log, self.sigterm)
            self.keep()
            files = self.data[ONPOLICY]["files"]
        else:
            files = [self.demo()["file"]]
        args, out = self.args, self.out
        self.trained[setting] = train_setting(args, setting, out, self.steps, files, self.log, self.sigterm)
        self.keep()
        return self.trained[setting]

    def model(self, label: str) -> pathlib.Path:
        """Train (a setting) and evaluate model `label`: its merged result."""
        run_config = None
        if label == BASE:
            checkpoint = str(pathlib.Path(self.args.base).resolve())
        elif all(f.exists() for f in eval_files(self.args, label, self.out)):
            checkpoint = self.train(label, need_checkpoint=False)["run_dir"]  # nothing left to play
        else:
            checkpoint, run_config = self.export(label)
        a = self.args
        return eval_model(a, label, checkpoint, self.out, self.log, self.sigterm, self.keep, run_config)

    def export(self, setting: str) -> tuple[str, dict[str, Any]]:
        """`setting`'s final step as an HF directory (OUT/hf/SETTING, trained and exported where needed) and
        its training config. What plays a tuned model: an evaluation's or collection's journal is then bound
        to the parameters' content, so on another machine the same model, trained again, resumes it."""
        from agentrefine_jax.checkpoint import read_meta, resolve_checkpoint

        root, step = resolve_checkpoint(self.train(setting, need_checkpoint=True)["run_dir"])
        hf = self.out / "hf" / setting
        log = lambda msg: self.log(f"{setting}: {msg}")  # noqa: E731
        try:
            exported = _mini_data.export_hf(pathlib.Path(root) / str(step), hf, log)
        except RuntimeError as e:
            raise RuntimeError(f"{setting}: {e}") from None
        return str(exported), read_meta(root, step).config


def verdict(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The plain sentences the README's miniature asks for, computed from the rows: per task and variant,
    the tuned rows whose success interval lies wholly above base's; and recovery, AgentRefine vs the rest."""
    success, recovery = [], []
    for task, variant in sorted({(r["task"], r["variant"]) for r in rows}):
        cell = {r["model"]: r for r in rows if (r["task"], r["variant"]) == (task, variant)}
        base = cell.get(BASE)
        if base is not None and base["success_ci95"] is not None:
            above = [
                m
                for m, r in cell.items()
                if m != BASE and r["success_ci95"] and r["success_ci95"][0] > base["success_ci95"][1]
            ]
            says = (
                f"above base: {', '.join(above)}"
                if above
                else "no tuned row's success interval lies above base's"
            )
            success.append(f"{task}/{variant}: {says}")
        parts = []
        for m, r in cell.items():
            n, rate = r["after_error_turns"], r["recovery_rate"]
            ci = wilson_interval(round(rate * n), n) if n and rate is not None else None
            parts.append(f"{m} {_pct(rate)}" + (f" [{_pct(ci[0])}–{_pct(ci[1])}]" if ci else ""))
        recovery.append(f"recovery {task}/{variant} (turns after an error, Wilson 95%): " + "; ".join(parts))
    return success + recovery


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    settings, only = check_args(args)
    out = pathlib.Path(args.out).absolute()
    steps = train_steps(args.tokens, args.batch, args.max_length)
    manifest = _manifest(args, settings, steps)
    record = pathlib.Path(args.record).absolute() if args.record else None
    if record is not None:
        try:
            _record.prepare(record, manifest, tool=TOOL, what="mini-paper")
        except _outdir.OutDirError as e:
            raise MiniPaperError(str(e)) from None
    prepare_out(out, manifest)

    def log(msg: str) -> None:
        print(f"[{TOOL}] {msg}", flush=True)

    def save_record() -> None:
        if record is not None:
            _record.save(out, record, RECORD_FILES, transient=JOURNALS)

    # After every stage (a model's training, each task's evaluation, the on-policy data) and every
    # model, and every --record-every seconds while one runs: a machine lost later loses nothing a
    # finished stage made, and at most that long of an unfinished evaluation's journal.
    keep = _record.Refresher(save_record, args.record_every)

    if record is not None:
        _record.restore(record, out, RESTORED_FILES, log)
    info = machine()
    log(_machine.header(info))
    log(
        f"machine: {info['cpu_count']} CPUs ({info['cpu_model']}), {info['device']}; budget {args.tokens} "
        f"tokens = {steps} steps x {args.batch} x {args.max_length}"
    )
    models = [BASE, *settings]
    if len(only) < len(models):
        log(f"this invocation: {', '.join(only)} (--only); the rest as far as earlier work has them")
    failures: list[str] = []
    stages: Stages | None = None
    try:
        with _Sigterm() as sigterm, keep if record is not None else contextlib.nullcontext():
            stages = Stages(args, out, steps, log, sigterm, keep)
            for label in only:
                try:
                    stages.model(label)
                except RuntimeError as e:  # one model failing (e.g. a training error) does not lose the rest
                    log(f"error: {e}")
                    failures.append(label)
                finally:
                    keep()
                sigterm.check(f"{label}'s evaluation")
    except Stopped as e:
        log(str(e))
        return TERMINATED
    # Every model whose evaluation is complete is reported, whichever invocation (or machine) made it.
    results: dict[str, pathlib.Path] = {}
    pending = []
    for label in models:
        if label not in failures and all(f.exists() for f in eval_files(args, label, out)):
            results[label] = merged_result(args, label, out, log)
        elif label not in failures:
            pending.append(label)
    if pending:
        log(f"not yet evaluated: {', '.join(pending)} (run them with --only; see docs/mini_paper.md)")
    trained = {}
    for s in settings:
        done = out / "runs" / f"{s}.done.json"
        if done.exists():
            trained[s] = json.loads(done.read_text())
    data = dict(stages.data) if stages is not None else {}
    for name, path in (("demo", "train.done.json"), (ONPOLICY, "onpolicy_mix.done.json")):
        if name not in data and (out / "data" / path).exists():
            data[name] = json.loads((out / "data" / path).read_text())
    rows = summary_rows(results)
    table = format_summary(rows)
    speed = episodes_per_hour(results)
    sentences = verdict(rows)
    rc_report = write_report(results, out) if results else 1
    seconds = round(time.perf_counter() - t0, 1)
    doc = {
        "command": " ".join(sys.argv),
        "machine": info,
        "stage_machines": stage_machines(out),
        "seconds_this_invocation": seconds,
        "train_seconds": {s: r.get("train_seconds") for s, r in trained.items()},
        "epochs": {s: r.get("epochs") for s, r in trained.items()},
        "eval_episodes_per_hour": speed,
        "data": data,
        "steps": steps,
        "tokens": args.tokens,
        "settings": settings,
        "only": only,
        "failures": failures,
        "pending": pending,
        "rows": rows,
        "verdict": sentences,
    }
    write_json(out / "summary.json", doc)
    speeds = ", ".join(f"{m} {v}" for m, v in speed.items())
    demo = data.get("demo") or {"worlds": "?", "tokens": "?"}
    write_text(
        out / "summary.md",
        f"# Mini paper\n\nbase `{args.base}`; {args.tokens} tokens per setting "
        f"({steps} steps x {args.batch} x {args.max_length}); demo data {demo['worlds']} worlds, "
        f"{demo['tokens']} tokens; machine: {info['cpu_count']} CPUs "
        f"({info['cpu_model']}), {info['device']}; this invocation {seconds} s; evaluation episodes/hour: "
        f"{speeds}.\n\n{table}\n\n" + "\n".join(f"- {x}" for x in sentences) + "\n",
    )
    print(table)
    for x in sentences:
        log(x)
    where = out / "report" / "report.md"
    log(f"done in {seconds}s on {info['cpu_count']} CPUs ({info['cpu_model']}); tables: {where}")
    if failures:
        log(f"failed: {', '.join(failures)} (rerun the same command to retry them)")
    keep()
    return 1 if failures or rc_report != 0 else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except MiniPaperError as e:
        print(f"[{TOOL}] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    host_memory.bound_heap()  # eval runs in this process: its heap gives freed caches back (eval's entry)
    redeliver_swallowed_signals()  # eval, run in-process, stops by raising from its SIGTERM handler
    leave(main())
