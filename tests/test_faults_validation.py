"""Values that used to be accepted silently (issue 23, item 5) are refused in one line with exit 2.

Config values are refused at load (the one validation table, config_checks.py), before any data or device
work; CLI sizes and tolerances by their flag's type; empty data and an output that is the input before
anything is written. In-process `main(argv)` calls, as tests/test_cli_errors.py, except where the process is
the point (a LoRA rank that would be OOM-killed minutes later must fail at start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_cli_errors import _assert_one_line_error as assert_one_line
from test_cli_errors import run_main
from test_faults_input import GOOD


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["train.lora.base_dtype=int8"], "train.lora.base_dtype=int8: needs train.lora.rank >= 1"),
        (["train.lora.rank=33"], "train.lora.rank=33: must be <= 32"),  # tiny: k/v project 64 -> 32
        (["train.lora.rank=65", "train.lora.targets=gate,up"], "train.lora.rank=65: must be <= 64"),
        (["data.max_length=2049"], "data.max_length=2049: must be <= model.max_position_embeddings=2048"),
    ],
)
def test_config_refuses_values_that_used_to_be_ignored(overrides, needle, capsys):
    argv = ["--config", "tiny", "--print-config"]
    for o in overrides:
        argv += ["--set", o]
    res = run_main("train", argv, capsys)
    assert_one_line(res, "train", needle)
    assert res.stdout == ""


def test_config_bounds_admit_the_largest_useful_values(capsys):
    from agentrefine_jax.config import load_config

    cfg = load_config("tiny", ["train.lora.rank=32", "data.max_length=2048"])
    assert (cfg.train.lora.rank, cfg.data.max_length) == (32, 2048)
    load_config("tiny", ["train.lora.rank=64", "train.lora.targets=gate,up"])  # min(64, 192)


def test_train_refuses_a_huge_lora_rank_at_start_up_not_after_minutes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny"]
    cmd += ["--set", f"train.run_dir={run}", "--set", "train.lora.rank=100000"]
    t0 = time.monotonic()
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    assert_one_line(res, "train", "train.lora.rank=100000: must be <= 32")
    assert time.monotonic() - t0 < 120  # start-up only: no data, no parameters were built
    assert not run.exists()


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--seq-len", "-5"], "argument --seq-len: must be >= 1"),
        (["--seq-len", "0"], "argument --seq-len: must be >= 1"),
        (["--global-batch", "0"], "argument --global-batch: must be >= 1"),
        (["--micro-batch", "0"], "argument --micro-batch: must be >= 1"),
    ],
)
def test_plan_refuses_sizes_below_one_instead_of_using_defaults(flags, needle, capsys):
    res = run_main("plan", ["--config", "tiny", "--mesh", "fsdp=1", *flags], capsys)
    assert_one_line(res, "plan", needle)
    assert res.stdout == ""


def test_planner_library_refuses_zero_sizes():
    from agentrefine_jax.config import load_config
    from agentrefine_jax.train import planner

    cfg = load_config("tiny")
    mesh = planner.parse_mesh("fsdp=1", {"data": 1, "fsdp": 1, "tensor": 1}, None)
    with pytest.raises(planner.PlanError, match="seq len must be >= 1, got 0"):
        planner.plan(cfg, mesh, "v5p", seq_len=0)
    with pytest.raises(planner.PlanError, match="global batch must be >= 1, got 0"):
        planner.plan(cfg, mesh, "v5p", global_batch=0)


@pytest.mark.parametrize(
    "flag,value", [("--atol", "-1"), ("--kl-tol", "-0.5"), ("--atol", "nan"), ("--kl-tol", "x")]
)
def test_export_verify_refuses_a_bad_tolerance(flag, value, tmp_path, capsys):
    argv = ["verify", "--checkpoint", str(tmp_path), "--hf", str(tmp_path), flag, value]
    res = run_main("export", argv, capsys)
    assert_one_line(res, "export", f"argument {flag}:")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
@pytest.mark.parametrize("command", ["stats", "dump"])
def test_data_refuses_an_input_without_rows(command, content, tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    out = tmp_path / "out.jsonl"
    argv = [command, "--input", str(path)] + (["--out", str(out)] if command == "dump" else [])
    res = run_main("data", argv, capsys)
    assert_one_line(res, "data", f"no train records in {path} (0 rows)")
    assert res.stdout == "" and not out.exists()


def test_data_dump_refuses_to_write_over_its_input(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    before = path.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    for out in (path, link):  # the file itself, and the same file under another name
        res = run_main("data", ["dump", "--input", str(path), "--out", str(out)], capsys)
        assert_one_line(res, "data", f"--out {out} is the input file {path}")
        assert path.read_bytes() == before
