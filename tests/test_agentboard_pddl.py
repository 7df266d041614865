"""AgentBoard's PDDL task on a hand-made checkout (expectations computed by hand), on the real 60 problems
when ../shared is present, and through the CLI."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from agentboard_fixture import SHARED, make_checkout

from agentrefine_jax.eval.agentboard.checkout import Checkout, CheckoutError
from agentrefine_jax.eval.agentboard.protocol import Agent, AgentBoardProtocol, RandomPolicy, episode_jobs
from agentrefine_jax.eval.agentboard.runner import run
from agentrefine_jax.eval.agentboard.tasks.pddl import PddlTask, fd_compatible
from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.core import run_episodes
from agentrefine_jax.eval.policies import OraclePolicy

pytest.importorskip("pddlgym")
pytest.importorskip("nltk")
HAS_FD = importlib.util.find_spec("up_fast_downward") is not None
needs_fd = pytest.mark.skipif(not HAS_FD, reason="up-fast-downward not installed (pip install --no-deps)")
UNPARSABLE = "The action is not valid and therefore takes no effect. Ask for the valid actions."
NO_EFFECT = "The action is not valid and therefore takes no effect. Remember the restriction of actions."
INITIAL = (
    "Ball ball1 Ball ball2 Ball1 lies in rooma. Ball2 lies in rooma. Gripper left Gripper right "
    "Left is free. Right is free. Robby is in rooma. Room rooma Room roomb"
)


@pytest.fixture
def checkout(tmp_path):
    return Checkout(make_checkout(tmp_path))


def test_episodes_follow_config_string_sort_and_labels(checkout):
    specs = PddlTask().episodes(checkout)
    # CFG: gripper only; Num_Problems 2; problems string-sorted (p10 < p2 < p9); difficulty from test.jsonl.
    assert [(s.id, s.difficulty, s.info["problem_index"]) for s in specs] == [
        ("gripper/p10.pddl", "easy", 0),
        ("gripper/p2.pddl", "hard", 1),
    ]


def _obs_valid(r):
    return (r.observation, r.valid)


def test_rendering_parsing_progress_and_success(checkout):
    task = PddlTask()
    env = task.make_env(checkout, task.episodes(checkout)[0])
    assert env.reset() == INITIAL
    assert (
        env.goal
        == "The goal is to satisfy the following conditions: ball1 lies in roomb., ball2 lies in roomb."
    )
    assert env.valid_actions() == [
        "move rooma roomb",
        "pick ball1 from rooma with left",
        "pick ball1 from rooma with right",
        "pick ball2 from rooma with left",
        "pick ball2 from rooma with right",
        "check valid actions",
    ]
    r = env.step("Check valid actions please")
    assert (r.observation, r.valid, r.progress) == (
        "Valid actions are: " + ", ".join(env.valid_actions()),
        True,
        0,
    )
    # `drop` is no currently valid operator: unparsable. `pick` with a wrong room: pddlgym ignores it.
    assert _obs_valid(env.step("drop ball1 rooma left")) == (UNPARSABLE, False)
    assert _obs_valid(env.step("pick ball1 roomb left")) == (NO_EFFECT, False)
    assert _obs_valid(env.step("pick ball1")) == (UNPARSABLE, False)  # too few objects
    # The listed text parses: first operator token, then object tokens in order.
    r = env.step("pick ball1 from rooma with left")
    assert r.valid and not r.done and r.progress == 0
    assert "Ball1 is held by left." in r.observation and "Left is free." not in r.observation
    assert env.step("Pick ball2 rooma right.").valid
    assert env.step("move rooma roomb").progress == 0
    r = env.step("drop ball1 roomb left")
    assert (r.valid, r.done, r.progress) == (True, False, 0.5)
    r = env.step("look around")
    assert r.valid and "Ball1 lies in roomb." in r.observation and r.progress == 0.5
    r = env.step("drop ball2 roomb right extra words ball1")
    assert (r.done, r.progress) == (True, 1.0) and env.success
    assert r.observation.endswith("Robby is in roomb. Room rooma Room roomb The goal is satisfied.")


def test_loop_logs_steps_grounding_and_score_changes(checkout):
    task = PddlTask()
    specs = task.episodes(checkout)

    class Scripted:
        def __init__(self, actions):
            self.actions = iter(actions)

        def next_action(self, env, history):
            return next(self.actions)

    script = [
        "Thought: hi\nAction: pick ball1 rooma left",
        "dance",
        "move rooma roomb",
        "drop ball1 roomb left",
    ]

    class ScriptedPolicy:
        def for_episode(self, task, env, spec, seed):
            return Scripted(script)

    agent = Agent(policy=ScriptedPolicy())
    [log] = run_episodes(episode_jobs(task, specs[1:], 10), AgentBoardProtocol(task, checkout, agent))
    assert (log.success, log.progress, log.steps, log.valid_steps, log.end) == (True, 1.0, 4, 3, "done")
    assert log.grounding == 0.75
    assert log.score_change_record == [(3, 1.0)]
    assert [t["action"] for t in log.turns] == [
        "pick ball1 rooma left",
        "dance",
        "move rooma roomb",
        "drop ball1 roomb left",
    ]
    # The step limit ends an episode: 2 steps, no success.
    [log] = run_episodes(episode_jobs(task, specs[1:], 2), AgentBoardProtocol(task, checkout, agent))
    assert (log.success, log.steps, log.end) == (False, 2, "max_steps")


def test_random_policy_is_seeded_and_mostly_grounded(checkout):
    task = PddlTask()
    specs = task.episodes(checkout)
    runs = [
        run_episodes(
            episode_jobs(task, specs, 30),
            # episode_jobs' seed 0: each episode's seed is its index
            AgentBoardProtocol(task, checkout, Agent(policy=RandomPolicy())),
        )
        for _ in range(2)
    ]
    assert [[t["action"] for t in x.turns] for x in runs[0]] == [
        [t["action"] for t in x.turns] for x in runs[1]
    ]
    assert all(x.grounding == 1.0 for x in runs[0])  # the listed actions all parse and change the state


def test_model_run_needs_every_protocol_file(tmp_path):
    root = make_checkout(tmp_path)
    (root / "agentboard/environment/pddl_env/pddl_env.py").unlink()
    with pytest.raises(CheckoutError, match="pddl_env.py: provided by the AgentBoard repository"):
        PddlTask(strict=True).make_env(Checkout(root), PddlTask().episodes(Checkout(root))[0])
    # A policy run falls back to AgentBoard's plain rendering and reports it.
    task = PddlTask(strict=False)
    env = task.make_env(Checkout(root), task.episodes(Checkout(root))[0])
    assert env.reset().startswith("At ball1 rooma At ball2 rooma At-robby rooma")
    assert any("pddl_env.py absent" in n for n in task.notes)


def test_fast_downward_input_normalisation():
    domain = "(define (domain d) (:types t) (:predicates (p ?x)) (:constants a b - t)\n(:action x))"
    problem = "(define (problem q) (:domain d) (:objects a c - t b - t e) (:init) (:goal (p c)))"
    d, p = fd_compatible(domain, problem)
    assert d == "(define (domain d) (:types t) (:constants a b - t)\n(:predicates (p ?x)) (:action x))"
    assert p == "(define (problem q) (:domain d) (:objects c - t\ne) (:init) (:goal (p c)))"
    assert fd_compatible("(define (domain d))", "x") == ("(define (domain d))", "x")


@needs_fd
def test_oracle_and_random_through_the_cli(checkout, tmp_path):
    out, logs = tmp_path / "r.json", tmp_path / "logs"
    cmd = [sys.executable, "-m", "agentrefine_jax.eval", "--protocol", "agentboard"]
    cmd += ["--agentboard-dir", str(checkout.root), "--tasks", "pddl", "--quiet"]
    done = subprocess.run(
        [*cmd, "--policy", "oracle", "--out", str(out), "--log-dir", str(logs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    m = doc["tasks"]["pddl"]
    assert (m["episodes"], m["success_rate"], m["progress_rate"], m["grounding_acc"]) == (2, 1.0, 1.0, 1.0)
    assert (m["success_rate_easy"], m["success_rate_hard"]) == (1.0, 1.0)
    assert doc["held_out"]["missing"] == ["babyai", "sciworld", "jericho"]
    assert "pddl" in done.stdout and "100.0%" in done.stdout
    # AgentBoard-style logs: indent=2 objects per episode, summary lines, all_results.txt.
    first = json.JSONDecoder().raw_decode((logs / "logs" / "pddl.jsonl").read_text())[0]
    assert first["id"] == 0 and first["task_name"] == "gripper" and first["is_done"] is True
    assert first["trajectory"]["Interaction Turn 0"]["Goal"].startswith("The goal is to satisfy")
    assert first["score_change_record"][-1][1] == 1.0 and "example_prompt" not in first
    assert (logs / "pddl.txt").read_text().count("[EXP]") == 2
    assert json.loads((logs / "all_results.txt").read_text())["task_name"] == "pddl"

    bad = subprocess.run(
        [*cmd[:5], "--agentboard-dir", str(tmp_path / "none"), "--policy", "random"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a directory" in bad.stderr


def test_model_run_without_prompt_file_fails_before_any_episode(tmp_path):
    root = make_checkout(tmp_path)
    (root / "agentboard/llm/vllm.py").unlink()

    class NeverCalled:
        name, context_length, max_tokens = "x", 4096, 100

        def num_tokens(self, system, user):
            raise AssertionError

        def generate(self, prompts):
            raise AssertionError

        def close(self):
            pass

    with pytest.raises(CheckoutError, match="vllm.py: provided by"):
        run(Checkout(root), EvalConfig(tasks=("pddl",), source="agentboard"), model=NeverCalled())


# ----------------------------------------------------------------------------------------- real files

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/agentboard absent")


@needs_shared
def test_real_checkout_has_agentboards_60_problems_in_its_order():
    task = PddlTask(strict=False)
    ids = [s.id for s in task.episodes(Checkout(SHARED))]
    assert len(ids) == 60
    assert ids[:2] == ["gripper/prob01.pddl", "gripper/prob02.pddl"] and ids[19] == "gripper/prob20.pddl"
    assert ids[20:23] == ["blockworld/problem1.pddl", "blockworld/problem10.pddl", "blockworld/problem2.pddl"]
    assert ids[30] == "barman/p01.pddl" and ids[49] == "barman/p20.pddl"
    assert ids[50] == "tyreworld/p01.pddl" and ids[59] == "tyreworld/p10.pddl"


@needs_shared
@needs_fd
def test_real_oracle_solves_hard_problems_beyond_30_steps():
    """barman p07 (which defeats pyperplan's search), a 40+-step gripper and tyreworld (FD-normalised)."""
    task = PddlTask(strict=False)
    specs = {s.id: s for s in task.episodes(Checkout(SHARED))}
    picked = [specs[k] for k in ("barman/p07.pddl", "gripper/prob05.pddl", "tyreworld/p01.pddl")]
    oracle = Agent(policy=OraclePolicy())
    logs = run_episodes(episode_jobs(task, picked, 200), AgentBoardProtocol(task, Checkout(SHARED), oracle))
    assert [(x.success, x.progress, x.grounding) for x in logs] == [(True, 1.0, 1.0)] * 3
    assert logs[1].steps > 30
