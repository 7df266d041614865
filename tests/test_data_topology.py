"""Topology-invariant data order, end to end through the real training CLI.

The shipped demo config (shuffle and packing on) must give the same per-step losses on
1 process x 2 devices as on 2 `jax.distributed` processes x 1 device, and a run stopped on
2 processes must resume on 1 process (1 device: a slice of another size) with the losses of
the uninterrupted run. Before the global packing plan each process shuffled and packed its
own shard, so the global batch at step k depended on the number of processes (rel 3.4e-3)
and a 2-process checkpoint could not be resumed on 1 process at all.

The same launched processes then run a short LoRA phase (issue 14: refinement tuning with
adapters keeps these invariants): same packing and shuffling, adapter dropout on, so the
dropout masks must not depend on the topology either, and the 2-process adapter-only
checkpoint must resume on 1 process exactly. A second phase in the same process (`cli.main`
called again, jax.distributed already up) costs its compile and steps but no start-up.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DEMO_TRAIN = REPO / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
STOP, STEPS = 2, 4
TIMEOUT = 900
# The LoRA phase is kept cheap: 40 records, one layer, 2 targets, 256-token rows (still shuffled and packed).
LORA_STOP, LORA_STEPS = 2, 3
LORA = {
    "train.lora.rank": "8",
    "train.lora.targets": "q,v",  # PEFT's default; the MLP targets cost compile time here
    "train.lora.dropout": "0.3",  # large enough that a topology-dependent mask shows at rel 1e-5
    "optim.learning_rate": "0.05",
    "model.num_layers": "1",
    "data.max_length": "256",
    "train.loss_chunk_size": "64",
}
LORA_TARGETS = {"wq", "wv"}
# Runs `cli.main` once per argv in one process; exits as the CLI's __main__ does on failure.
DRIVER = """
import json, os, sys
from agentrefine_jax.train.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
"""


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _argv(
    run_dir: pathlib.Path,
    max_steps: int,
    distributed: tuple[int, int] | None = None,
    extra: dict[str, str] | None = None,
    stop: int = STOP,
) -> list[str]:
    # Only what makes the run short and self-contained changes; data settings are the demo's
    # (shuffle, packing, max_length 512, global batch 4).
    sets = {
        "train.max_steps": str(max_steps),
        "train.eval_every": "0",
        "train.checkpoint_every": str(stop),
        "train.export_hf_at_end": "none",
        "optim.schedule": "constant",  # the stopped run's schedule must equal the full run's
        "train.run_dir": str(run_dir),
        **(extra or {}),
    }
    cmd = ["--config", "tiny"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    if distributed is not None:
        port, pid = distributed
        cmd += [
            "--coordinator-address",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(pid),
        ]
    return cmd


def _cmd(
    run_dir: pathlib.Path,
    max_steps: int,
    lora_steps: int,
    distributed: tuple[int, int] | None = None,
) -> list[str]:
    """Full fine-tuning in `run_dir`, then LoRA in `run_dir`-lora on the records in `lora.jsonl`
    beside it, in one process."""
    lora_dir = run_dir.with_name(run_dir.name + "-lora")
    lora_data = {"data.train_files": str(run_dir.parent / "lora.jsonl"), "data.eval_files": ""}
    if distributed is not None:  # the merged export gathers base and adapters across processes
        lora_data["train.export_hf_at_end"] = "hf"
    # jax.distributed is initialised once per process: the second phase runs without the flags.
    phases = [
        _argv(run_dir, max_steps, distributed),
        _argv(lora_dir, lora_steps, extra={**LORA, **lora_data}, stop=LORA_STOP),
    ]
    return [sys.executable, "-c", DRIVER, json.dumps(phases)]


def _start(cmd: list[str], devices: int, log: pathlib.Path) -> tuple[subprocess.Popen, pathlib.Path]:
    with open(log, "w") as f:  # a file, not a pipe nobody reads while we poll
        proc = subprocess.Popen(cmd, env=_env(devices), cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def _finish(procs: list[tuple[subprocess.Popen, pathlib.Path]], what: str) -> list[str]:
    """Wait for all; if one fails, kill the rest at once (they would hang in a collective)."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while any(p.poll() is None for p, _ in procs):
            if any(p.returncode not in (None, 0) for p, _ in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outs = [log.read_text() for _, log in procs]
    for i, ((p, _), out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"{what} process {i} exited {p.returncode}:\n{out[-4000:]}"
    return outs


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT)
def test_demo_losses_do_not_depend_on_processes_and_resume_on_fewer(tmp_path: pathlib.Path) -> None:
    ref_dir, multi_dir = tmp_path / "one_process", tmp_path / "two_then_one"
    (tmp_path / "lora.jsonl").write_text("\n".join(DEMO_TRAIN.read_text().splitlines()[:40]) + "\n")
    # Reference (1 process x 2 devices, uninterrupted) and 2 processes x 1 device up to STOP, concurrently.
    ref = _start(_cmd(ref_dir, STEPS, LORA_STEPS), 2, tmp_path / "ref.log")
    port = _port()
    two = [
        _start(_cmd(multi_dir, STOP, LORA_STOP, (port, pid)), 1, tmp_path / f"two-p{pid}.log")
        for pid in range(2)
    ]
    two_out = _finish(two, "2-process run")
    (ref_out,) = _finish([ref], "1-process reference")
    assert "over 2 devices (1 processes)" in ref_out
    assert "over 2 devices (2 processes)" in two_out[0]
    assert "packed rows" in ref_out  # the demo's packing is on

    # Resume the 2-process checkpoint on 1 process with 1 device.
    (one_out,) = _finish(
        [_start(_cmd(multi_dir, STEPS, LORA_STEPS), 1, tmp_path / "resume.log")], "1-process resume"
    )
    assert "over 1 devices (1 processes)" in one_out and f"resumed from {multi_dir}" in one_out

    ref_losses, multi_losses = _losses(ref_dir), _losses(multi_dir)
    assert sorted(ref_losses) == sorted(multi_losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert multi_losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (
            step,
            multi_losses,
            ref_losses,
        )
    assert len(set(ref_losses.values())) == STEPS  # distinct batches: a repeated batch would not show

    # LoRA phase: the same invariants with adapters, packing at 256 and adapter dropout.
    ref_lora, multi_lora = ref_dir.with_name("one_process-lora"), multi_dir.with_name("two_then_one-lora")
    assert f"resumed from {multi_lora}" in one_out
    assert f"exported step {LORA_STOP} as a Hugging Face checkpoint" in two_out[0]
    ref_losses, multi_losses = _losses(ref_lora), _losses(multi_lora)
    assert sorted(ref_losses) == sorted(multi_losses) == list(range(1, LORA_STEPS + 1))
    for step in range(1, LORA_STEPS + 1):
        assert multi_losses[step] == pytest.approx(ref_losses[step], rel=1e-5), (
            step,
            multi_losses,
            ref_losses,
        )
    assert len(set(ref_losses.values())) == LORA_STEPS
    # The 2-process checkpoint the resume read holds the adapters only.
    tree = (
        ocp.StandardCheckpointHandler().metadata(multi_lora / "checkpoints" / str(LORA_STOP) / "params").tree
    )
    assert set(tree) == LORA_TARGETS
