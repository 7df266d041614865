"""An evaluation survives a kill: real `python -m agentrefine_jax.eval` processes killed (SIGKILL, SIGTERM)
at a chosen episode by the fault hook, then rerun with the same command; the results equal an uninterrupted
run's."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from agentrefine_jax.eval.journal import FORMAT, NAME_BYTES, Journal, journal_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A cheap built-in task and a deterministic policy (the random policy draws from per-episode seeds).
ARGS = [
    "--policy",
    "random",
    "--tasks",
    "babyai",
    "--episodes",
    "6",
    "--max-steps",
    "12",
    "--batch-size",
    "2",
]


def _eval(out: pathlib.Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTREFINE_FAULT", None)
    if fault:
        env["AGENTREFINE_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", *ARGS, *extra, "--out", str(out)],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _timeless(x):
    """The results without wall times and sittings (the only things a resumed run may change)."""
    if isinstance(x, dict):
        return {k: _timeless(v) for k, v in x.items() if k not in ("seconds", "sittings")}
    if isinstance(x, list):
        return [_timeless(v) for v in x]
    return x


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("whole") / "r.json"
    done = _eval(out)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(journal_path(str(out)))  # the results are written: the journal is gone
    return _timeless(json.loads(out.read_text()))


@pytest.mark.timeout(600)
def test_sigkill_mid_run_then_rerun_equals_uninterrupted(tmp_path, uninterrupted):
    out = tmp_path / "r.json"
    killed = _eval(out, fault="after_episode@3:KILL")
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()  # --out only at the end
    lines = pathlib.Path(journal_path(str(out))).read_text().splitlines()
    assert len(lines) == 1 + 3 and json.loads(lines[0])["journal"].startswith("agentrefine_jax.eval/journal")
    entries = [json.loads(line) for line in lines[1:]]
    assert [e["sitting"] for e in entries] == [1, 1, 1]
    elapsed = [e["elapsed"] for e in entries]
    assert elapsed == sorted(elapsed) and elapsed[-1] > 0  # the first sitting's time when each episode ended

    resumed = _eval(out)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 3 finished episodes" in resumed.stderr
    assert resumed.stderr.count("babyai original episode") == 3  # only the other three ran
    doc = json.loads(out.read_text())
    assert _timeless(doc) == uninterrupted
    # The time is both sittings' (the first counted to its last kept episode), not the second's alone.
    assert doc["sittings"] == 2 and doc["seconds"] > elapsed[-1]
    assert not os.path.exists(journal_path(str(out)))


@pytest.mark.timeout(600)
def test_sigterm_exits_75_keeping_finished_episodes(tmp_path, uninterrupted):
    out = tmp_path / "r.json"
    stopped = _eval(out, fault="after_episode@2:TERM")
    assert stopped.returncode == 75
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "[eval] terminated (SIGTERM): 2 finished episodes kept in "
    ) and "Traceback" not in (stopped.stderr)
    assert not out.exists()
    # Another command on the same --out is refused with one line, the journal untouched.
    other = _eval(out, "--seed", "5")
    assert other.returncode == 2 and other.stderr.count("\n") == 1
    assert "different command or configuration" in other.stderr
    assert len(pathlib.Path(journal_path(str(out))).read_text().splitlines()) == 3

    resumed = _eval(out)
    assert resumed.returncode == 0, resumed.stderr
    assert _timeless(json.loads(out.read_text())) == uninterrupted


def test_journal_name_is_bounded_and_a_cut_line_is_dropped(tmp_path):
    long_out = str(tmp_path / ("r" * 245 + ".json"))  # a 250-character name
    name = os.path.basename(journal_path(long_out))
    assert len(name.encode()) <= NAME_BYTES + 40 and name.endswith(".journal.jsonl")
    assert journal_path(str(tmp_path / ("r" * 244 + "x.json"))) != journal_path(long_out)
    assert os.path.basename(journal_path(str(tmp_path / "r.json"))) == "r.json.journal.jsonl"

    path = str(tmp_path / "j.jsonl")
    j = Journal(path, {"a": 1})
    j.append(["t", 0], {"x": 1})
    j.append(["t", 1], {"x": 2})
    j.close()
    with open(path, "a") as f:
        f.write('{"key": "[\\"t\\", 2]", "rec')  # a kill in the middle of a line
    again = Journal(path, {"a": 1})
    assert again.resumed == 2 and again.get(["t", 1]) == {"x": 2} and again.get(["t", 2]) is None
    again.append(["t", 2], {"x": 3})
    again.close()
    assert Journal(path, {"a": 1}).resumed == 3


def test_sittings_add_up_and_an_untimed_line_makes_the_total_unknown(tmp_path):
    """Each sitting counts up to its last journaled episode; a new sitting numbers itself after them; a line
    of an older version (no timing) leaves the total unknown rather than too small."""
    path = tmp_path / "j.jsonl"
    lines = [{"journal": FORMAT, "settings": {"a": 1}}]
    lines += [{"key": f'["t", {i}]', "record": {}, "sitting": s, "elapsed": e}
              for i, (s, e) in enumerate([(1, 10.0), (1, 40.5), (2, 7.0), (2, 30.0)])]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    j = Journal(str(path), {"a": 1})
    assert (j.resumed, j.prior_sittings, j.sitting, j.prior_seconds) == (4, 2, 3, 70.5)
    assert j.total_seconds(12.25) == 82.8
    j.append(["t", 9], {})
    j.close()
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["sitting"] == 3 and last["elapsed"] >= 0
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"key": '["t", 0]', "record": {}}) + "\n")
    o = Journal(str(old), {"a": 1})
    assert (o.resumed, o.prior_sittings, o.prior_seconds, o.total_seconds(5.0)) == (1, 1, None, None)


def test_a_journal_write_failure_warns_once_and_the_run_goes_on(tmp_path):
    """A full disk (here: the file-size limit, EFBIG) must not lose the evaluation."""
    code = f"""
