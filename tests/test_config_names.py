"""`--config NAME` and `--config NAME.py` name a shipped config from any directory; a path names a
file; a bare `NAME.py` that is shipped *and* sits in the working directory is refused as ambiguous
(issue 44: since the cwd-shadowing fix, the mission's own `--config llama3_8b.py` was read as a
path and failed everywhere). Real CLI processes in temporary directories."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from faults_disk import env, one_line

from agentrefine_jax.config import CONFIGS_DIR, resolve_config_path
from agentrefine_jax.config_checks import ConfigNotFoundError

MINE = """from agentrefine_jax.config import load_config


def config():
    cfg = load_config("tiny", ["train.max_steps=7"])
    return cfg
"""


def _in(cwd, tool: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"agentrefine_jax.{tool}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=cwd)


def test_the_missions_command_prints_its_config_from_a_temporary_directory(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.train", "--config", "llama3_8b.py", "--print-config"],
        capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = json.loads(res.stdout)
    assert (cfg["model"]["num_layers"], cfg["model"]["hidden_size"], cfg["data"]["tokenizer"]) == (
        32,
        4096,
        "llama3",
    )


def test_name_and_name_py_are_the_same_shipped_config_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("llama3_8b", "llama3_8b.py", "demo.py", "tiny"):
        assert resolve_config_path(name) == CONFIGS_DIR / f"{name.removesuffix('.py')}.py"
    monkeypatch.chdir(CONFIGS_DIR)  # the shipped file itself is in the cwd: not ambiguous
    assert resolve_config_path("tiny.py").samefile(CONFIGS_DIR / "tiny.py")
    # The plan CLI takes the same rule (one resolver for every --config).
    res = _in(tmp_path, "plan", "--config", "llama3_8b.py", "--mesh", "fsdp=32", "--chip", "v5p")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step time" in res.stdout


def test_a_shipped_name_that_also_sits_in_the_cwd_is_refused_as_ambiguous(tmp_path):
    (tmp_path / "llama3_8b.py").write_text(MINE)
    line = one_line(
        _in(tmp_path, "train", "--config", "llama3_8b.py", "--print-config"), "train", 2, "ambiguous"
    )
    assert str(CONFIGS_DIR / "llama3_8b.py") in line and str(tmp_path.resolve() / "llama3_8b.py") in line
    # The bare name is still the shipped one, and a path is the user's file.
    assert (
        json.loads(_in(tmp_path, "train", "--config", "llama3_8b", "--print-config").stdout)["model"][
            "num_layers"
        ]
        == 32
    )
    mine = _in(tmp_path, "train", "--config", "./llama3_8b.py", "--print-config")
    assert mine.returncode == 0, mine.stderr[-3000:]
    assert json.loads(mine.stdout)["train"]["max_steps"] == 7


def test_a_file_of_ones_own_by_bare_name_or_by_path(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "mine.py").write_text(MINE)
    (tmp_path / "mine.py").write_text(MINE)
    for given in ("mine.py", "./mine.py", "sub/mine.py", str(sub / "mine.py")):
        res = _in(tmp_path, "train", "--config", given, "--print-config")
        assert res.returncode == 0, (given, res.stderr[-3000:])
        assert json.loads(res.stdout)["train"]["max_steps"] == 7
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigNotFoundError, match="must exist"):
        resolve_config_path("absent.py")
    with pytest.raises(ConfigNotFoundError, match="no config 'mine' in configs/"):
        resolve_config_path("mine")  # a bare name without .py is never a file in the cwd
