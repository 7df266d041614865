"""tpu_scripts/*.sh: complete gcloud command sequences under --dry-run, clear errors for
missing settings, shellcheck, and the remote payloads of launch/stop executed for real by a
local bash (the same commands `gcloud ... ssh --command=` runs on each worker)."""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import time

import pytest
from venvs import venv_seeing_this_interpreter

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tpu_scripts"
LOC = ["--project=proj-1", "--zone=us-east5-a"]
COMMON = ["--project", "proj-1", "--zone", "us-east5-a", "--name", "ar-8b"]
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "ar-8b", *LOC]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_") and k != "CLOUDSDK_CORE_PROJECT"}
    # Belt and braces: no test may ever run gcloud for real.
    env["DRY_RUN"] = "1"
    env.update(extra)
    return env


def run_script(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPTS / name), *args],
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry(name: str, *args: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """The printed command sequence, each line split back into words as a shell would."""
    res = run_script(name, "--dry-run", *args, env=env)
    assert res.returncode == 0, res.stderr
    return [shlex.split(line) for line in res.stdout.splitlines() if not line.startswith("#")]


def remote_command(words: list[str]) -> str:
    (cmd,) = [w for w in words if w.startswith("--command=")]
    return cmd[len("--command=") :]


def test_create_dry_run_sequence() -> None:
    cmds = dry("create.sh", *COMMON, "--type", "v5p-64", "--spot")
    assert cmds == [
        ["gcloud", "compute", "tpus", "queued-resources", "create", "ar-8b", "--node-id=ar-8b", *LOC,
         "--accelerator-type=v5p-64", "--runtime-version=v2-alpha-tpuv5", "--spot"],
        ["gcloud", "compute", "tpus", "queued-resources", "describe", "ar-8b", *LOC,
         "--format=value(state.state)"],
    ]  # fmt: skip
    # Runtime image follows the generation; flags override the environment.
    env = _env(TPU_PROJECT="env-proj", TPU_ZONE="europe-west4-a", TPU_NAME="ar-70b", TPU_TYPE="v6e-64")
    (create,) = dry("create.sh", "--no-wait", "--project", "flag-proj", env=env)
    assert create == [
        "gcloud", "compute", "tpus", "queued-resources", "create", "ar-70b", "--node-id=ar-70b",
        "--project=flag-proj", "--zone=europe-west4-a", "--accelerator-type=v6e-64",
        "--runtime-version=v2-alpha-tpuv6e",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--zone", "z"],
            "missing --project (or $TPU_PROJECT), --name (or $TPU_NAME), --type (or $TPU_TYPE)",
        ),
        ([*COMMON, "--type", "v5p"], "does not look like an accelerator type"),
        ([*COMMON, "--type", "v5p-8", "--spot", "--reserved"], "--spot and --reserved exclude each other"),
        ([*COMMON, "--type", "v5p-8", "--bogus"], "unknown option --bogus"),
        ([*COMMON, "--type", "tpu7-8"], "does not look like"),
    ],
)
def test_create_errors(args: list[str], message: str) -> None:
    res = run_script("create.sh", *args, "--dry-run")
    assert res.returncode == 2
    assert message in res.stderr
    assert res.stdout == ""  # nothing half-printed


def test_setup_dry_run_sequence(tmp_path: pathlib.Path) -> None:
    tarball = tmp_path / "src.tgz"
    cmds = dry("setup.sh", *COMMON, "--bucket", "gs://my-bucket/", "--tarball", str(tarball))
    assert len(cmds) == 5
    tar, scp, install, mount, check = cmds
    assert tar[:3] == ["tar", "-czf", str(tarball)] and tar[-3:] == ["-C", str(REPO), "."]
    assert "--exclude=.git" in tar and "--exclude=runs" in tar
    assert scp == ["gcloud", "compute", "tpus", "tpu-vm", "scp", str(tarball), "ar-8b:src.tgz", *LOC,
                   "--worker=all"]  # fmt: skip
    for cmd in (install, mount, check):
        assert cmd[:-1] == [*SSH, "--worker=all"]
    inst = remote_command(install)
    assert "tar -xzf src.tgz -C agentrefine_jax" in inst
    assert "python3.11 -m venv agentrefine-venv" in inst
    assert "agentrefine-venv/bin/python -m pip install 'jax[tpu]==0.10.2' -e './agentrefine_jax[gcs]'" in inst
    mnt = remote_command(mount)
    assert "gcsfuse --implicit-dirs --rename-dir-limit=1000000 my-bucket /mnt/gcs/my-bucket" in mnt
    assert "jax.device_count()" in remote_command(check)
    # Every remote payload is valid shell.
    for cmd in (install, mount, check):
        assert subprocess.run(["bash", "-n", "-c", remote_command(cmd)]).returncode == 0
    assert not tarball.exists()  # a dry run builds nothing

    clone = dry("setup.sh", *COMMON, "--repo", "https://example.com/r.git", "--ref", "v1", "--no-check",
                "--jax-version", "0.9.0")  # fmt: skip
    assert len(clone) == 1
    payload = remote_command(clone[0])
    assert (
        "git clone https://example.com/r.git agentrefine_jax && git -C agentrefine_jax checkout v1" in payload
    )
    assert "'jax[tpu]==0.9.0'" in payload
    assert (
        run_script("setup.sh", *COMMON, "--ref", "v1", "--dry-run").stderr.strip()
        == "error: --ref needs --repo"
    )


