"""On-policy refinement data (`python -m agentrefine_jax.eval onpolicy`, eval/onpolicy.py) on a tiny
random-weight checkpoint: every refinement is the expert's valid action for its state (replayed in a fresh
environment), no eval episode is ever played, the rows go through the data pipeline with the right masks
and preference pairs, and a collection killed mid-run resumes to the same file byte for byte."""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from test_eval_checkpoint import CFG, save_random_checkpoint

from agentrefine_jax.data import demo_world as dw
from agentrefine_jax.data.cli import main as data_main
from agentrefine_jax.data.schema import assistant_categories
from agentrefine_jax.data.templates import get_template
from agentrefine_jax.data.tokenizers import load_tokenizer
from agentrefine_jax.eval.cli import main as eval_main
from agentrefine_jax.eval.config import SEED_LIMIT
from agentrefine_jax.eval.envs.babyai import TRAIN_SEED_BASE
from agentrefine_jax.eval.envs.demo_world import SEED_BASE
from agentrefine_jax.eval.envs.pddl import DEFAULT_PROBLEMS
from agentrefine_jax.eval.envs.pddl_plan import bfs_plan
from agentrefine_jax.eval.journal import journal_path
from agentrefine_jax.eval.onpolicy import refinement_row
from agentrefine_jax.eval.react import FORMAT_ERROR, parse_action
from agentrefine_jax.eval.registry import make_task
from agentrefine_jax.layout import observation_turn

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASKS = ("demo_world", "babyai", "pddl")
EPISODES = 2
ARGS = ["--tasks", ",".join(TASKS), "--episodes", str(EPISODES), "--max-steps", "6"]
ARGS += ["--max-new-tokens", "12", "--batch-size", "3", "--progress-every", "2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "run", CFG, seed=0)


def _collect(checkpoint: str, out: pathlib.Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTREFINE_FAULT", None)
    if fault:
        env["AGENTREFINE_FAULT"] = fault
    cmd = [sys.executable, "-m", "agentrefine_jax.eval", "onpolicy", "--checkpoint", checkpoint, *ARGS]
    return subprocess.run(
        [*cmd, "--workdir", str(out.parent / "w"), "--out", str(out)],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def collected(checkpoint, tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("whole") / "onpolicy.jsonl"
    done = _collect(checkpoint, out)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(journal_path(str(out)))  # the rows are written: the journal is gone
    return out, done


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _spec(task, row: dict) -> dict:
    """The world a row played: episode i of the collection (seed 0) is the task's i-th training spec."""
    episode = int(row["id"].split("-")[2])
    return task.training_specs(EPISODES, 0)[episode]


def test_training_splits_never_meet_an_eval_episode(tmp_path):
    rng = random.Random(0)
    seeds = [0, 1, 99, SEED_LIMIT - 1, *(rng.randrange(SEED_LIMIT) for _ in range(20))]
    for name in TASKS:
        task = make_task(name, str(tmp_path))
        try:
            train = [s for seed in (0, 1, 500) for s in task.training_specs(40, seed)]
            assert not any(task.is_eval_spec(s) for s in train)
            for seed in seeds:  # every eval episode of any allowed run seed is on the eval side
                evals = task.episode_specs(40, seed)
                assert all(task.is_eval_spec(s) for s in evals)
                assert not [s for s in evals if s in train]
        finally:
            task.close()
    # the ranges behind that: demo eval worlds start at 2,000,000 (training: 0..999,999), BabyAI eval
    # seeds stay below 100_003 * 2**31 + episodes (training: from 2**50), PDDL's lists are apart
    assert SEED_BASE > 1_000_000 and 100_003 * SEED_LIMIT + 10**12 < TRAIN_SEED_BASE
    pddl = make_task("pddl", str(tmp_path))
    eval_problems = {p for ps in DEFAULT_PROBLEMS.values() for p in ps}
    assert not {s["problem"] for s in pddl.training_specs(10, 0)} & eval_problems


def test_bad_requests_are_refused_in_one_line(checkpoint, tmp_path, capsys):
    out = str(tmp_path / "o.jsonl")
    base = ["onpolicy", "--checkpoint", checkpoint, "--episodes", "2", "--out", out]
    for extra, words in (
        (["--tasks", "demo_world", "--seed", "999999"], "training worlds are seeds 0..999999"),
        (["--tasks", "demo_world", "--seed", "-1"], "--seed must be in [0, 2**31)"),
        (["--tasks", "textworld"], "has no training split"),
    ):
        assert eval_main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[eval] error: ") and words in err[0], err
    assert not os.path.exists(out)
    # an eval run's seed is bounded too: that bound is what keeps the splits apart
    assert eval_main(["--policy", "random", "--seed", str(SEED_LIMIT), "--tasks", "demo_world"]) == 2
    assert "--seed must be in [0, 2**31)" in capsys.readouterr().err


def test_every_refinement_is_the_experts_valid_action_for_its_state(collected, tmp_path):
    out, done = collected
    rows = _rows(out)
    summary = json.loads(done.stdout)
    assert set(summary) == set(TASKS) and all(s["expert_invalid"] == 0 for s in summary.values())
    assert {r["id"].split("-")[1] for r in rows} == set(TASKS)
    assert len(rows) == sum(s["rows"] for s in summary.values())
    assert "progress: " in done.stderr  # the heartbeat line
    refinements = 0
    for row in rows:
        name = row["id"].split("-")[1]
        task = make_task(name, str(tmp_path / name))
        spec = _spec(task, row)
        assert not task.is_eval_spec(spec)
        env = task.make_env(spec, 0)
        first = env.reset()
        assert first in row["messages"][1]["content"] and env.goal in row["messages"][1]["content"]
        expert = task.oracle(env)
        synced = expert.next_action(env, [])  # the collector's expert sees every executed step
        msgs, cats = row["messages"], assistant_categories(row["messages"])
        assert cats[-1] == "refinement"  # cut after the last refinement
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            action = parse_action(m["content"])
            if cats[k] == "refinement":
                refinements += 1
                assert action == synced
                if name == "demo_world":  # the demo's expert replanned from this state, independently
                    assert action == dw._expert_steps(env.world)[0][1]
                if name == "pddl":  # one step of a shortest plan from this state
                    before = len(bfs_plan(env._env, env._env.get_state()))
            if action is None:
                observation, valid, executed = FORMAT_ERROR, False, False
            else:
                res = env.step(action)
                observation, valid, executed = res.observation, res.valid, res.executed
            assert valid == (cats[k] != "erroneous"), (row["id"], k, m)
            assert m.get("loss") is (cats[k] == "refinement") or cats[k] == "untrained"
            if cats[k] == "refinement" and name == "pddl" and not env.done:
                assert len(bfs_plan(env._env, env._env.get_state())) == before - 1
            if k + 1 < len(msgs):  # the environment's answer, as it gave it
                assert msgs[k + 1]["content"] == observation_turn(observation)
            if executed and not env.done:
                synced = expert.next_action(env, [])
        env.close()
        task.close()
    assert refinements == sum(s["refinements"] for s in summary.values()) > 0


def test_rows_round_trip_through_the_data_pipeline_with_the_right_masks(collected, tmp_path, capsys):
    out, _ = collected
    rows = _rows(out)
    template = get_template("llama3", load_tokenizer("llama3"))
    for row, (ids, mask, _) in zip(rows, template.encode_batch([r["messages"] for r in rows]), strict=True):
        cats = assistant_categories(row["messages"])
        trained = [m["content"] for m, c in zip(row["messages"], cats, strict=True) if c == "refinement"]
        taught = template.decode(np.asarray(ids)[np.asarray(mask) == 1].tolist(), skip_special_tokens=False)
        assert taught == "".join(t + "<|eot_id|>" for t in trained)
    assert data_main(["stats", "--input", str(out), "--template", "llama3", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    errors = sum(c == "erroneous" for r in rows for c in assistant_categories(r["messages"]))
    assert stats["parsed"] == len(rows) and stats["skipped_total"] == 0
    assert stats["trained_turns"]["erroneous"] == 0 and stats["turns"]["erroneous"] == errors
    # each mistake is answered by the expert: one preference pair per erroneous turn
    assert stats["preference"]["pairs"] == stats["preference"]["erroneous_turns"] == errors
    dump = tmp_path / "d.jsonl"
    assert (
        data_main(["dump", "--input", str(out), "--template", "llama3", "--no-pack", "--out", str(dump)]) == 0
    )
    assert len(dump.read_text().splitlines()) == len(rows)


def test_a_killed_collection_resumes_to_the_same_file(checkpoint, collected, tmp_path):
    whole, _ = collected
    out = tmp_path / "onpolicy.jsonl"
    killed = _collect(checkpoint, out, fault="after_episode@3:KILL")
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()
    assert len(pathlib.Path(journal_path(str(out))).read_text().splitlines()) == 1 + 3
    resumed = _collect(checkpoint, out)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 3 finished episodes" in resumed.stderr
    assert resumed.stderr.count(" refinement(s) of ") == len(TASKS) * EPISODES - 3  # only the others ran
    assert out.read_bytes() == whole.read_bytes()


def test_a_killed_collection_is_not_resumed_by_another_model_at_the_same_path(tmp_path):
    # The journal names the model that played it, not the --checkpoint string: another model saved in the
    # run directory's place (trained again, or trained on) must not add its episodes to the same rows.
    run = tmp_path / "run"
    save_random_checkpoint(run, CFG, seed=0)
    out = tmp_path / "onpolicy.jsonl"
    killed = _collect(str(run), out, fault="after_episode@1:KILL")
    assert killed.returncode == -signal.SIGKILL
    header = json.loads(pathlib.Path(journal_path(str(out))).read_text().splitlines()[0])
    assert header["model"]["step"] == 1 and "checkpoint" not in header["settings"], header
    shutil.rmtree(run)
    save_random_checkpoint(run, CFG, seed=1)
    refused = _collect(str(run), out)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "mix two models" in refused.stderr and "Traceback" not in refused.stderr
    assert not out.exists()


def test_the_model_s_own_valid_turns_are_context_and_the_row_ends_at_the_last_refinement():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "o0"}]
    for k, reply in enumerate(["Action: look", "gibberish", "Thought: t\nAction: go to hall", " ", "x"], 1):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"o{k}"}]
    trace = [{"valid": v} for v in (True, False, True, False, False)]
    row = refinement_row("r", messages, trace, [3])
    assert [(m.get("loss"), m.get("train")) for m in row["messages"] if m["role"] == "assistant"] == [
        (True, False),  # the model's accepted turn: context only
        (False, None),  # its mistake
        (True, None),  # the expert's refinement
    ]
    assert len(row["messages"]) == 2 + 2 * 3 - 1  # no turn after the last refinement
    assert assistant_categories(row["messages"])[2::2] == ["untrained", "erroneous", "refinement"]
    assert refinement_row("r", messages, trace, []) is None  # no refinement: no row
    blank = refinement_row("r", messages, trace, [5])["messages"][8]
    assert blank == {"role": "assistant", "content": "(no reply)", "loss": False}
