"""CLI end to end with `--policy`, and task plug-ins (how ALFWorld / real Jericho games get added)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

PLUGIN = textwrap.dedent(
    """
    from agentrefine_jax.eval import register_task
    from agentrefine_jax.eval.envs.pddl import PDDLTask

    def blocks_only(workdir, **options):
        problems = ("blocks_test/problem2.pddl", "blocks_test/problem4.pddl")
        return PDDLTask(workdir, problems={"blocks": problems})

    # No weight: reported beside the held-out tasks but not averaged into them.
    register_task("blocks_test", blocks_only, display_name="Blocks(test)")
    """
)


def test_plugin_task_runs_beside_builtin_tasks(tmp_path):
    (tmp_path / "my_eval_plugin.py").write_text(PLUGIN)
    out = tmp_path / "r.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "MPLCONFIGDIR": str(tmp_path / "mpl"),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrefine_jax.eval",
            "--plugin",
            "my_eval_plugin",
            "--policy",
            "oracle",
            "--tasks",
            "blocks_test,pddl",
            "--episodes",
            "2",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Blocks(test)" in proc.stdout and "PDDL" in proc.stdout
    # Progress lines go to stderr; stdout carries the table only.
    assert "[eval] pddl original episode 0" in proc.stderr and "[eval]" not in proc.stdout
    doc = json.loads(out.read_text())
    orig = doc["variants"]["original"]
    assert orig["tasks"]["blocks_test"]["success_rate"] == 1.0
    assert {e["spec"]["problem"] for e in doc["episodes"] if e["task"] == "blocks_test"} == {
        "blocks_test/problem2.pddl",
        "blocks_test/problem4.pddl",
    }
    assert orig["held_out_average"]["weights"] == {"pddl": 1.0}
    assert doc["config"]["tasks"] == ["blocks_test", "pddl"]


def test_quiet_pddl_run_prints_nothing_of_pddlgym(tmp_path):
    """Issue 44: `eval -q` on PDDL printed Fast Downward's translator warning (`Warning: name clash
    between type and predicate 'room'.` and its second line) when grounding tinyonearmedgripper, which
    seed 3's third episode is; a quiet run's stderr holds nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "XLA_FLAGS"))}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["-q", "--policy", "oracle", "--tasks", "pddl", "--episodes", "3", "--seed", "3"]
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", *args, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    episodes = json.loads(out.read_text())["episodes"]
    assert "tinyonearmedgripper/prob00.pddl" in {e["spec"]["problem"] for e in episodes}, episodes[2]
    assert "Warning" not in done.stdout
