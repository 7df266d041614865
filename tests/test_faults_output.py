"""Fault probes: output paths never destroy anything, and a normal CLI run is quiet and interruptible.

Every case is a real `python -m agentrefine_jax.<tool>` process (bounded by a timeout) on real
files in tmp_path, run the way a user's shell runs it: without the test suite's JAX_PLATFORMS=cpu,
so libtpu (installed by the test extra) is probed exactly as on a user's CPU machine. Each case
ends in a correct result, or one `[tool] error: ...` line with exit 2 (130 for Ctrl-C); no case
may print a traceback or delete anything this project did not write (`_snapshot` compares every
file's bytes before and after).

Read-only directories: the suite often runs as root, which writes through permission bits; the
read-only cases then run the process without CAP_DAC_OVERRIDE (`setpriv`), so the bits apply to it
as to any user.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_eval_checkpoint import save_random_checkpoint

from agentrefine_jax.models.config import preset
from agentrefine_jax.outputs import MARKER

CFG = preset("tiny", max_position_embeddings=256)
DEMO_TRAIN = pathlib.Path(__file__).parents[1] / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
TIMEOUT = 300  # seconds per process, generous for a loaded 2-core machine
ORACLE = ("--policy", "oracle", "--tasks", "babyai", "--episodes", "1")  # an eval with no model: seconds
NOISE = ("E0000", "PyTorch was not found", "Waiting for previous save", "Traceback", "WARNING")


def _env() -> dict[str, str]:
    """A user's environment: no JAX_PLATFORMS, TPU_* or simulated devices (XLA_FLAGS), no hub access."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS", "XLA_FLAGS"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def _cmd(tool: str, *args: str, no_torch: bool = False) -> list[str]:
    if no_torch:  # an install without PyTorch (the base install): transformers finds no torch
        code = "import sys, runpy; sys.modules['torch'] = None; runpy.run_module(sys.argv.pop(1), run_name='__main__')"  # noqa: E501
        return [sys.executable, "-c", code, f"agentrefine_jax.{tool}", *args]
    return [sys.executable, "-m", f"agentrefine_jax.{tool}", *args]


def _run(
    tool: str, *args: str, read_only: bool = False, no_torch: bool = False
) -> subprocess.CompletedProcess:
    prefix = []
    if read_only and os.geteuid() == 0:  # root ignores permission bits unless it drops the capability
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    return subprocess.run(
        [*prefix, *_cmd(tool, *args, no_torch=no_torch)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
    )


def _one_line(res: subprocess.CompletedProcess, tool: str, *needles: str, code: int = 2) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"[{tool}] "), res.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _quiet_success(res: subprocess.CompletedProcess, tool: str) -> None:
    assert res.returncode == 0, res.stderr[-3000:]
    noise = [line for line in res.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noise, res.stderr[-3000:]
    # Everything on stderr is the tool's own progress (the data report's indented detail lines too).
    strays = [line for line in res.stderr.splitlines() if line and not line.startswith((f"[{tool}]", " "))]
    assert not strays, strays


def _snapshot(root: pathlib.Path) -> dict[str, str]:
    """Every file and directory under `root` -> a digest of its bytes ("dir" for directories)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _user_dir(path: pathlib.Path, *files: str) -> pathlib.Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text(f"the user's {name}\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("faults") / "ck"
    return pathlib.Path(save_random_checkpoint(root, CFG, seed=0))


@pytest.fixture
def read_only(tmp_path: pathlib.Path):
    d = tmp_path / "ro"
    d.mkdir()
    (d / "kept.txt").write_text("kept\n")
    d.chmod(0o555)
    yield d
    d.chmod(0o755)


# ------------------------------------------------------------------------------- export


def test_export_writes_quietly_and_overwrite_replaces_only_its_own_output(checkpoint, tmp_path):
    """The full cycle on one --out: a first export (quiet, torch-less, libtpu probed), refusal
    without --overwrite, replacement with it, refusal once a user file is added; the user's own
    `hf.old/` and `hf.partial/` survive every step, and no temporary directory is left behind."""
    out = tmp_path / "hf"
    _user_dir(tmp_path / "hf.old", "notes.txt")
    _user_dir(tmp_path / "hf.partial", "draft.txt")
    theirs = {name: _snapshot(tmp_path / name) for name in ("hf.old", "hf.partial")}

    first = _run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out), no_torch=True)
    _quiet_success(first, "export")
    marker = json.loads((out / MARKER).read_text())
    assert "config.json" in marker["entries"] and "model.safetensors" in marker["entries"]
    exported = _snapshot(out)

    _one_line(
        _run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out)),
        "export",
        "exists and is not empty",
        "--overwrite",
    )
    assert _snapshot(out) == exported

    again = _run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out), "--overwrite")
    _quiet_success(again, "export")
    assert _snapshot(out).keys() == exported.keys()  # the same export, written afresh

    (out / "my_notes.txt").write_text("mine\n")
    mine = _snapshot(out)
    line = _one_line(
        _run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out), "--overwrite"),
        "export",
        "my_notes.txt",
    )
    assert "did not write" in line
    assert _snapshot(out) == mine
    assert {name: _snapshot(tmp_path / name) for name in theirs} == theirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.old", "hf.partial"]


def test_export_refuses_a_non_empty_directory_it_did_not_write(checkpoint, tmp_path):
    out = _user_dir(tmp_path / "project", "README.md")
    (out / "src").mkdir()
    before = _snapshot(tmp_path)
    for extra in ([], ["--overwrite"]):
        res = _run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out), *extra)
        _one_line(res, "export", str(out))
    assert _snapshot(tmp_path) == before


def test_overwrite_never_replaces_a_run_directory_or_the_input(checkpoint, tmp_path):
    """Even a run directory that carries a (forged) marker listing all its files is refused."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"run_dir": str(run)}}))
    (run / MARKER).write_text(json.dumps({"entries": ["checkpoints", "config.json"]}))
    before = _snapshot(tmp_path)
    res = _run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(run), "--overwrite")
    _one_line(res, "export", "training run directory")
    res = _run(
        "export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(checkpoint.parent), "--overwrite"
    )
    _one_line(res, "export", "holds the input")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["to-hf", "from-hf", "demo"])
