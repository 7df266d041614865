"""Every kill of a training run is resumable: real trainer processes, killed by a real signal at
each named point of a checkpoint save (agentrefine_jax.faults), then re-run with the same command.

The runs keep one checkpoint (train.keep_checkpoints=1): when step k's save commits, Orbax deletes
the older step, and the very first save has nothing older at all. Each chain kills the save of
step 2 (the first checkpoint) and then, after resuming, the save of step 4 (whose commit deletes
step 2); the last run finishes. Its losses, parameters and optimizer state must equal the
uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_train_loop import _finish, _losses, _train

import agentrefine_jax
from agentrefine_jax.checkpoint import MANIFEST, verify_step

SMALL_DATA = pathlib.Path(agentrefine_jax.__file__).parent / "data" / "demo" / "eval.jsonl"  # 40 rows
RUN = [  # with test_train_loop.FAST: 6 steps of 2 x 256 tokens, a checkpoint every 2, only the newest kept
    *("--set", f"data.train_files={SMALL_DATA}"),
    *("--set", "train.max_steps=6"),
    *("--set", "train.keep_checkpoints=1"),
    *("--set", "train.export_hf_at_end=none"),
]
TIMEOUT = 300


def _run(run_dir: pathlib.Path, fault: str | None = None, *extra: str) -> tuple[int, str]:
    return _finish(_train(run_dir, *RUN, *extra, fault=fault), timeout=TIMEOUT)


def _state(run_dir: pathlib.Path, step: int) -> dict:
    ckpt = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    return {
        item: ckpt.restore(run_dir / "checkpoints" / str(step) / item) for item in ("params", "opt_state")
    }


def _assert_same_run(run_dir: pathlib.Path, reference: pathlib.Path) -> None:
    assert _losses(run_dir) == _losses(reference)
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [6], steps
    verify_step(run_dir / "checkpoints" / "6")  # complete, with its manifest
    got, want = _state(run_dir, 6), _state(reference, 6)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def _no_traceback(out: str) -> None:
    assert "Traceback" not in out and "Event loop is closed" not in out, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    code, out = _run(run_dir)
    assert code == 0, out
    _no_traceback(out)
    return run_dir


@pytest.mark.parametrize("point", ["before_commit", "after_commit", "during_manifest"])
def test_sigkill_at_each_point_of_a_save_resumes_to_the_same_run(reference, tmp_path, point) -> None:
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    # 1. The first checkpoint: nothing older exists.
    code, out = _run(run_dir, f"{point}@2:KILL")
    assert code == -9, out
    committed = point != "before_commit"
    assert (ck / "2").is_dir() == committed
    assert not (ck / "2" / MANIFEST).exists()
    # 2. Re-run: resumes from step 2 when Orbax committed it (re-hashing it), else starts over;
    #    killed again at the same point of step 4's save, whose commit deletes step 2.
    code, out = _run(run_dir, f"{point}@4:KILL")
    assert code == -9, out
    if committed:
        assert f"resumed from {ck}/2" in out and f"{ck}/2 had no {MANIFEST}" in out, out
    else:
        assert "resumed from" not in out and "no intact checkpoint" not in out, out
        assert not [p for p in ck.iterdir() if "tmp" in p.name and p.name.startswith("2.")]  # cleaned up
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == (["4"] if committed else ["2"])
    # 3. Re-run to the end: resumes from the newest committed step, ends as if never killed.
    code, out = _run(run_dir)
    assert code == 0, out
    _no_traceback(out)
    assert f"resumed from {ck}/{4 if committed else 2}" in out, out
    _assert_same_run(run_dir, reference)


def test_sigterm_at_points_of_a_save_exits_75_and_resumes_to_the_same_run(reference, tmp_path) -> None:
    """SIGTERM (preemption) mid-save: the save completes, the run saves at the step boundary where
    it sees the signal (the one of the save, or a later one: the signal lands in Orbax's thread)
    and exits 75; the re-run resumes from there. SIGTERM during the final save: the run is done."""
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    code, out = _run(run_dir, "before_commit@2:TERM")  # the first checkpoint
    assert code == 75, out
    _no_traceback(out)
    saved = int(out.split("preempted: saved step ")[1].split()[0])
    assert 2 <= saved < 6, out
    verify_step(ck / str(saved))  # the save finished, manifest included, before the exit
    code, out = _run(run_dir, "during_manifest@6:TERM")  # the final save, whose commit deletes `saved`
    assert code == 0, out
    _no_traceback(out)
    assert f"resumed from {ck}/{saved}" in out, out
    _assert_same_run(run_dir, reference)


def test_sigterm_during_the_end_of_run_export_exits_75_and_leaves_no_partial_export(reference, tmp_path):
    run_dir = tmp_path / "run"
    export = ["--set", "train.export_hf_at_end=hf"]
    code, out = _run(run_dir, "during_export@6:TERM", *export)
    assert code == 75, out
    _no_traceback(out)
    assert "preempted during the end-of-run export" in out, out
    leftovers = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("hf") or "partial" in p.name)
    assert leftovers == [], leftovers
    # The re-run finds the training done and exports.
    code, out = _run(run_dir, None, *export)
    assert code == 0, out
    assert f"resumed from {run_dir}/checkpoints/6" in out
    assert json.loads((run_dir / "hf" / "config.json").read_text())["num_hidden_layers"] > 0
    _assert_same_run(run_dir, reference)
