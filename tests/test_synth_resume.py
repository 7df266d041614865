"""Kill-and-restart: `python -m agentrefine_jax.synth generate` is SIGKILLed mid-run, restarted,
interrupted with Ctrl-C (SIGINT), restarted again; nothing is lost or duplicated and in-flight
work resumes from its saved verified prefix / script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from test_synth_common import (
    CONTINUE_STAGE,
    FRESH_STAGE,
    SCRIPT_STAGE,
    bad_prefix_turns,
    good_turns,
    persona_rules,
    read_jsonl,
    reply,
    script_reply,
)

from agentrefine_jax.synth import jsonl
from agentrefine_jax.synth.replay_server import ReplayServer

SECRET = "sk-resume-secret-0b3e"
HANG = {"hang": True}


def _start(server, personas, out):
    env = {**os.environ, "OPENAI_API_KEY": SECRET, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "agentrefine_jax.synth",
        "generate",
        "--personas",
        str(personas),
        "--out",
        str(out),
        "--base-url",
        server.url,
        "--model",
        "m",
        "--concurrency",
        "2",
        "--max-retries",
        "2",
        "--backoff-base",
        "0.001",
        "--backoff-max",
        "0.01",
        "--timeout",
        "30",
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(cond, proc, timeout=180.0):  # generous: a busy 2-core machine starts Python slowly
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"generate exited early ({proc.returncode}):\n{proc.communicate()[1]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out; stderr:\n{proc.communicate()[1]}")


def _ids(path):
    return [r["id"] for r in read_jsonl(path)] if path.exists() else []


def test_generate_survives_sigkill_and_sigint_without_loss_or_duplicates(tmp_path):
    names = [f"QQ-P{i}" for i in range(1, 7)]
    personas = tmp_path / "personas.jsonl"
    rows = [json.dumps({"id": n.lower(), "persona": f"{n}, a cook."}) for n in names]
    personas.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    results, state_dir = out / "trajectories.jsonl", out / "state"
    good = {"turns": good_turns()}
    rules = (
        persona_rules("QQ-P1", script=[script_reply()], fresh=[reply(good)])
        + persona_rules("QQ-P2", script=[script_reply()], fresh=[reply(good)])
        # P3 fails Algorithm 1 at turn 5, then its continuation hangs until the kill.
        + persona_rules(
            "QQ-P3",
            script=[script_reply()],
            fresh=[reply({"turns": bad_prefix_turns()})],
            cont=[HANG, reply({"turns": good_turns()[5:]})],
        )
        + persona_rules("QQ-P4", script=[HANG, script_reply()], fresh=[reply(good)])
        # P5's first trajectory request hangs until Ctrl-C in the second run.
        + persona_rules("QQ-P5", script=[script_reply()], fresh=[HANG, reply(good)])
        + persona_rules("QQ-P6", script=[script_reply()], fresh=[reply(good)])
    )

    def sent(requests, token, stage):
        return [r for r in requests if token in r["text"] and stage in r["text"]]

    with ReplayServer(rules) as server:
        # Run 1: P1, P2 finish; P3 hangs mid-regeneration, P4 mid-script. SIGKILL.
        proc = _start(server, personas, out)
        _wait(
            lambda: (
                len(_ids(results)) == 2
                and sent(server.requests, "QQ-P3", CONTINUE_STAGE)
                and sent(server.requests, "QQ-P4", SCRIPT_STAGE)
            ),
            proc,
        )
        proc.send_signal(signal.SIGKILL)
        _, err1 = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        assert sorted(_ids(results)) == ["qq-p1", "qq-p2"]
        saved = json.loads((state_dir / "qq-p3.json").read_text())
        assert saved["prefix"] == bad_prefix_turns()[:5] and saved["script"]["task"]
        n1 = len(server.requests)

        # Run 2: resumes P3 from its saved prefix; P5 hangs; Ctrl-C once P4 and P6 are done.
        proc = _start(server, personas, out)
        _wait(lambda: len(_ids(results)) == 5 and sent(server.requests, "QQ-P5", FRESH_STAGE), proc)
        proc.send_signal(signal.SIGINT)
        _, err2 = proc.communicate(timeout=120)
        assert proc.returncode == 130, err2
        assert "interrupted" in err2
        assert "2 already finished, 1 resuming in-flight, 3 new" in err2
        run2 = server.requests[n1:]
        assert not [r for r in run2 if "QQ-P1" in r["text"] or "QQ-P2" in r["text"]]
        p3 = [r for r in run2 if "QQ-P3" in r["text"]]
        assert len(p3) == 1 and CONTINUE_STAGE in p3[0]["text"]  # no new script, no fresh start
        assert json.dumps(saved["prefix"], ensure_ascii=False, indent=2) in p3[0]["text"]
        assert (state_dir / "qq-p5.json").exists()
        n2 = len(server.requests)

        # Run 3: P5 resumes with its saved script; everything is finished exactly once.
        proc = _start(server, personas, out)
        _, err3 = proc.communicate(timeout=180)
        assert proc.returncode == 0, err3
        assert "5 already finished, 1 resuming in-flight, 0 new" in err3
        run3 = server.requests[n2:]
        assert [r["rule"] for r in run3] == ["QQ-P5/fresh"]
        assert all(r["rule"] is not None for r in server.requests)

    ids = _ids(results)
    assert sorted(ids) == [n.lower() for n in names] and len(ids) == len(set(ids))
    assert not (out / "failed.jsonl").exists() and not list(state_dir.iterdir())
    by_id = {r["id"]: r for r in read_jsonl(results)}
    assert all(r["turns"] == good_turns() for r in by_id.values())
    p3_meta = by_id["qq-p3"]["meta"]
    assert [(h["prefix_turns"], h["reason"], h["resumes"]) for h in p3_meta["history"]] == [
        (0, "invalid_action", 0),
        (5, "ok", 1),
    ]
    assert by_id["qq-p5"]["meta"]["resumes"] == 1 and by_id["qq-p5"]["meta"]["script_attempts"] == 1
    for text in (err1, err2, err3, *(p.read_text() for p in out.rglob("*") if p.is_file())):
        assert SECRET not in text


def test_torn_tail_from_a_kill_is_repaired_and_not_counted(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    jsonl.append_record(path, {"id": "a"})
    with open(path, "a") as f:
        f.write('{"id": "b", "turns": [')  # a write cut short by a crash
    records, torn, corrupt = jsonl.read_records(path)
    assert [r["id"] for r in records] == ["a"] and (torn, corrupt) == (1, 0)
    jsonl.append_record(path, {"id": "b"})
    assert [r["id"] for r in read_jsonl(path)] == ["a", "b"]
