"""Configs and the small validations of issue 32 (items 6 and 7): real CLI processes, real files.

* `--config NAME` resolves inside configs/ only: a file called `llama3_8b` / `demo` in the working
  directory does not shadow it (a bare AssertionError traceback before); a path (`./demo.py`) must
  exist; `--config NAME.py` is the shipped config again since issue 44 (tests/test_config_names.py);
* `train.lora.targets=q,q,v` is refused (accepted silently);
* `export verify --seq-lens` above the model's context is refused before any model is loaded
  (it ran to 11 GB);
* a FIFO given to `data stats` is refused in one line (it was taken for a Hub dataset name);
* SIGTERM to `eval` and to any other tool under `cli_errors.run_main` is exit 75 with one line
  (143, no word).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from faults_disk import NOISE, env, one_line


def _in(cwd, tool: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"agentrefine_jax.{tool}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=cwd)


def test_a_bare_config_name_is_never_shadowed_by_a_file_in_the_cwd(tmp_path):
    (tmp_path / "llama3_8b").write_text("not a config\n")
    res = _in(tmp_path, "plan", "--config", "llama3_8b", "--mesh", "fsdp=32", "--chip", "v5p")
    assert res.returncode == 0, res.stderr
    assert "step time" in res.stdout


def test_duplicate_lora_targets_are_refused_and_demo_resolves_in_configs(tmp_path):
    (tmp_path / "demo").write_text("import os\n")  # shadowed `--config demo` before
    res = _in(tmp_path, "train", "--config", "demo", "--set", "train.lora.targets=q,q,v")
    one_line(res, "train", 2, "train.lora.targets", "each named once")


def test_a_config_path_must_exist_and_end_in_py(tmp_path):
    # `demo.py` alone names the shipped config (issue 44); `./demo.py` is a path and must exist.
    res = _in(tmp_path, "plan", "--config", "./demo.py", "--chip", "v5p")  # no ./demo.py here
    one_line(res, "plan", 2, "demo.py", "--config demo")
    (tmp_path / "mine").write_text("def config(): pass\n")
    one_line(_in(tmp_path, "plan", "--config", "./mine", "--chip", "v5p"), "plan", 2, ".py")


def test_verify_lengths_above_the_context_are_refused_before_loading(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    start = time.monotonic()
    res = _in(
        tmp_path,
        "export",
        "verify",
        "--checkpoint",
        str(tmp_path / "ck"),
        "--hf",
        str(hf),
        "--seq-lens",
        "16,100000",
    )
    one_line(res, "export", 2, "100000", "2048")
    assert time.monotonic() - start < 120


def test_a_fifo_as_data_input_is_refused_in_one_line(tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    one_line(_in(tmp_path, "data", "stats", "--input", str(fifo), timeout=120), "data", 2, "FIFO")
    for command in ("verify", "convert"):  # never blocks reading it
        res = _in(
            tmp_path, "synth", command, "--input", str(fifo), "--out", str(tmp_path / "o.jsonl"), timeout=120
        )
        one_line(res, "synth", 2, "FIFO")


def _term_after(cmd: list[str], ready: str, tmp_path) -> tuple[int, str]:
    """Start `cmd`, wait until its stderr shows `ready`, SIGTERM it; (exit code, stderr)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=tmp_path
    )
    seen = []
    deadline = time.monotonic() + 240
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if ready in line or not line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + rest


def test_sigterm_is_75_with_one_line(tmp_path):
    eval_cmd = [sys.executable, "-m", "agentrefine_jax.eval", "--policy", "oracle", "--tasks", "babyai"]
    code, err = _term_after(
        [*eval_cmd, "--episodes", "500", "--out", str(tmp_path / "r.json")], "[eval]", tmp_path
    )
    assert code == 75, err
    assert not any(n in err for n in NOISE), err
    assert err.strip().splitlines()[-1].startswith("[eval] terminated (SIGTERM)")

    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps({"rules": []}))
    replay = [
        sys.executable,
        "-m",
        "agentrefine_jax.synth",
        "replay-server",
        "--replies",
        str(replies),
        "--port",
        "0",
    ]
    proc = subprocess.Popen(replay, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    assert proc.stdout is not None and "serving" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert err.strip().splitlines() == ["[synth] terminated (SIGTERM); run the same command again"], err
