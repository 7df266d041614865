"""`generate` end to end against the replay server: retries, regeneration from the verified
prefix, failures, usage accounting, restart-after-completion, then `convert` of the output."""

from __future__ import annotations

import io
import json

import pytest
from test_synth_common import (
    CONTINUE_STAGE,
    SCRIPT,
    SCRIPT_REPLY,
    bad_prefix_turns,
    dm,
    good_turns,
    persona_rules,
    player,
    read_jsonl,
    reply,
    script_reply,
)

from agentrefine_jax.synth import cli
from agentrefine_jax.synth.generate import (
    GenerateConfig,
    ScriptError,
    parse_script,
    parse_turns,
    run_generate,
)
from agentrefine_jax.synth.llm import LLMSettings
from agentrefine_jax.synth.personas import PACKAGED, load_personas, persona_id
from agentrefine_jax.synth.replay_server import ReplayServer

SECRET = "sk-generate-secret-77a1"


def _no_error_turns():
    return [
        dm("Kitchen."),
        player("Open it.", "open fridge"),
        dm("Open."),
        player("Cook.", "cook egg in pan"),
        dm("Served.", success=True),
    ]


def _cfg(tmp_path, server, personas, **kw):
    llm = LLMSettings(
        base_url=server.url,
        model="traj-model",
        api_key_env="SYNTH_GEN_KEY",
        backoff_base=0.001,
        backoff_max=0.01,
        max_api_retries=3,
    )
    script_llm = LLMSettings(**{**llm.__dict__, "model": "script-model"})
    return GenerateConfig(
        personas=personas,
        out_dir=tmp_path / "out",
        script_llm=script_llm,
        trajectory_llm=llm,
        concurrency=3,
        max_retries=2,
        **kw,
    )


