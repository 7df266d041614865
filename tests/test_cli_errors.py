"""Every CLI answers a bad argument with one stderr line naming the tool, exit 2, no traceback.

The train config cases run as real subprocesses (what a user sees, timed generously for a loaded
2-core machine: config errors must come before any data is read). The sweep over all CLIs calls
each `main(argv)` in-process: an exception escaping `main` fails the test just as it would print
a traceback, and it saves the suite a Python start-up per case.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import pytest

MISSING = "/nonexistent/agentrefine-cli-test"


def _run(tool: str, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", f"agentrefine_jax.{tool}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return res, time.monotonic() - t0


def _assert_one_line_error(res: subprocess.CompletedProcess[str], tool: str, *needles: str) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"[{tool}] error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.learning_rate=-1", "optim.learning_rate=-1.0: must be > 0"),
        ("train.log_every=0", "train.log_every=0: must be >= 1"),
        ("optim.schedule=cosin", "optim.schedule='cosin': must be one of cosine, constant"),
        ("train.max_steps=-3", "train.max_steps=-3: must be >= 1"),
        ("train.export_dtype=float8", "train.export_dtype='float8': must be one of auto, float32"),
    ],
)
def test_train_refuses_a_bad_config_value_before_any_work(tmp_path, override, needle):
    run_dir = tmp_path / "run"
    res, seconds = _run("train", "--config", "tiny", "--set", f"train.run_dir={run_dir}", "--set", override)
    _assert_one_line_error(res, "train", needle)
    assert not run_dir.exists()  # nothing was written: the run never started
    assert seconds < 120  # start-up only (imports); the demo's data would take far longer


def test_print_config_validates():
    res, _ = _run("train", "--config", "tiny", "--set", "optim.schedule=cosin", "--print-config")
    _assert_one_line_error(res, "train", "optim.schedule")
    assert res.stdout == ""
    ok, _ = _run("train", "--config", "tiny", "--set", "train.max_steps=5", "--print-config")
    assert ok.returncode == 0 and '"max_steps": 5' in ok.stdout


@pytest.mark.parametrize(
    "tool,args,needle",
    [
        ("train", ["--config", "tiny", "--set", "train.max_step=3"], "unknown key 'max_step'"),
        ("train", ["--config", "tiny", "--set", "train.max_steps=three"], "expected an integer"),
        ("train", ["--config", "no_such_config"], "no config 'no_such_config'"),
        ("train", ["--config", "tiny", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ("train", ["--config", "tiny", "--num-processes", "2"], "go together"),
        ("plan", ["--config", "tiny", "--set", "optim.schedule=cosin"], "optim.schedule"),
        ("plan", ["--config", "no_such_config"], "no config 'no_such_config'"),
        ("plan", ["--config", "tiny", "--mesh", "bogus=2"], "unknown axis 'bogus'"),
        ("plan", ["--config", "tiny", "--devices", "0"], "--devices must be >= 1"),
        ("plan", ["--config", "tiny", "--mesh", "fsdp=1", "--mfu", "-1"], "--mfu must be in (0, 1]"),
        ("rl", ["--config", "tiny", "--set", "rl.group_sizes=3"], "unknown key 'group_sizes'"),
        ("rl", ["--config", "tiny", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        ("data", ["bogus"], "invalid choice: 'bogus'"),
        ("data", ["stats", "--input", "x.jsonl", "--overlength", "cut"], "invalid choice: 'cut'"),
        ("data", ["stats", "--input", MISSING, "--max-length", "0"], "data.max_length=0: must be >= 2"),
        (
            "data",
            ["dump", "--input", MISSING, "-o", MISSING, "--field-map", "{x"],
            "--field-map is not valid",
        ),
        ("synth", ["convert", "--input", "x.jsonl"], "required: --out"),
        ("synth", ["verify", "--input", MISSING, "--out", MISSING], "cannot read"),
        ("export", ["verify", "--checkpoint", MISSING], "required: --hf"),
        ("export", ["to-hf", "--checkpoint", MISSING, "--out", MISSING], "does not exist"),
        ("eval", ["--policy", "oracle", "--tasks", "nosuchtask"], "unknown task 'nosuchtask'"),
        ("eval", ["--policy", "oracle", "--episodes", "x"], "invalid int value"),
        ("inference", ["generate", "--checkpoint", MISSING, "--prompt", "hi"], "required: --max-new-tokens"),
        (
            "inference",
            ["serve", "--checkpoint", MISSING, "--port", "x"],
            "argument --port: expected an integer",
        ),
        ("inference", ["serve", "--checkpoint", MISSING], "does not exist"),
        (
            "inference",
            ["serve", "--checkpoint", MISSING, "--port", "-5"],
            "argument --port: must be in [0, 65535]",
        ),
        ("inference", ["decode"], "invalid choice: 'decode'"),
        (
            "inference",
            ["generate", "--checkpoint", MISSING, "--prompt", "hi", "--max-new-tokens", "0"],
            "must be >= 1",
        ),
        (
            "inference",
            ["generate", "--checkpoint", MISSING, "--prompt", "hi", "--max-new-tokens", "1", "--top-p", "0"],
            "(0, 1]",
        ),
    ],
)
def test_every_cli_answers_a_bad_argument_with_one_line(tool, args, needle, capsys):
    _assert_one_line_error(run_main(tool, args, capsys), tool, needle)


def run_main(tool: str, args: list[str], capsys) -> subprocess.CompletedProcess[str]:
    """A CLI's `main(args)` in-process, as a finished process: an exception escaping `main` fails the
    caller's test as it would print a traceback; argparse's SystemExit gives the exit status."""
    main = importlib.import_module(f"agentrefine_jax.{tool}.cli").main
    try:
        code = main(args)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("code", [0, 75, 3])
def test_a_tools_exit_waits_for_its_threads_and_runs_its_exit_handlers(tmp_path, code):
    """`leave` skips the interpreter's finalization (~0.8 s of XLA teardown per process) but keeps what
    exit does that can matter after a success: a non-daemon thread still writing finishes, atexit
    handlers run, buffered output reaches the pipe; the code is the tool's. The program here is a
    console script's (`agentrefine-...`), whose exit takes that path."""
    script = tmp_path / "agentrefine-probe"
    script.write_text(f"""
import atexit, pathlib, sys, threading, time
from agentrefine_jax.cli_errors import leave

out = pathlib.Path({str(tmp_path)!r})
def late_write():
    time.sleep(0.5)
    (out / "thread").write_text("done")
threading.Thread(target=late_write).start()
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("buffered, no newline")
leave({code})
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == code and r.stdout == "buffered, no newline", (r.returncode, r.stdout, r.stderr)
    if code == 0:
        assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"


def test_a_tool_run_inside_a_host_process_exits_by_systemexit():
    """A host that runs a tool in its own process (pytest here; test_data_templates runs `python -m
    agentrefine_jax.data` by runpy) gets SystemExit with the code, never an exit of its whole process."""
    from agentrefine_jax.cli_errors import leave

    with pytest.raises(SystemExit) as e:
        leave(0)
    assert e.value.code == 0
