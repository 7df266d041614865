"""benchmarks/grpo_real.py end to end on a tiny random ChatML Llama (test_mini_paper's fixture) started
from a training run directory: its latest checkpoint is pinned and exported to an HF directory, evaluated
on unseen demo worlds, GRPO runs two phases on training worlds, the result is evaluated; the summary's
numbers are the eval results' and the run's metrics rows, the reward curve is a PNG; a rerun skips every
stage, and changed settings on the same --out are refused with one line."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

from test_mini_paper import base_dir  # noqa: F401 - the tiny ChatML Llama HF directory fixture

from agentrefine_jax.analyze.tables import wilson_interval
from agentrefine_jax.checkpoint import read_meta
from agentrefine_jax.config import load_config, to_dict
from agentrefine_jax.outputs import json_dumps

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "grpo_real.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--phases", "2", "--worlds-per-phase", "1", "--group-size", "2", "--updates-per-phase", "1",
         "--micro-batch", "1", "--max-turns", "1", "--max-new-tokens", "4", "--max-length", "1024",
         "--eval-episodes", "2", "--eval-max-steps", "1", "--eval-max-new-tokens", "4", "--eval-batch", "2",
         "-q"]  # fmt: skip


def _env() -> dict[str, str]:
    # As a user runs it: one CPU device, not the 8 the test session's XLA_FLAGS fake for sharding tests.
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _run(start: pathlib.Path, out: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--start", str(start), "--out", str(out), *SMALL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out.parent, env=_env())


def test_grpo_real_end_to_end_and_resume(base_dir, tmp_path):  # noqa: F811 - the imported fixture
    # --start as a training run directory is laid out: the trainer's config.json (not an HF one) beside
    # checkpoints/ holding step 0 of the tiny model (`export from-hf`): the checkpoint is what is pinned.
    ckpt = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrefine_jax.export", "from-hf", "--hf", str(base_dir),
           "--out", str(ckpt / "checkpoints"), "--mesh", "none", "--template", "hf"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-2000:]
    (ckpt / "config.json").write_text(json_dumps(to_dict(load_config("tiny", [f"train.run_dir={ckpt}"]))))
    out = tmp_path / "grpo"
    r = _run(ckpt, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    pinned = json.loads((out / "start.json").read_text())
    dtype = read_meta(ckpt / "checkpoints", 0).model.dtype
    assert pinned == {
        "kind": "checkpoint", "path": str(ckpt), "root": str(ckpt / "checkpoints"), "step": 0, "dtype": dtype,
    }  # fmt: skip
    assert (out / "start_hf" / "config.json").is_file() and not (out / "start_hf.partial").exists()
    png = (out / "reward_curve.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 5000

    summary = json.loads((out / "summary.json").read_text())
    for key in ("before", "after"):
        doc = json.loads((out / "eval" / f"{key}.json").read_text())
        episodes = doc["episodes"]
        assert len(episodes) == 2 and all(e["task"] == "demo_world" for e in episodes)
        k = sum(bool(e["success"]) for e in episodes)
        s = summary[key]
        assert (s["episodes"], s["successes"]) == (2, k)
        assert s["success_ci95"] == list(wilson_interval(k, 2))
        assert s["eval_seconds"] == doc["seconds"]
    # Before and after are loaded alike, as checkpoints: the pinned step and the GRPO run's last one; the
    # GRPO run itself starts from the pinned step's HF export.
    agents = {x: json.loads((out / "eval" / f"{x}.json").read_text())["agent"] for x in ("before", "after")}
    assert agents == {
        "before": f"checkpoint:{ckpt}/checkpoints/0",
        "after": f"checkpoint:{out}/rl/checkpoints/2",
    }
    rl_config = json.loads((out / "rl" / "config.json").read_text())
    assert rl_config["train"]["init_from_hf"] == str(out / "start_hf")
    assert summary["compute_dtypes"] == {"before": "float32", "after": "float32"}  # eval's --dtype, both

    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    phase_rows = [x for x in rows if "phase" in x]
    assert [p["phase"] for p in summary["phases"]] == [0, 1] == [x["phase"] for x in phase_rows]
    for got, row in zip(summary["phases"], phase_rows, strict=True):
        for k in ("reward_mean", "reward_std", "success_rate", "sampled_tokens", "rollout_seconds"):
            assert got[k] == row[k]
        (step,) = [x for x in rows if "phase" not in x and x["step"] == row["step"]]  # 1 update per phase
        assert got["train_tokens"] == step["tokens"] > 0
    t = summary["throughput"]["all_phases"]
    sampled = sum(x["sampled_tokens"] for x in phase_rows)
    assert sampled > 0 and math.isclose(
        t["rollout_tokens_per_sec"], sampled / sum(x["rollout_seconds"] for x in phase_rows)
    )
    steps = {x["step"]: x for x in rows if "phase" not in x}
    train_s = sum(steps[p["step"]]["tokens"] / p["train_tokens_per_sec"] for p in phase_rows)
    assert math.isclose(t["train_seconds"], train_s)
    med = summary["throughput"]["median_phase_after_0"]  # one later phase: its own rates
    assert med["phases"] == 1 and med["rollout_tokens_per_sec"] == phase_rows[1]["rollout_tokens_per_sec"]
    assert med["train_tokens_per_sec"] == phase_rows[1]["train_tokens_per_sec"]
    assert summary["verdict"].startswith(("GRPO raised", "GRPO lowered", "No difference shown"))
    md = (out / "summary.md").read_text()
    assert "| start (before) | 2 |" in md and "| GRPO (after) | 2 |" in md and summary["verdict"] in md

    # A rerun skips every stage (nothing re-evaluated, no GRPO subprocess) and writes the same numbers.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "eval" / "before.json", out / "eval" / "after.json")}
    r = _run(ckpt, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for stage in ("start: exported earlier", "before: evaluated earlier", "GRPO: finished earlier",
                  "after: evaluated earlier"):  # fmt: skip
        assert stage in r.stdout, r.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    again = json.loads((out / "summary.json").read_text())
    assert again["before"] == summary["before"] and again["phases"] == summary["phases"]

    # Other settings on the same --out: one line, exit 2, nothing touched.
    r = _run(ckpt, out, "--lr", "1e-3")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "lr" in r.stderr, r.stderr
    # A --start that is neither a checkpoint nor an HF directory: one line, and no --out made.
    r = _run(out / "eval", tmp_path / "never")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "neither" in r.stderr, r.stderr
    assert not (tmp_path / "never").exists()


def test_grpo_real_from_an_hf_directory(base_dir, tmp_path):  # noqa: F811 - the imported fixture
    """An HF --start is used as it is, and the GRPO result is evaluated as its HF export; both compute in
    float32 (an HF directory would default to bfloat16)."""
    out = tmp_path / "grpo_hf"
    r = _run(base_dir, out, "--phases", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((out / "start.json").read_text()) == {"kind": "hf", "path": str(base_dir)}
    assert not (out / "start_hf").exists()
    agents = {x: json.loads((out / "eval" / f"{x}.json").read_text())["agent"] for x in ("before", "after")}
    assert agents == {"before": f"checkpoint:{base_dir}", "after": f"checkpoint:{out}/rl/hf"}
    assert (out / "rl" / "hf" / "config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["compute_dtypes"] == {
        "before": "float32",
        "after": "float32",
    }


def test_the_median_phase_is_not_moved_by_one_paused_phase():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import grpo_real

    def phase(i: int, rollout_s: float, train_s: float) -> dict:
        return {"phase": i, "sampled_tokens": 1000, "rollout_seconds": rollout_s,
                "rollout_tokens_per_sec": 1000 / rollout_s, "train_tokens": 2000.0, "train_seconds": train_s,
                "train_tokens_per_sec": 2000 / train_s}  # fmt: skip

    # Phase 0 compiles; phase 2's updates were paused for a while (20x the others' time).
    phases = [phase(0, 50, 100), phase(1, 10, 20), phase(2, 10, 400), phase(3, 12, 25)]
    t = grpo_real.throughput(phases)
    median = {"rollout_tokens_per_sec": 1000 / 10, "train_tokens_per_sec": 2000 / 25, "phases": 3}
    assert t["median_phase_after_0"] == median
    # The time-weighted total of the same phases is dragged far below every unpaused phase's rate.
    assert t["after_phase_0"]["train_tokens_per_sec"] == 6000 / 445 < 2000 / 25
    assert grpo_real.throughput(phases[:1])["median_phase_after_0"] is None