def test_export_out_that_is_a_regular_file(checkpoint, tmp_path, command):
    target = tmp_path / "out"
    target.write_text("a file the user keeps\n")
    source = {"to-hf": ["--checkpoint", str(checkpoint)], "from-hf": ["--hf", str(tmp_path)], "demo": []}
    res = _run("export", command, *source[command], "--out", str(target))
    _one_line(res, "export", "is not a directory")
    assert target.read_text() == "a file the user keeps\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ------------------------------------------------------------------------ read-only / kinds


def _read_only_cases(checkpoint: pathlib.Path, ro: pathlib.Path) -> dict[str, tuple[str, list[str]]]:
    data = ro.parent / "in.jsonl"
    data.write_text("".join(DEMO_TRAIN.read_text().splitlines(keepends=True)[:3]))
    return {
        "export": ("export", ["to-hf", "--checkpoint", str(checkpoint), "--out", str(ro / "hf")]),
        "eval": ("eval", [*ORACLE, "--out", str(ro / "r.json")]),
        "data": ("data", ["dump", "--input", str(data), "--out", str(ro / "rows.jsonl")]),
        "synth": ("synth", ["convert", "--input", str(data), "--out", str(ro / "sub" / "chat.jsonl")]),
        "train": ("train", ["--config", "tiny", "--set", f"train.run_dir={ro / 'run'}"]),
    }  # fmt: skip


@pytest.mark.parametrize("case", ["export", "eval", "data", "synth", "train"])
def test_read_only_output_directory_is_refused_up_front(checkpoint, read_only, case):
    tool, args = _read_only_cases(checkpoint, read_only)[case]
    before = _snapshot(read_only)
    res = _run(tool, *args, read_only=True)
    _one_line(res, tool, "cannot write", str(read_only))
    assert "episode" not in res.stderr  # refused before any work
    assert _snapshot(read_only) == before


def test_eval_out_wrong_kind_is_refused_before_any_episode_and_a_good_one_is_written_quietly(tmp_path):
    (tmp_path / "results").mkdir()
    res = _run("eval", *ORACLE, "--out", str(tmp_path / "results"))
    _one_line(res, "eval", "is a directory")
    blocker = tmp_path / "blocker"
    blocker.write_text("x\n")
    _one_line(_run("eval", *ORACLE, "--out", str(blocker / "r.json")), "eval", "is a file, not a directory")
    assert blocker.read_text() == "x\n" and not list((tmp_path / "results").iterdir())

    good = tmp_path / "results" / "r.json"
    _quiet_success(_run("eval", *ORACLE, "--out", str(good), no_torch=True), "eval")
    assert json.loads(good.read_text())["episodes"] and good.stat().st_mode & 0o044  # readable as before
    assert [p.name for p in good.parent.iterdir()] == ["r.json"]  # no temporary file left