def test_generate_retries_regenerates_from_prefix_and_accounts_for_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNTH_GEN_KEY", SECRET)
    personas = tmp_path / "personas.jsonl"
    personas.write_text(
        "\n".join(
            [
                json.dumps({"persona": "QQ-ALPHA, a careful home cook."}),  # Persona Hub layout, no id
                json.dumps({"input persona": "QQ-BRAVO, a hungry student.", "synthesized text": "..."}),
                json.dumps({"id": "charlie", "persona": "QQ-CHARLIE, a chef."}),
                json.dumps({"id": "delta", "persona": "QQ-DELTA, a reckless cook."}),
                "{broken",
                json.dumps({"persona": "QQ-ALPHA, a careful home cook."}),  # duplicate
            ]
        )
        + "\n"
    )
    bad = bad_prefix_turns()
    never = good_turns()
    never[1] = player("Hmm.", "teleport egg")  # unflagged invalid action at turn 1, every time
    never[2] = dm("Nothing happens.")
    rules = (
        persona_rules("QQ-ALPHA", script=[script_reply()], fresh=[reply({"turns": good_turns()})])
        + persona_rules(
            "QQ-BRAVO",
            script=[reply("I think the script is: {environment: kitchen}"), {"status": 429}, script_reply()],
            fresh=[reply({"turns": bad}, completion_tokens=300)],
            # The continuation repeats nothing and supplies turns 5.. of the good trajectory.
            cont=[reply({"turns": good_turns()[5:]}, completion_tokens=200)],
        )
        + persona_rules(
            "QQ-CHARLIE",
            script=[script_reply()],
            fresh=[
                reply('```json\n{"turns": [{"role": "dm", "observation": "cut off'),
                reply({"turns": _no_error_turns()}),
                reply({"turns": good_turns()}),
            ],
        )
        + [
            dict(r, repeat_last=True)
            for r in persona_rules(
                "QQ-DELTA",
                script=[script_reply()],
                fresh=[reply({"turns": never})],
                cont=[reply({"turns": never[1:]})],
            )
        ]
    )
    stream = io.StringIO()
    with ReplayServer(rules) as server:
        report = run_generate(_cfg(tmp_path, server, personas), progress_stream=stream)
        requests = list(server.requests)

        out = tmp_path / "out"
        ids = {p.text.split(",")[0]: p.id for p in load_personas(personas).personas}
        assert ids["QQ-ALPHA"] == persona_id("QQ-ALPHA, a careful home cook.")
        assert (report.total, report.succeeded, report.failed, report.unfinished) == (4, 3, 1, 0)
        assert report.persona_skips == {"invalid_json": 1, "duplicate": 1} and report.exit_code == 0
        assert all(r["rule"] is not None for r in requests), "a request matched no recorded reply"

        results = {r["id"]: r for r in read_jsonl(out / "trajectories.jsonl")}
        assert set(results) == {ids["QQ-ALPHA"], ids["QQ-BRAVO"], "charlie"}
        for r in results.values():
            assert r["script"] == SCRIPT and r["turns"] == good_turns()
            assert r["meta"]["model"] == "traj-model" and r["meta"]["script_model"] == "script-model"

        # BRAVO: unusable script, then a 429, then a script; the trajectory failed Algorithm 1 at
        # turn 5 and the regeneration continued from exactly those 5 verified turns.
        bravo = results[ids["QQ-BRAVO"]]
        assert bravo["meta"]["script_attempts"] == 2
        assert [(h["prefix_turns"], h["reason"], h["verified_turns"]) for h in bravo["meta"]["history"]] == [
            (0, "invalid_action", 5),
            (5, "ok", 13),
        ]
        cont = [r for r in requests if r["rule"] == "QQ-BRAVO/continue"]
        assert len(cont) == 1
        assert json.dumps(bad[:5], ensure_ascii=False, indent=2) in cont[0]["text"]
        assert "grab egg" not in cont[0]["text"].split("accepted and stay as they are")[1]
        assert [r["rule"] for r in requests if r["rule"] == "QQ-BRAVO/script"] == ["QQ-BRAVO/script"] * 3
        assert bravo["meta"]["usage"]["completion_tokens"] == 50 + 50 + 300 + 200
        assert bravo["meta"]["usage"]["calls"] == 4

        # CHARLIE: a truncated reply is retried; a trajectory with no error restarts from scratch
        # (paper's note to Algorithm 1), so no continuation request is ever made.
        charlie = results["charlie"]
        assert [(h["prefix_turns"], h["reason"]) for h in charlie["meta"]["history"]] == [
            (0, "malformed_reply"),
            (0, "no_error"),
            (0, "ok"),
        ]
        assert not [r for r in requests if r["rule"] == "QQ-CHARLIE/continue"]

        # DELTA exhausted 1 + max_retries attempts and is recorded, with its last attempt.
        (failed,) = read_jsonl(out / "failed.jsonl")
        assert failed["id"] == "delta" and failed["reason"] == "invalid_action"
        assert failed["verified_turns"] == 1 and failed["last_turns"][1]["action"] == "teleport egg"
        assert len(failed["meta"]["history"]) == 3
        assert sum(CONTINUE_STAGE in r["text"] for r in requests if r["rule"] == "QQ-DELTA/continue") == 2

        # Token accounting: the run total equals the sum of every 200 reply's usage.
        summary = json.loads((out / "summary.json").read_text())
        served = [r["reply"]["usage"] for r in requests if r["reply"] and "usage" in r["reply"]]
        assert summary["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in served)
        assert summary["usage"]["completion_tokens"] == sum(u["completion_tokens"] for u in served)
        assert summary["usage"]["calls"] == len(served)
        assert "tokens=" in stream.getvalue() and "done=3 failed=1" in stream.getvalue()
        assert not list((out / "state").iterdir())

        # A second run over a finished directory sends nothing and duplicates nothing.
        n_before = len(server.requests)
        again = run_generate(_cfg(tmp_path, server, personas), progress_stream=io.StringIO())
        assert again.done_before == 4 and again.succeeded == again.failed == 0
        assert len(server.requests) == n_before
        assert len(read_jsonl(out / "trajectories.jsonl")) == 3 and len(read_jsonl(out / "failed.jsonl")) == 1

    # The key was sent but appears in no output or log.
    assert all(r["authorization"] == f"Bearer {SECRET}" for r in requests)
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text()
    assert SECRET not in stream.getvalue()

    # convert: only verified trajectories, loss false exactly on the DM-flagged Player turns.
    train = tmp_path / "train.jsonl"
    assert cli.main(["convert", "--input", str(out / "trajectories.jsonl"), "--out", str(train)]) == 0
    rows = read_jsonl(train)
    assert len(rows) == 3
    for row in rows:
        assert [m["loss"] for m in row["messages"] if m["role"] == "assistant"] == [
            False,
            True,
            True,
            False,
            True,
            True,
        ]


def test_fatal_api_error_stops_the_run_and_keeps_state(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNTH_GEN_KEY", SECRET)
    personas = tmp_path / "p.txt"
    personas.write_text("QQ-ECHO, a baker.\n\nQQ-FOXTROT, a fisher.\n")
    rules = [{"name": "auth", "match": ["QQ-"], "replies": [{"status": 401}], "repeat_last": True}]
    with ReplayServer(rules) as server:
        cfg = _cfg(tmp_path, server, personas)
        cfg.concurrency = 1
        stream = io.StringIO()
        report = run_generate(cfg, progress_stream=stream)
    assert report.fatal and "HTTP 401" in report.fatal and report.exit_code == 2
    assert len(server.requests) == 1  # stopped at once: no request for the second persona
    assert report.unfinished == 2 and not (tmp_path / "out" / "trajectories.jsonl").exists()
    assert SECRET not in stream.getvalue()


def test_parse_turns_splices_continuations_safely():
    prefix = good_turns()[:5]  # ends with a DM turn
    rest = good_turns()[5:]
    assert parse_turns({"turns": rest}, prefix) == rest
    assert parse_turns(rest, prefix) == rest  # a bare list is accepted
    assert parse_turns({"turns": prefix + rest}, prefix) == rest  # an exact repeat is stripped
    restated = [dict(t) for t in good_turns()]
    restated[0]["observation"] = "You stand in a kitchen."  # a reworded restart from turn 0
    with pytest.raises(ValueError, match="starts with a dm turn right after a dm turn"):
        parse_turns({"turns": restated}, prefix)
    for bad in ({"turns": []}, {"turns": prefix}, {"steps": rest}, "text"):
        with pytest.raises(ValueError):
            parse_turns(bad, prefix)


def test_parse_script_normalizes_and_rejects():
    s = parse_script({**json.loads(json.dumps(SCRIPT_REPLY)), "extra": 1})
    assert s == SCRIPT
    s = parse_script({"environment": " E ", "task": "T", "available_actions": ["look", "look", "go {dir}"]})
    assert s == {"environment": "E", "task": "T", "available_actions": ["look", "go {dir}"]}
    for bad in (
        {"environment": "E", "task": "", "available_actions": ["look"]},
        {"environment": "E", "task": "T", "available_actions": []},
        {"environment": "E", "task": "T", "available_actions": ["go {dir"]},
        {"environment": "E", "task": "T", "available_actions": [{"description": "no template"}]},
        ["not", "an", "object"],
    ):
        with pytest.raises(ScriptError):
            parse_script(bad)


def test_packaged_personas_load_with_stable_ids():
    loaded = load_personas(PACKAGED)
    assert len(loaded.personas) >= 20 and loaded.skipped == {}
    n = len(loaded.personas)
    assert len({p.id for p in loaded.personas}) == len({p.text for p in loaded.personas}) == n