def test_launch_logs_stop_delete_dry_run_sequences() -> None:
    (launch,) = dry(
        "launch.sh", *COMMON, "--config", "llama3_8b", "--set", "train.run_dir=/mnt/gcs/b/runs/8b",
        "--env", "LIBTPU_INIT_ARGS=--xla_enable_async_all_gather=true",
    )  # fmt: skip
    assert launch[:-1] == [*SSH, "--worker=all"]
    payload = remote_command(launch)
    assert "setsid nohup bash -c" in payload and "logs/train-$(hostname).log" in payload
    assert (
        "env LIBTPU_INIT_ARGS=--xla_enable_async_all_gather=true python -m agentrefine_jax.train "
        "--config llama3_8b --distributed --set train.run_dir=/mnt/gcs/b/runs/8b" in payload
    )
    assert dry("logs.sh", *COMMON, "--worker", "all", "--lines", "20", "--follow") == [
        [*SSH, "--worker=all", "--command=tail -n 20 -F agentrefine_jax/logs/train-*.log"]
    ]
    (stop,) = dry("stop.sh", *COMMON)
    assert stop[:-1] == [*SSH, "--worker=all"] and "kill -TERM -- -$pg" in remote_command(stop)
    assert "kill -KILL" in remote_command(dry("stop.sh", *COMMON, "--kill")[0])
    assert dry("delete.sh", *COMMON) == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "ar-8b", *LOC, "--force", "--quiet"]
    ]


def test_launch_refuses_unshared_run_dir() -> None:
    res = run_script("launch.sh", *COMMON, "--config", "llama3_8b", "--dry-run")
    assert res.returncode == 2 and "train.run_dir=/mnt/gcs/" in res.stderr
    res = run_script("launch.sh", *COMMON, "--dry-run", "--set", "train.run_dir=/mnt/gcs/b/x")
    assert res.returncode == 2 and "missing --config" in res.stderr
    assert (
        run_script("launch.sh", *COMMON, "--config", "c", "--allow-local-run-dir", "--dry-run").returncode
        == 0
    )


def _fake_worker_home(tmp_path: pathlib.Path) -> pathlib.Path:
    """A worker's home: the project dir and a real virtualenv that sees what this interpreter sees."""
    home = tmp_path / "home"
    (home / "agentrefine_jax").mkdir(parents=True)
    venv_seeing_this_interpreter(home / "agentrefine-venv", extra=(str(REPO),))
    return home


def _run_payload(payload: str, home: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", payload],
        cwd=home,
        env=_env(HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_launch_payload_runs_the_trainer_with_exact_arguments(tmp_path: pathlib.Path) -> None:
    """The three quoting levels (local shell, ssh --command, bash -c) deliver awkward --set
    values intact: the trainer's --print-config echoes them back in the worker's log."""
    home = _fake_worker_home(tmp_path)
    files = '["a b.jsonl", "it\'s $HOME.jsonl"]'
    (launch,) = dry(
        "launch.sh", *COMMON, "--config", "tiny", "--set", "train.run_dir=/mnt/gcs/b/x",
        "--set", f"data.train_files={files}", "--", "--print-config",
    )  # fmt: skip
    res = _run_payload(remote_command(launch), home)
    assert res.returncode == 0, res.stderr
    assert "started (process group" in res.stdout
    log = next((home / "agentrefine_jax" / "logs").glob("train-*.log"))
    deadline = time.time() + 120
    while "trainer exited with code" not in log.read_text() and time.time() < deadline:
        time.sleep(0.5)
    text = log.read_text()
    assert "[launch] trainer exited with code 0" in text, text
    assert '"a b.jsonl",\n      "it\'s $HOME.jsonl"' in text
    assert '"run_dir": "/mnt/gcs/b/x"' in text


@pytest.mark.skipif(not hasattr(os, "setsid"), reason="needs POSIX sessions")
def test_stop_payload_signals_the_recorded_process_group(tmp_path: pathlib.Path) -> None:
    """stop.sh's payload SIGTERMs the group launch.sh recorded and waits for it; while that
    group lives, launch.sh's payload refuses to start a second trainer."""
    home = _fake_worker_home(tmp_path)
    logs = home / "agentrefine_jax" / "logs"
    logs.mkdir()
    host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
    (logs / f"train-{host}.log").write_text("step 7/100 loss 1.0\n")
    (stop,) = dry("stop.sh", *COMMON, "--timeout", "20")
    payload = remote_command(stop)

    assert "not running" in _run_payload(payload, home).stdout  # no pid file yet

    # A stand-in "trainer" group as launch.sh creates it: setsid'd bash with a child.
    group = subprocess.Popen(["setsid", "bash", "-c", "trap true TERM; sleep 300; echo exited"], cwd=home)
    try:
        deadline = time.time() + 10
        while os.getpgid(group.pid) != group.pid and time.time() < deadline:
            time.sleep(0.05)
        (logs / "train.pid").write_text(f"{group.pid}\n")
        (launch,) = dry("launch.sh", *COMMON, "--config", "tiny", "--allow-local-run-dir")
        refused = _run_payload(remote_command(launch), home)
        assert (
            refused.returncode == 1
            and f"training already running (process group {group.pid})" in refused.stderr
        )

        res = _run_payload(payload, home)
        assert res.returncode == 0, res.stderr
        assert f"sent SIGTERM to process group {group.pid}" in res.stdout
        assert "stopped" in res.stdout and "step 7/100" in res.stdout
        group.wait(timeout=20)
        with pytest.raises(ProcessLookupError):
            os.killpg(group.pid, 0)
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    scripts = sorted(str(p) for p in SCRIPTS.glob("*.sh"))
    assert len(scripts) == 7
    res = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