def test_synth_convert_refuses_to_overwrite_its_input(tmp_path):
    """(`data dump --out` = `--input`: tests/test_faults_validation.py.)"""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(DEMO_TRAIN.read_text().splitlines(keepends=True)[:3]))
    before = _snapshot(tmp_path)
    _one_line(_run("synth", "convert", "--input", str(data), "--out", str(data)), "synth", "is also an input")
    out = str(tmp_path / "chat.jsonl")
    res = _run("synth", "convert", "--input", str(data), "--out", out, "--summary", out)
    _one_line(res, "synth", "is also --out")
    assert _snapshot(tmp_path) == before


# ------------------------------------------------------------------------------ train export


@pytest.mark.parametrize("target", [".", "..", "checkpoints", "USER_DIR"])
def test_train_export_target_refused_at_config_load(tmp_path, target):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _user_dir(tmp_path / "mine", "thesis.tex")
    value = str(tmp_path / "mine") if target == "USER_DIR" else target
    before = _snapshot(tmp_path)
    res = _run(
        "train",
        "--config",
        "tiny",
        "--set",
        f"train.run_dir={run}",
        "--set",
        f"train.export_hf_at_end={value}",
    )
    _one_line(res, "train", "train.export_hf_at_end")
    assert _snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------- quiet


def test_orbax_save_wait_advice_is_dropped_and_other_warnings_kept():
    """Orbax's own absl logger, after the CLIs' start-up: only that advisory line goes."""
    code = (
        "from agentrefine_jax import startup; startup.quiet_start()\n"
        "from orbax.checkpoint import checkpoint_manager as m\n"
        "m.logging.warning('Waiting for previous save to complete took %f seconds. If this number is high, "
        "consider checkpointing less frequently.', 3.5)\n"
        "m.logging.warning('a warning that must stay')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, env=_env()
    )
    assert res.returncode == 0, res.stderr
    assert "a warning that must stay" in res.stderr and "Waiting for previous save" not in res.stderr


# ---------------------------------------------------------------------------------- Ctrl-C


def _interrupt_after(cmd: list[str], ready: str, cwd: pathlib.Path) -> tuple[int, str]:
    """Start `cmd` in its own process group, press Ctrl-C (SIGINT to the group, as a terminal does)
    once stderr shows `ready`; returns (exit code, stderr)."""
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=_env(),
        cwd=cwd,
        start_new_session=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if ready in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not seen.wait(0.2):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=30)
    return code, "".join(lines)


def _assert_interrupted(code: int, stderr: str, tool: str) -> None:
    assert code == 130, (code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if "interrupted" in line]
    assert ours == [f"[{tool}] interrupted (Ctrl-C)"], stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == ours[0]


def test_ctrl_c_during_eval_exits_130_with_one_line(tmp_path):
    out = tmp_path / "r.json"
    # Long enough that Ctrl-C lands mid-run on a fast machine: 200 oracle episodes finished within the
    # half second before the signal on CI (stop 47); 4,000 random samples take over a minute here.
    cmd = _cmd(
        "eval",
        "--policy",
        "random",
        "--tasks",
        "babyai",
        "--episodes",
        "200",
        "--best-of",
        "20",
        "--out",
        str(out),
    )
    code, stderr = _interrupt_after(cmd, "original episode 0", tmp_path)
    _assert_interrupted(code, stderr, "eval")
    # No results file, no temporary file; only the journal of the finished episodes, kept so that the
    # same command resumes (issue 31: an evaluation survives a kill, Ctrl-C included).
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["r.json.journal.jsonl"])


def test_ctrl_c_during_training_exits_130_with_one_line(tmp_path):
    cmd = _cmd(
        "train",
        "--config",
        "tiny",
        "--set",
        f"train.run_dir={tmp_path / 'run'}",
        "--set",
        "train.max_steps=500",
    )
    code, stderr = _interrupt_after(cmd, "[train] data[train]", tmp_path)
    _assert_interrupted(code, stderr, "train")


def test_ctrl_c_that_a_library_drops_still_stops_training(tmp_path):
    """The Ctrl-C's KeyboardInterrupt is raised inside a bare `except:` that drops it (as jax's
    pxla.py does after a compile; CI saw a trainer run on minutes after Ctrl-C): the next step
    boundary raises it again, so the run still stops with one line and 130, not 500 steps later."""
    run = tmp_path / "run"
    cmd = _cmd("train", "--config", "tiny", "--set", f"train.run_dir={run}", "--set", "train.max_steps=500")
    env = _env() | {"AGENTREFINE_FAULT": "dropped_in_library@3:INT"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=tmp_path)
    _assert_interrupted(proc.returncode, proc.stderr, "train")
    assert "step 500/500" not in proc.stderr, proc.stderr[-3000:]
