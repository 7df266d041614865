"""The GRPO loop (rl/loop.py) through its command, on a tiny model playing real BabyAI worlds.

* a 2-phase run (2 optimizer steps per phase, a checkpoint after every step) SIGKILLed inside
  phase 1, after its first update's checkpoint commits, resumes there on the phase's journaled
  episodes and ends equal to the uninterrupted run: every metrics.jsonl row (timings aside) and
  the final parameters and optimizer state, bit for bit;
* the phase the kill lands in learns from reward: its groups' rewards differ, so both its optimizer
  steps have non-zero advantages, a non-zero policy-gradient loss and gradient, and its second
  update sees the policy moved by its first (the trainer's log-probabilities off the rollout's);
  the resumed step's equality then checks the journal -> rewards -> advantages -> mini-batch path
  on a gradient step, not on a no-op (no weight decay either: only gradients move the parameters);
* the journal round-trips a phase exactly and refuses one made under other rl settings;
* bad settings are one line and exit 2: phases that do not divide, an objective of the other
  command (both ways: the train command names the rl command), a resume under changed rl settings.

The policy: a random model earns no reward (its replies never parse as an action), so the run
starts from a tiny Llama (its own small BPE tokenizer, ChatML) refinement-tuned for 10 steps by
the trainer on episodes the engine played on the run's own training worlds: BabyAI's reference
solver and its uniform random valid-action actor, each reply cut to its `Action:` line (a short
reply the tiny model learns in those steps). At temperature 1 the tuned model mixes turns and
forward moves, so a few of its 3-action episodes reach the red ball (reward 1.5 with progress
shaping) and the others do not (measured: 1 of phase 0's 16 episodes, 4 of phase 1's; the check
asserts phase 1's, the one the resume depends on).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hf_fixtures import build_model, chatml_tokenizer, llama_config, model_overrides, save_checkpoint
from test_train_loop import REPO, _env, _finish

from agentrefine_jax import objective_table
from agentrefine_jax.config import load_config
from agentrefine_jax.eval import core
from agentrefine_jax.eval.loop import ChatProtocol
from agentrefine_jax.eval.policies import OraclePolicy, RandomPolicy
from agentrefine_jax.eval.react import parse_action
from agentrefine_jax.rl.batch import Rollout
from agentrefine_jax.rl.journal import JournalError, Phase, RolloutJournal, keep_phases
from agentrefine_jax.rl.rollout import phase_jobs
from agentrefine_jax.train.run_dir import RunPaths, TrainingInputError

# The objective that learns from rollouts (objective names live in the table).
ROLLOUTS = next(o.name for o in objective_table.TABLE if o.rollouts)
SETTINGS = [
    *("--set", f"train.objective={ROLLOUTS}"),
    *("--set", "train.max_steps=4"),  # 2 phases x 2 updates
    *("--set", "train.checkpoint_every=1"),
    *("--set", "train.export_hf_at_end=none"),
    *("--set", "data.max_length=512"),  # an episode: ~330 tokens
    *("--set", "rl.worlds_per_phase=2"),
    *("--set", "rl.group_size=2"),
    *("--set", "rl.max_turns=2"),
    *("--set", "rl.max_new_tokens=8"),
    *("--set", "rl.updates_per_phase=2"),
]
# The learning run (the fixture `policy` plays and tunes on the same worlds): BabyAI's training
# worlds from seed 26 (phase 0: a GoToRedBallGrey and a GoToRedBall world, phase 1 two more), where
# the tuned policy's 3 actions reach the ball in some episodes of a group and not in others.
RUN_RL = [
    "rl.task=babyai",
    "rl.seed=26",
    "rl.worlds_per_phase=2",
    "rl.group_size=8",
    "rl.max_turns=3",
    "rl.max_new_tokens=8",  # "Action: move forward" and the end token: 5
    "rl.reward=progress",
    "rl.updates_per_phase=2",
]
TUNING_EPISODES = 4  # per world and actor, for the starting policy's tuning
TUNING_STEPS, TUNING_BATCH = 10, 4
RUN = [*SETTINGS, *(a for s in ["data.max_length=1024", *RUN_RL] for a in ("--set", s))]  # ~560 tokens
TIMINGS = {"tokens_per_sec", "mfu", "rollout_seconds", "rollout_tokens_per_sec", "train_tokens_per_sec"}
TIMEOUT = 300


def _rl(run_dir: pathlib.Path, policy: pathlib.Path, fault: str | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "agentrefine_jax.rl", "--config", "tiny", *RUN]
    cmd += [a for s in [*model_overrides(policy), f"train.init_from_hf={policy}"] for a in ("--set", s)]
    env = _env(run_dir)
    if fault:
        env["AGENTREFINE_FAULT"] = fault
    proc = subprocess.Popen(
        [*cmd, "--set", f"train.run_dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return _finish(proc, timeout=TIMEOUT)


def _episodes(workdir: pathlib.Path) -> list[list[dict]]:
    """The reference solver's and the random actor's episodes on the run's worlds (both phases), as
    the engine plays them under the chat protocol, each reply cut to its `Action:` line."""
    cfg = load_config("tiny", [*RUN_RL, f"rl.group_size={TUNING_EPISODES}"])
    out = []
    for phase in (0, 1):
        for actor in (OraclePolicy(), RandomPolicy()):
            worlds, jobs = phase_jobs(cfg, phase, str(workdir))
            try:
                played = core.run_episodes(jobs, ChatProtocol(actor, len(jobs)))
            finally:
                worlds.close()
            for e in played:
                out.append(
                    [
                        {**m, "content": f"Action: {parse_action(m['content'])}", "loss": True}
                        if m["role"] == "assistant"
                        else m
                        for m in e.messages
                    ]
                )
    return out


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> pathlib.Path:
    """The starting policy (module docstring): a tiny ChatML Llama tuned by the trainer for 10
    steps on the engine's episodes of the run's worlds; its Hugging Face export."""
    root = tmp_path_factory.mktemp("policy")
    episodes = _episodes(root)
    base = root / "base"
    tok = chatml_tokenizer(
        base, [m["content"] for e in episodes for m in e], vocab_size=1000, bos="<|im_start|>"
    )
    config = llama_config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    save_checkpoint(build_model(config, seed=3), base)
    data = root / "episodes.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"e{i}", "messages": e}) + "\n" for i, e in enumerate(episodes))
    )
    run = root / "sft"
    sets = [
        *model_overrides(base), "model.remat_policy=none", f"train.init_from_hf={base}",
        f"train.run_dir={run}", f"data.train_files={json.dumps([str(data)])}", "data.eval_files=[]",
        "data.max_length=1024", "train.eval_every=0", f"train.max_steps={TUNING_STEPS}",
        f"train.num_epochs={TUNING_STEPS}", f"train.global_batch_size={TUNING_BATCH}",
        f"train.checkpoint_every={TUNING_STEPS}", "train.export_hf_at_end=hf", "optim.learning_rate=0.03",
        "optim.schedule=constant",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny"]
    proc = subprocess.Popen(
        [*cmd, *(a for s in sets for a in ("--set", s))],
        cwd=REPO,
        env=_env(run),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    code, out = _finish(proc, timeout=TIMEOUT)
    assert code == 0, out
    return run / "hf"


def _rows(run_dir: pathlib.Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMINGS} for x in lines]


def _state(run_dir: pathlib.Path, step: int) -> dict:
    ckpt = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    return {i: ckpt.restore(run_dir / "checkpoints" / str(step) / i) for i in ("params", "opt_state")}


def _assert_learning_signal(rows: list[dict], phase: int = 1) -> None:
    """`phase` (default: the one the kill lands in) learned from rewards that differ within a group:
    its every update had non-zero advantages, loss and gradient, and its second update saw the
    policy its first had moved (the trainer's log-probabilities off the rollout's)."""
    (row,) = [r for r in rows if r.get("phase") == phase]
    assert row["reward_std"] > 0 and row["groups_with_signal"] > 0, row
    updates = [r for r in rows if "phase" not in r and (r["step"] - 1) // 2 == phase]
    assert len(updates) == 2, rows
    for r in updates:
        assert r["advantage_std"] > 0 and r["loss"] != 0 and r["grad_norm"] > 0, r
    assert updates[1]["max_abs_logp_delta"] > 1e-3, updates[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, policy) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("rl") / "reference"
    code, out = _rl(run_dir, policy)
    assert code == 0, out
    assert "Traceback" not in out, out
    return run_dir


def test_uninterrupted_run_logs_steps_and_phases(reference):
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "phase" not in r]
    phases = [r for r in rows if "phase" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [(r["step"], r["phase"]) for r in phases] == [(2, 0), (4, 1)]
    for r in phases:
        assert r["episodes"] == 16 and r["sampled_tokens"] > 0 and r["rollout_tokens_per_sec"] > 0
        assert 0 <= r["success_rate"] <= 1 and r["train_tokens_per_sec"] > 0
    assert all(r["loss_tokens"] > 0 for r in steps)
    _assert_learning_signal(rows)
    # The checkpoints kept (train.keep_checkpoints=3: steps 2, 3, 4) resume into phases 1 and 2:
    # phase 0's journal is gone, phase 1's kept.
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["2", "3", "4"]
    assert sorted(p.name for p in (reference / "rollouts").iterdir()) == ["phase_000001.jsonl"]


def test_sigkill_inside_a_phase_resumes_to_the_uninterrupted_run(reference, policy, tmp_path):
    run_dir = tmp_path / "run"
    # 1. Killed inside phase 1, once its first update's checkpoint (step 3) has committed.
    code, out = _rl(run_dir, policy, "after_commit@3:KILL")
    assert code == -9, out
    journal = run_dir / "rollouts" / "phase_000001.jsonl"
    written = journal.stat()
    # 2. Resumes at step 3, inside phase 1: its journaled episodes, its second mini-batch only.
    code, out = _rl(run_dir, policy)
    assert code == 0, out
    assert f"resumed from {run_dir / 'checkpoints'}/3" in out, out
    assert f"phase 1: 16 episodes read back from {journal}" in out, out
    kept = journal.stat()  # read, never played again (a new journal is a new file)
    assert (kept.st_ino, kept.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert "Traceback" not in out, out
    # The resumed step (4) learned from the journaled episodes' rewards: equal rows and
    # parameters compare a gradient step, not a no-op.
    _assert_learning_signal(_rows(run_dir))
    assert _rows(run_dir) == _rows(reference)
    got, want = _state(run_dir, 4), _state(reference, 4)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def _rollout(world: int, sample: int, lp: float) -> Rollout:
    return Rollout(
        world, sample, (5, 6, 7), (False, True, True), (0.0, lp, np.float32(-0.1)), (0.0,), False, 0.5, 1
    )


def test_journal_round_trips_a_phase_and_refuses_other_settings(tmp_path):
    cfg = load_config("tiny")
    journal = RolloutJournal(tmp_path, cfg.rl)
    played = Phase([_rollout(3, 0, -1 / 3), _rollout(3, 1, -2.5e-7)], 12.5)
    journal.write(2, played)
    back = journal.read(2)
    assert back is not None and back.seconds == 12.5
    assert back.rollouts == [
        dataclasses.replace(r, logprobs=tuple(map(float, r.logprobs))) for r in played.rollouts
    ]
    assert journal.read(1) is None and not list(tmp_path.joinpath("rollouts").glob("*tmp*"))
    other = RolloutJournal(tmp_path, dataclasses.replace(cfg.rl, group_size=8))
    with pytest.raises(JournalError, match=r"other rl settings \(group_size\)"):
        other.read(2)
    journal.write(5, played)
    journal.prune(keep_phases([9, 10], updates_per_phase=2, current=5))  # phases 4 and 5
    assert journal.phases() == [5]


def _main(module: str, capsys, *args: str) -> tuple[int, str]:
    code = importlib.import_module(module).main(list(args))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "extra, says",
    [
        (["train.max_steps=5"], "train.max_steps=5 is not a whole number of phases"),
        (["rl.worlds_per_phase=3", "rl.group_size=3"], "do not split into rl.updates_per_phase=2"),
        (["train.micro_batch_size=3", "rl.worlds_per_phase=3", "rl.group_size=2"], "micro_batch_size=3"),
        (["rl.group_size=1"], "rl.group_size"),
        (["rl.clip_low=1.5"], "rl.clip_low"),
        (["rl.task=nosuchtask"], "unknown task 'nosuchtask'"),
        (["rl.task=sciworld"], "has no training split"),
        (["rl.seed=999998"], "demo_world training worlds are seeds 0..999999"),  # the last phase leaves them
    ],
)
def test_bad_rl_settings_are_one_line_exit_2(capsys, tmp_path, extra, says):
    args = ["--config", "tiny", *SETTINGS, "--set", f"train.run_dir={tmp_path}", "--print-config"]
    code, err = _main("agentrefine_jax.rl.cli", capsys, *args, *[x for e in extra for x in ("--set", e)])
    assert code == 2 and says in err and len(err.splitlines()) == 1, err


def test_rl_prints_the_derived_batch_and_refuses_a_data_objective(capsys, tmp_path):
    args = ["--config", "tiny", *SETTINGS, "--set", f"train.run_dir={tmp_path}"]
    code = importlib.import_module("agentrefine_jax.rl.cli").main([*args, "--print-config"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and printed["train"]["global_batch_size"] == 2  # 2 worlds x 2 episodes / 2 updates
    code, err = _main(
        "agentrefine_jax.rl.cli", capsys, *args, "--set", f"train.objective={objective_table.DEFAULT}"
    )
    assert code == 2 and "python -m agentrefine_jax.train" in err and len(err.splitlines()) == 1, err


def test_train_command_refuses_a_rollout_objective_naming_the_rl_command(capsys, tmp_path):
    args = ["--config", "tiny", "--set", f"train.objective={ROLLOUTS}", "--set", f"train.run_dir={tmp_path}"]
    code, err = _main("agentrefine_jax.train.cli", capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"train.objective={ROLLOUTS}" in err and "python -m agentrefine_jax.rl" in err, err


def test_resume_under_changed_rl_settings_is_refused(tmp_path):
    from agentrefine_jax.rl.loop import check_rl_resume

    cfg = load_config("tiny")
    paths = RunPaths(tmp_path)
    paths.write_config(cfg)
    check_rl_resume(paths, cfg)  # the same settings: fine
    changed = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, clip_high=0.4, seed=3))
    with pytest.raises(TrainingInputError, match=r"rl\.clip_high, rl\.seed changed"):
        check_rl_resume(paths, changed)
