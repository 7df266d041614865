"""The `demo_world` eval task (unseen worlds of the demo generator) and the reply-behaviour metrics
(valid-action rate, format-error rate) on a real built-in task with replies we control exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrefine_jax.data import demo_world as dw
from agentrefine_jax.eval import EvalConfig, format_table, run_eval
from agentrefine_jax.eval.envs.demo_world import DemoWorldTask
from agentrefine_jax.eval.metrics import episode_rates
from agentrefine_jax.eval.policies import OraclePolicy, RandomPolicy


class Scripted:
    """Per episode: one unreadable reply, one action the world rejects, then the oracle's actions."""

    name = "scripted"
    needs_oracle = False

    def act(self, requests):
        out = []
        for r in requests:
            if r.step == 0:
                out.append("I am not sure what to do.")  # no Action: line -> format error
            elif r.step == 1:
                out.append("Thought: try.\nAction: fly to the moon")  # the world rejects it
            else:
                out.append(f"Thought: go on.\nAction: {r.env.oracle_action()}")
        return out

    def close(self):
        pass


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("demo_world"))


def _run(policy, workdir, episodes=4, **kw):
    cfg = EvalConfig(tasks=("demo_world",), episodes=episodes, workdir=workdir, batch_size=2, **kw)
    return run_eval(policy, cfg, log=lambda _: None)


def test_worlds_are_unseen_and_use_the_demo_simulator():
    task = DemoWorldTask("")
    seeds = [s["seed"] for s in task.episode_specs(5, 0) + task.episode_specs(5, 1)]
    assert len(set(seeds)) == 10 and min(seeds) >= 2_000_000  # past train (0..) and eval (1,000,000..)
    env = task.make_env(task.episode_specs(1, 0)[0], 0)
    obs, goal = env.reset(), env.goal
    world = dw.make_world(__import__("random").Random(seeds[0]))
    assert obs == world.describe() and world.task_object in goal
    for action in env.valid_actions():  # every listed action is valid in the demo's own simulator
        probe = dw.make_world(__import__("random").Random(seeds[0]))
        assert probe.step(action)[1], action
    bad = env.step("grab the moon")
    assert not bad.valid and "not a valid action" in bad.observation


def test_oracle_solves_every_world_and_random_does_worse(workdir):
    oracle = _run(OraclePolicy(), workdir)["variants"]["original"]["tasks"]["demo_world"]
    assert oracle["success_rate"] == 1.0 and oracle["episodes"] == 4
    assert oracle["valid_action_rate"] == 1.0 and oracle["format_error_rate"] == 0.0
    rand = _run(RandomPolicy(seed=0), workdir, max_steps=6)["variants"]["original"]["tasks"]["demo_world"]
    assert rand["success_rate"] < 1.0 and rand["format_error_rate"] == 0.0


def test_perturbed_vocabulary_renames_and_rejects_the_canonical_word(workdir):
    task = DemoWorldTask(workdir)
    env = task.make_env(task.episode_specs(1, 0)[0], 1)
    env.reset()
    assert not env.step("look").valid  # renamed to "look around" under perturbation 1
    assert env.step("look around").valid
    doc = _run(OraclePolicy(), workdir, episodes=2, perturbations=2)
    assert all(v["tasks"]["demo_world"]["success_rate"] == 1.0 for v in doc["variants"].values())


def test_valid_action_and_format_error_rates_are_exact(workdir):
    doc = _run(Scripted(), workdir)
    m = doc["variants"]["original"]["tasks"]["demo_world"]
    want_valid, want_fmt = [], []
    for e in doc["episodes"]:
        assert e["success"] and e["format_errors"] == 1 and e["invalid_actions"] == 1
        # The trace agrees: one step without an action, one rejected action, the rest valid.
        trace = e["trace"]
        assert trace[0]["action"] is None and trace[1]["valid"] is False
        assert all(t["valid"] for t in trace[2:])
        actions = e["steps"] - 1
        want_valid.append((actions - 1) / actions)
        want_fmt.append(1 / e["steps"])
        assert episode_rates(e) == {"valid_action_rate": want_valid[-1], "format_error_rate": want_fmt[-1]}
    assert m["valid_action_rate"] == pytest.approx(sum(want_valid) / 4)
    assert m["format_error_rate"] == pytest.approx(sum(want_fmt) / 4)
    assert 0 < m["format_error_rate"] < 0.5 < m["valid_action_rate"] < 1
    table = format_table(doc)
    row = next(line for line in table.splitlines() if "valid / fmt err" in line)
    assert f"{100 * m['valid_action_rate']:5.1f}" in row and f"{100 * m['format_error_rate']:5.1f}" in row


def test_cli_runs_demo_world(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", "--policy", "oracle", "--tasks", "demo_world",
         "--episodes", "2", "--out", str(out), "--workdir", str(tmp_path / "w"), "-q"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["variants"]["original"]["tasks"]["demo_world"]["valid_action_rate"] == 1.0


def test_wilson_interval_matches_the_closed_form():
    from agentrefine_jax.analyze.tables import wilson_interval

    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)  # the textbook 0/10 upper bound
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))


def test_report_shows_counts_intervals_rates_and_endings(workdir, tmp_path):
    from agentrefine_jax.analyze.cli import main as analyze

    path = tmp_path / "scripted.json"
    doc = _run(Scripted(), workdir, episodes=3)
    path.write_text(json.dumps(doc))
    rand = tmp_path / "random.json"
    rand.write_text(json.dumps(_run(RandomPolicy(seed=0), workdir, episodes=3, max_steps=4)))
    assert analyze(["report", f"scripted={path}", f"random={rand}", "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    section = md.split("## Episodes", 1)[1].split("##", 1)[0]
    m = doc["variants"]["original"]["tasks"]["demo_world"]
    scripted = next(line for line in section.splitlines() if line.startswith("| scripted"))
    assert "n=3" in scripted and "succ 95% CI 43.8–100.0" in scripted and "ends: success 3" in scripted
    assert f"valid {100 * m['valid_action_rate']:.1f}" in scripted
    assert f"fmt err {100 * m['format_error_rate']:.1f}" in scripted
    assert "max_steps" in next(line for line in section.splitlines() if line.startswith("| random"))