import logging, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
logging.basicConfig(stream=sys.stderr)
from agentrefine_jax.eval.journal import Journal
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
j = Journal({str(tmp_path / "j.jsonl")!r}, {{"a": 1}})
for i in range(20):
    j.append(["t", i], {{"text": "x" * 1000}})
assert len(j.records) == 20 and j.failed
print("went on")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "went on"
    assert done.stderr.count("cannot write the journal") == 1


@pytest.mark.timeout(600)
def test_ctrl_c_exits_130_keeping_the_journal(tmp_path, uninterrupted):
    out = tmp_path / "r.json"
    stopped = _eval(out, fault="after_episode@2:INT")
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr
    assert len(pathlib.Path(journal_path(str(out))).read_text().splitlines()) == 1 + 2
    resumed = _eval(out)
    assert resumed.returncode == 0, resumed.stderr
    assert _timeless(json.loads(out.read_text())) == uninterrupted


@pytest.mark.timeout(600)
def test_a_binary_line_is_one_line_naming_the_journal(tmp_path):
    out = tmp_path / "r.json"
    assert _eval(out, fault="after_episode@2:KILL").returncode == -signal.SIGKILL
    journal = pathlib.Path(journal_path(str(out)))
    with open(journal, "ab") as f:
        f.write(b"\xff\xfe\x00binary\n")  # complete (ends in a newline), so it is read, not dropped
    res = _eval(out)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("[eval] error: ") and f"{journal}:4: not a journal record" in res.stderr


# --checkpoint RUN_DIR: the newest step when the eval starts. A tiny random model answers garbage, so every
# episode runs its 2 steps; one episode at a time, so the kill falls after the third.
MODEL_ARGS = ["--tasks", "babyai", "--episodes", "4", "--max-steps", "2", "--max-new-tokens", "8"]
MODEL_ARGS += ["--batch-size", "1"]


def _save_step(root: pathlib.Path, step: int, seed: int) -> None:
    from flax import nnx

    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.models import llama
    from agentrefine_jax.models.config import preset

    cfg = preset("tiny", max_position_embeddings=512)
    model = nnx.jit(lambda: llama.create(cfg, seed))()
    save_model(root, model, cfg, step=step, tokenizer="llama3", template="llama3")


def _eval_model(out: pathlib.Path, checkpoint: pathlib.Path, fault: str | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTREFINE_FAULT", None)
    if fault:
        env["AGENTREFINE_FAULT"] = fault
    cmd = [sys.executable, "-m", "agentrefine_jax.eval", "--checkpoint", str(checkpoint), *MODEL_ARGS]
    return subprocess.run(
        [*cmd, "--out", str(out)], env=env, cwd=out.parent, capture_output=True, text=True, timeout=600
    )


@pytest.mark.timeout(1500)
def test_a_resume_against_a_newer_step_of_the_run_is_refused(tmp_path):
    """Issue 44: killed after 3 episodes of step 3, rerun once the run saved step 6: it resumed and wrote
    3 episodes of step 3 and the rest of step 6 into one result, exit 0, naming no step."""
    run_dir, out = tmp_path / "run", tmp_path / "r.json"
    root = run_dir / "checkpoints"
    _save_step(root, 3, seed=0)
    killed = _eval_model(out, run_dir, fault="after_episode@3:KILL")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    journal = pathlib.Path(journal_path(str(out)))
    kept = journal.read_bytes()

    _save_step(root, 6, seed=1)  # the run goes on training meanwhile
    refused = _eval_model(out, run_dir)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
    line = refused.stderr
    assert line.startswith(f"[eval] error: {journal} holds episodes of {root / '3'} (step 3, parameters ")
    assert f"this run evaluates {root / '6'} (step 6, " in line
    assert f"rerun with --checkpoint {root / '3'} to resume it" in line
    assert journal.read_bytes() == kept and not out.exists()
    from agentrefine_jax.checkpoint import params_fingerprint

    header = json.loads(kept.splitlines()[0])
    assert header["model"] == {
        "checkpoint": str(root / "3"),
        "step": 3,
        "fingerprint": params_fingerprint(root, 3),
    }

    resumed = _eval_model(out, root / "3")  # the step the journal began, named
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming: 3 finished episodes" in resumed.stderr
    doc = json.loads(out.read_text())
    assert doc["model"] == header["model"] and len(doc["episodes"]) == 4

    fresh = tmp_path / "fresh.json"  # no journal: the newest step, recorded
    done = _eval_model(fresh, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    model = json.loads(fresh.read_text())["model"]
    assert model["step"] == 6 and model["fingerprint"] == params_fingerprint(root, 6)
    assert model["fingerprint"] != header["model"]["fingerprint"]
