"""The mini paper's training data: enough demo trajectories that no setting's budget repeats a row, and
the `onpolicy` row's data (the `agentrefine` model's own mistakes on training worlds, refined by the
expert, mixed into demo trajectories to the same size).

Everything is written under OUT/data/ through `outputs` (temporary sibling, then rename) and recorded
in a `*.done.json` beside it, so a resumed mini paper reuses it instead of making it again.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pathlib
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from agentrefine_jax.data.demo_world import write_split
from agentrefine_jax.outputs import open_atomic, write_json, write_text

# Data tokens per budget token: packing leaves ~2-13% of a row's slots empty, so data of at least
# 1.2x the budget in tokens gives more packed rows than the run takes; every run records its epochs
# (steps / steps per epoch) to show it stayed under one.
MARGIN = 1.2
FIRST_GUESS_TOKENS_PER_ROW = 400  # SmolLM2 on the demo grammar: 440-500 (docs/mini_paper.md)


REPO = pathlib.Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment for this script's `python -m agentrefine_jax...` subprocesses: the checkout first on
    their path, so a checkout run without an install works as the script itself does."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p)}


def run_tool(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
    """A tool's CLI `main(argv)` run in this process: (exit code, its stdout, its stderr). In this process,
    not a `python -m` subprocess: each of those pays ~3-5 s of imports and start-up before its work (the
    export or token count of a small model is about as long again), and this script already imports the
    same tools for its evaluations."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = int(main(argv) or 0)
    return rc, out.getvalue(), err.getvalue()


def export_hf(step_dir: pathlib.Path, hf: pathlib.Path, log: Callable[[str], None]) -> pathlib.Path:
    """Checkpoint step `step_dir` as a Hugging Face directory `hf` (`export to-hf`, float32 kept), written
    to the sibling `HF.partial` and renamed into place once whole; kept when already there. Evaluating the
    export rather than the step binds an evaluation's journal to the parameters' content (an HF directory's
    identity, eval/model_identity.py), not to the checkpoint's files, which differ between two saves of the
    same parameters (Orbax names its data files at random): a model trained again on another machine
    resumes the journal its first training began. The step it came from is kept in the sibling
    `HF.source`: an export of any other step (or of an unknown one) is ours, and is replaced. RuntimeError
    on failure."""
    source = hf.with_name(hf.name + ".source")
    if (hf / "config.json").is_file() and source.is_file() and source.read_text() == str(step_dir):
        log(f"exported earlier ({hf}), skipped")
        return hf
    from agentrefine_jax.export.cli import main as export_main

    partial = hf.with_name(hf.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # ours: a killed export's leftovers
    argv = ["to-hf", "--checkpoint", str(step_dir), "--out", str(partial), "--mesh", "none"]
    log(f"exporting {step_dir} to {hf}")
    rc, out, err = run_tool(export_main, argv)
    if rc != 0:
        tail = (err or out).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{step_dir}: export to-hf exited {rc}: {tail[0]}")
    hf.parent.mkdir(parents=True, exist_ok=True)
    stale = hf.with_name(hf.name + ".stale")
    if hf.exists():  # an export of another step, made by this script: out of the way, then removed
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(hf, stale)
    os.replace(partial, hf)
    write_text(source, str(step_dir))
    shutil.rmtree(stale, ignore_errors=True)
    return hf


class DataError(Exception):
    """A data stage failed: one line."""


def count_tokens(files: Sequence[pathlib.Path], base: str, max_length: int, *, drop_refinement: bool) -> dict:
    """`data stats --json` of `files` as the trainer tokenizes them (the base's tokenizer and template,
    its max length): the same code path, so the counts are the trainer's."""
    from agentrefine_jax.data.cli import main as data_main

    argv = ["stats", "--tokenizer", base, "--max-length", str(max_length), "--json", "-q"]
    argv += [a for f in files for a in ("-i", str(f))]
    if drop_refinement:
        argv.append("--drop-refinement-data")
    rc, out, err = run_tool(data_main, argv)
    if rc != 0:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"data stats on {', '.join(map(str, files))} exited {rc}: {tail}")
    stats = json.loads(out)
    return {"examples": int(stats["examples"]), "tokens": int(stats["tokens"])}


