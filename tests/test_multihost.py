"""Multi-host training on one machine: two `jax.distributed` CPU processes (one device each)
must train exactly like one process with two devices, and resume from their own Orbax
multi-process checkpoint.

Both runs go through the real CLI (`python -m agentrefine_jax.train`). Shuffling and
packing are off so that the 2-process global batch (process p reads records p, p+2, ...)
holds the same rows as the 1-process one, only in another order; the loss is a token sum
over the whole global batch, so the per-step losses must agree to float rounding.
The learning rate is constant so that stopping at step 2 and resuming to step 4 follows
the same schedule as running 4 steps straight.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DEMO_TRAIN = REPO / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
STEPS = 4
TIMEOUT = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _args(train_file: pathlib.Path, run_dir: pathlib.Path, max_steps: int, export: str = "none") -> list[str]:
    sets = {
        "data.train_files": str(train_file),
        "data.eval_files": "",
        "data.max_length": "256",
        "data.pack": "false",
        "data.shuffle": "false",
        "optim.schedule": "constant",
        "train.global_batch_size": "2",
        "train.max_steps": str(max_steps),
        "train.eval_every": "0",
        "train.checkpoint_every": "2",
        "train.loss_chunk_size": "64",
        "train.run_dir": str(run_dir),
        "train.export_hf_at_end": export,
    }
    out = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny"]
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


_LOGS: dict[int, pathlib.Path] = {}


def _popen(cmd: list[str], devices: int, log: pathlib.Path) -> subprocess.Popen:
    # Output goes to a file: a pipe nobody reads while polling could fill up and block.
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=_env(devices), cwd=log.parent, stdout=f, stderr=subprocess.STDOUT, text=True
        )
    _LOGS[proc.pid] = log
    return proc


def _start_two(
    train_file: pathlib.Path, run_dir: pathlib.Path, max_steps: int, export: str = "none"
) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for pid in range(2):
        cmd = _args(train_file, run_dir, max_steps, export) + [
            "--coordinator-address",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(pid),
        ]
        procs.append(_popen(cmd, 1, run_dir.parent / f"{run_dir.name}-{max_steps}-p{pid}.log"))
    return procs


def _finish(procs: list[subprocess.Popen], what: str) -> list[str]:
    """Wait for all; if one fails, stop the others at once (they would block in a collective)."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outs = [_LOGS[p.pid].read_text() for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"{what} process {i} exited {p.returncode}:\n{out[-4000:]}"
    return outs


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT)
def test_two_processes_match_two_devices_and_resume(tmp_path: pathlib.Path) -> None:
    # A small slice of the demo data keeps tokenisation cheap; every record is valid at 256.
    train_file = tmp_path / "train.jsonl"
    lines = DEMO_TRAIN.read_text().splitlines()[: 2 * STEPS + 4]
    train_file.write_text("\n".join(lines) + "\n")

    ref_dir, multi_dir = tmp_path / "one_process", tmp_path / "two_processes"
    # Reference (1 process, 2 devices) and the first half of the 2-process run, concurrently.
    ref = _popen(_args(train_file, ref_dir, STEPS), 2, tmp_path / "one_process.log")
    first = _start_two(train_file, multi_dir, max_steps=2)
    first_out = _finish(first, "2-process run (steps 1-2)")
    (ref_out,) = _finish([ref], "1-process reference")

    assert "over 2 devices (1 processes)" in ref_out
    assert "over 2 devices (2 processes)" in first_out[0]
    # Only process 0 logs and writes metrics.
    assert "step 1/2" in first_out[0] and "step 1/2" not in first_out[1]
    assert (multi_dir / "checkpoints" / "2").is_dir()

    # Resume the 2-process run from its multi-process Orbax checkpoint (params, AdamW state,
    # Grain iterator position), finish, and export (parameters gathered across processes).
    export = tmp_path / "hf"
    second = _start_two(train_file, multi_dir, max_steps=STEPS, export=str(export))
    second_out = _finish(second, "2-process resume (steps 3-4)")
    assert "resumed from" in second_out[0], second_out[0][-3000:]
    assert (multi_dir / "checkpoints" / str(STEPS)).is_dir()
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))

    ref_losses, multi_losses = _losses(ref_dir), _losses(multi_dir)
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    assert sorted(multi_losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        got, want = multi_losses[step], ref_losses[step]
        assert got == pytest.approx(want, rel=1e-5), (step, multi_losses, ref_losses)
    # Training actually moved: a resume that re-used the step-0 params would not follow the reference.
    assert ref_losses[STEPS] < ref_losses[1]
