"""A regular (non-editable) install works: the wheel carries the configs a TPU worker image needs."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

from venvs import venv_seeing_this_interpreter

REPO = pathlib.Path(__file__).resolve().parent.parent
# What the wheel is built from; nothing else of the checkout may leak into the install.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "agentrefine_jax", "configs")


def _build_wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(REPO / name, src / name, ignore=skip)
        else:
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("agentrefine_jax-*.whl")
    return wheel


def test_wheel_install_resolves_shipped_configs(tmp_path: pathlib.Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.name for p in (REPO / "configs").glob("*.py")}
    assert {f"agentrefine_jax/configs/{n}" for n in shipped} <= names
    assert "agentrefine_jax/data/demo/train.jsonl" in names

    python = venv_seeing_this_interpreter(tmp_path / "venv", hide_project=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing resolves through the cwd
    elsewhere.mkdir()
    res = subprocess.run(  # the console script the wheel installs, as a TPU worker image would run it
        [str(python.parent / "agentrefine-train"), "--config", "llama3_8b", "--print-config"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"]["num_layers"] == 32
    where = subprocess.run(
        [str(python), "-c", "import agentrefine_jax.config as c; print(c.__file__); print(c.CONFIGS_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    site = str(tmp_path / "venv")
    assert where[0].startswith(site) and where[1].startswith(site), where