def demo_data(
    out: pathlib.Path, base: str, budget: int, max_length: int, error_rate: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """OUT/data/train.jsonl: the demo generator's training worlds 0..N-1, N grown until the smallest
    setting's view of them (refinement data dropped) holds MARGIN x `budget` tokens."""
    path, done = out / "data" / "train.jsonl", out / "data" / "train.done.json"
    if done.exists():
        return json.loads(done.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    n = max(1, math.ceil(MARGIN * budget / FIRST_GUESS_TOKENS_PER_ROW))
    while True:
        write_split(path, range(n), error_rate)
        small = count_tokens([path], base, max_length, drop_refinement=True)
        if small["tokens"] >= MARGIN * budget:
            break
        log(f"data: {n} demo worlds hold {small['tokens']} tokens without refinement data; growing")
        n = math.ceil(n * MARGIN * budget / max(1, small["tokens"])) + 8
    full = count_tokens([path], base, max_length, drop_refinement=False)
    record = {
        "file": str(path),
        "worlds": n,
        "seeds": [0, n - 1],
        "error_rate": error_rate,
        "tokens": full["tokens"],
        "tokens_without_refinement_data": small["tokens"],
        "tokens_per_row": round(full["tokens"] / max(1, full["examples"]), 1),
    }
    write_json(done, record)
    log(f"data: {n} demo worlds, {full['tokens']} tokens ({small['tokens']} without refinement data)")
    return record


def collect_onpolicy(argv: list[str], out_file: pathlib.Path, log: Callable[[str], None]) -> int:
    """`python -m agentrefine_jax.eval onpolicy ARGV --out OUT_FILE` in this process; its exit code."""
    from agentrefine_jax.eval.cli import main as eval_main

    log(f"onpolicy: collecting ({' '.join(argv)})")
    return eval_main(["onpolicy", *argv, "--out", str(out_file)])


def onpolicy_mix(
    out: pathlib.Path,
    base: str,
    budget: int,
    max_length: int,
    demo: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The onpolicy row's files: OUT/data/onpolicy.jsonl (the on-policy rows) and OUT/data/demo_head.jsonl
    (the first K demo rows), K chosen so the two hold
    MARGIN x `budget` tokens together, as every other row's data: the on-policy rows take the place of
    demo rows, the budget still repeats no row, and nearly all on-policy rows are drawn."""
    head = out / "data" / "demo_head.jsonl"
    done = out / "data" / "onpolicy_mix.done.json"
    if done.exists():
        return json.loads(done.read_text())
    rows_file = out / "data" / "onpolicy.jsonl"
    rows = [line for line in rows_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise DataError(
            f"{rows_file}: the agentrefine model made no rejected action on its training worlds, so there is "
            "no on-policy data to mix in (the onpolicy row cannot differ from agentrefine)"
        )
    on = count_tokens([rows_file], base, max_length, drop_refinement=False)
    per_row = float(demo["tokens_per_row"])
    keep = max(0, min(int(demo["worlds"]), math.ceil((MARGIN * budget - on["tokens"]) / per_row)))
    demo_lines = pathlib.Path(demo["file"]).read_text(encoding="utf-8").splitlines()[:keep]
    with open_atomic(head, newline="\n") as f:
        f.write("".join(line + "\n" for line in demo_lines))
    record = {
        "files": [str(rows_file), str(head)],
        "onpolicy_rows": len(rows),
        "onpolicy_tokens": on["tokens"],
        "demo_rows": keep,
        "demo_tokens_estimate": round(keep * per_row),
        "onpolicy_token_share": round(on["tokens"] / max(1.0, on["tokens"] + keep * per_row), 4),
    }
    write_json(done, record)
    log(
        f"onpolicy: {len(rows)} on-policy rows ({on['tokens']} tokens) + the first {keep} demo rows "
        f"(on-policy share {100 * record['onpolicy_token_share']:.1f}% of the tokens)"
    )
    return record
