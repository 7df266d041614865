"""Best-of-N on AgentBoard's protocol (the paper's Table 4): N samples per episode beside the greedy run,
success if any sample succeeds, progress the max, and the difference; with the random policy through the
CLI (with a plug-in task) and with a real (tiny, random-weight) checkpoint sampling at temperature 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from agentboard_fixture import make_checkout
from test_eval_checkpoint import CFG, save_random_checkpoint

from agentrefine_jax.eval.agentboard.checkout import Checkout
from agentrefine_jax.eval.agentboard.runner import checkpoint_model, run
from agentrefine_jax.eval.config import EvalConfig

pytest.importorskip("pddlgym")
pytest.importorskip("nltk")


PLUGIN = """
from agentrefine_jax.eval import register_task
from agentrefine_jax.eval.agentboard.tasks.pddl import PddlTask


class GripperOnly(PddlTask):
    name = "gripper_only"


register_task("gripper_only", display_name="Gripper", agentboard=lambda strict: GripperOnly(strict=strict))
"""


def test_random_best_of_4_through_the_cli_with_a_plugin_task(tmp_path):
    (tmp_path / "ab_plugin.py").write_text(PLUGIN)
    co = make_checkout(tmp_path / "ab")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "agentrefine_jax.eval", "--agentboard-dir", str(co), "--plugin", "ab_plugin"]
    cmd += ["--tasks", "pddl,gripper_only", "--policy", "random", "--best-of", "4", "--temperature", "1.0"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [*cmd, "--max-steps", "5", "--name", "bo4", "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "agentrefine_jax.eval/2"
    assert (doc["source"], doc["config"]["name"]) == ("agentboard", "bo4")
    bon = doc["best_of"]
    assert (bon["n"], bon["temperature"]) == (4, 1.0)
    # The plug-in task ran under AgentBoard's protocol with Best-of-N like a built-in one.
    assert doc["tasks"]["gripper_only"]["episodes"] == 2
    assert len([e for e in bon["episodes"] if e["task"] == "gripper_only"]) == 8
    samples = [e for e in bon["episodes"] if e["task"] == "pddl"]
    assert sorted((e["index"], e["sample"]) for e in samples) == [(i, k) for i in range(2) for k in range(4)]
    # Best-of-4 by hand from the sample records: any success, max progress, per episode.
    by_episode: dict[int, list[dict]] = {}
    for e in samples:
        by_episode.setdefault(e["index"], []).append(e)
    success = sum(any(e["success"] for e in v) for v in by_episode.values()) / 2
    progress = sum(max(e["progress_rate"] for e in v) for v in by_episode.values()) / 2
    m = bon["tasks"]["pddl"]
    assert m["best_of"] == pytest.approx({"success_rate": success, "progress_rate": progress})
    # The greedy row is the main run; sample 0 of the random policy uses its seeds, so it equals it.
    greedy = {k: doc["tasks"]["pddl"][k] for k in ("success_rate", "progress_rate")}
    assert m["greedy"] == greedy and m["per_sample"][0] == greedy
    for k in ("success_rate", "progress_rate"):
        assert m["delta"][k] == pytest.approx(m["best_of"][k] - greedy[k])
        assert m["best_of"][k] >= max(s[k] for s in m["per_sample"]) >= m["sample_mean"][k]
    # The samples are different draws: not every sample of an episode took the same actions.
    assert any(len({tuple(e["actions"]) for e in v}) > 1 for v in by_episode.values())
    assert "Best-of-4" in done.stdout and "greedy" in done.stdout and "Δ" in done.stdout


@pytest.mark.slow
def test_checkpoint_samples_differ_at_temperature_1(tmp_path):
    ckpt = save_random_checkpoint(tmp_path / "ckpt", CFG, seed=2)
    co = Checkout(make_checkout(tmp_path / "ab"))
    model = checkpoint_model(ckpt, None, None)
    prompts: list[tuple[str, str]] = []
    generate = model.generate

    def recording(batch, keys=None):
        prompts.extend(batch)
        return generate(batch, keys)

    model.generate = recording
    sampled = {"best_of": 3, "temperature": 1.0}
    cfg = EvalConfig(tasks=("pddl",), source="agentboard", max_steps=1, batch_size=4, episodes=1, **sampled)
    doc = run(co, cfg, model=model)
    samples = doc["best_of"]["episodes"]
    assert [e["sample"] for e in samples] == [0, 1, 2] and all(e["steps"] == 1 for e in samples)
    # Three samples of the same episode from the same first prompt: they differ (two may still
    # parse to the same action by chance; which cache rows draw them depends on earlier calls).
    assert len({tuple(e["actions"]) for e in samples}) > 1
    # The greedy run used the plain model (one prompt per step); the samples went through a sampled twin
    # whose calls are not recorded here, and it batched the three samples of the episode together.
    assert len(prompts) == 1
    m = doc["best_of"]["tasks"]["pddl"]
    assert m["greedy"]["success_rate"] == doc["tasks"]["pddl"]["success_rate"]
    assert len(m["per_sample"]) == 3


def test_builtin_source_reports_greedy_best_of_and_delta_too(tmp_path):
    from agentrefine_jax.eval import EvalConfig, RandomPolicy, format_table, run_eval

    cfg = EvalConfig(tasks=("pddl",), episodes=3, best_of=3, max_steps=4, batch_size=1, workdir=str(tmp_path))
    doc = run_eval(RandomPolicy(), cfg, log=lambda _m: None)
    m = doc["best_of"]["tasks"]["pddl"]
    orig = doc["variants"]["original"]["tasks"]["pddl"]
    # A privileged policy's greedy run is its sample 0 (same seeds); Best-of-N is the variant's rate.
    assert m["greedy"] == {
        "success_rate": orig["first_sample_success_rate"],
        "progress_rate": orig["first_sample_progress_rate"],
    }
    assert m["best_of"] == {"success_rate": orig["success_rate"], "progress_rate": orig["progress_rate"]}
    assert m["delta"]["progress_rate"] == pytest.approx(orig["progress_rate"] - m["greedy"]["progress_rate"])
    assert len(m["per_sample"]) == 3 and len(doc["best_of"]["greedy_episodes"]) == 3
    assert "Best-of-3" in format_table(doc) and "Δ" in format_table(doc)
