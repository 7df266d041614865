"""Algorithm 1: one test per branch, action-slot matching, and the `verify` CLI."""

from __future__ import annotations

import json

import pytest
from test_synth_common import dm, good_turns, player, raw, read_jsonl

from agentrefine_jax.synth import cli
from agentrefine_jax.synth import verify as V
from agentrefine_jax.synth.verify import action_matches, verify_trajectory


def test_valid_trajectory_passes_with_every_turn_verified():
    r = verify_trajectory(raw())
    assert r == V.VerifyResult(True, 13, V.OK, r.detail)
    assert "2 flagged error(s)" in r.detail
    # Text and bytes are parsed first.
    assert verify_trajectory(json.dumps(raw())).ok
    assert verify_trajectory(json.dumps(raw()).encode()).ok


def test_broken_json():
    r = verify_trajectory('{"id": "x", "turns": [')
    assert (r.ok, r.verified_turns, r.reason) == (False, 0, V.INVALID_JSON)


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2],
        {"turns": []},
        {"script": {"available_actions": []}, "turns": []},
        {"script": {"available_actions": ["look"]}},
        {"script": {"available_actions": [3]}, "turns": []},
    ],
)
def test_bad_schema(obj):
    r = verify_trajectory(obj)
    assert (r.ok, r.verified_turns, r.reason) == (False, 0, V.BAD_SCHEMA)


def test_no_turns():
    r = verify_trajectory(raw(turns=[]))
    assert (r.ok, r.verified_turns, r.reason) == (False, 0, V.NO_TURNS)


def test_bad_action_not_flagged_by_dm_stops_at_that_turn():
    turns = good_turns()
    turns[5] = player("Grab it.", "grab egg")  # no such action
    r = verify_trajectory(raw(turns))  # next DM turn (6) has error False
    assert (r.ok, r.verified_turns, r.reason) == (False, 5, V.INVALID_ACTION)
    assert "grab egg" in r.detail


def test_bad_action_as_last_turn_has_no_dm_to_flag_it():
    turns = good_turns()[:12]
    turns[11] = player("Done?", "serve egg")
    r = verify_trajectory(raw(turns))
    assert (r.ok, r.verified_turns, r.reason) == (False, 11, V.INVALID_ACTION)


def test_bad_action_followed_by_player_turn_is_not_flagged():
    turns = good_turns()
    turns[6] = player("Again.", "take egg from fridge")  # the turn after the bad action is not a DM turn
    turns[5] = player("Grab it.", "grab egg")
    r = verify_trajectory(raw(turns))
    assert (r.verified_turns, r.reason) == (5, V.INVALID_ACTION)


def test_flagged_bad_action_is_verified_and_counts_as_error():
    turns = good_turns()
    assert not action_matches(turns[7]["action"], raw()["script"]["available_actions"])
    assert turns[8]["error"] is True
    assert verify_trajectory(raw(turns)).ok
    # With the other error removed, the flagged bad action alone satisfies error count >= 1.
    only_flag = turns[:1] + turns[5:]
    assert verify_trajectory(raw(only_flag)).ok


def test_no_error_at_all():
    turns = [
        dm("You are in the kitchen."),
        player("Open the fridge.", "open fridge"),
        dm("The fridge is open."),
        player("Take an egg.", "take egg from fridge"),
        dm("You take an egg."),
        player("Cook it.", "cook egg in pan"),
        dm("The egg is fried."),
        player("Serve it.", "put egg on plate"),
        dm("Served. Task complete.", success=True),
    ]
    r = verify_trajectory(raw(turns))
    assert (r.ok, r.verified_turns, r.reason) == (False, 8, V.NO_ERROR)
    # The same trajectory with one flagged mistake passes.
    turns[2:2] = [dm("You cannot reach into a closed fridge.", error=True), player("Retry.", "open fridge")]
    turns[1] = player("Take an egg first.", "take egg from fridge")
    assert verify_trajectory(raw(turns)).ok


def test_error_on_last_turn():
    turns = good_turns()
    turns[12] = dm("The plate slips and breaks.", error=True, success=True)
    r = verify_trajectory(raw(turns))
    assert (r.ok, r.verified_turns, r.reason) == (False, 12, V.ERROR_ON_LAST_TURN)


def test_task_not_finished():
    turns = good_turns()
    turns[12] = dm("The egg is on the plate, but it is burnt.")
    r = verify_trajectory(raw(turns))
    assert (r.ok, r.verified_turns, r.reason) == (False, 12, V.TASK_NOT_FINISHED)


def test_trajectory_ending_with_a_player_turn_is_not_finished():
    r = verify_trajectory(raw(good_turns()[:12]))
    assert (r.ok, r.verified_turns, r.reason) == (False, 11, V.TASK_NOT_FINISHED)


@pytest.mark.parametrize(
    ("index", "mutate"),
    [
        (4, lambda t: t.pop("error")),
        (4, lambda t: t.update(error="yes")),  # wrong type counts as missing
        (3, lambda t: t.pop("thought")),
        (9, lambda t: t.pop("action")),
        (6, lambda t: t.update(role="narrator")),
        (12, lambda t: t.pop("task_success")),
    ],
)
def test_missing_key_stops_the_walk(index, mutate):
    turns = good_turns()
    mutate(turns[index])
    r = verify_trajectory(raw(turns))
    assert (r.ok, r.verified_turns, r.reason) == (False, index, V.MISSING_KEYS)
    assert f"turn {index}" in r.detail


def test_non_object_turn_is_missing_keys():
    turns = good_turns()
    turns[2] = "the fridge is closed"
    r = verify_trajectory(raw(turns))
    assert (r.verified_turns, r.reason) == (2, V.MISSING_KEYS)


@pytest.mark.parametrize(
    ("action", "ok"),
    [
        ("take egg from fridge", True),
        ("Take  the brown egg   from the fridge ", True),  # case and whitespace are normalized
        ("take from fridge", False),  # a slot must be non-empty
        ("take egg from ", False),
        ("take egg", False),
        ("take egg from fridge now please", True),  # the last slot takes the rest
        ("look", True),
        ("look around", False),  # a template without slots matches only itself
        ("", False),
        ("open door (north)", True),
    ],
)
def test_action_slot_matching(action, ok):
    templates = ["take {object} from {place}", "look", "open {container}"]
    assert action_matches(action, templates) is ok


def test_regex_characters_in_templates_are_literal():
    assert action_matches("pay $5.00 to bob", ["pay $5.00 to {person}"])
    assert not action_matches("pay $5X00 to bob", ["pay $5.00 to {person}"])
    assert action_matches("press [red] button", ["press [{color}] button"])
    assert not action_matches("press red button", ["press [{color}] button"])


def test_script_actions_may_be_objects():
    obj = raw()
    obj["script"]["available_actions"] = [
        {"action": a, "description": "d"} for a in obj["script"]["available_actions"]
    ]
    assert verify_trajectory(obj).ok


def test_verify_cli_reports_every_line(tmp_path):
    lines = []
    lines.append(json.dumps(raw(rid="pass")))
    t = good_turns()
    t[5] = player("Grab it.", "grab egg")
    lines.append(json.dumps(raw(t, rid="unflagged")))
    lines.append('{"id": "broken", "turns": [')
    t = good_turns()
    t[12] = dm("Not yet.")
    lines.append(json.dumps(raw(t, rid="unfinished")))
    lines.append("")
    t = good_turns()
    del t[4]["observation"]
    lines.append(json.dumps(raw(t, rid="missing")))
    src = tmp_path / "raw.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report.jsonl"
    assert cli.main(["verify", "--input", str(src), "--out", str(out)]) == 0
    rows = read_jsonl(out)
    got = [(r["id"], r["ok"], r["verified_turns"], r["reason"], r["line"]) for r in rows]
    assert got == [
        ("pass", True, 13, "ok", 1),
        ("unflagged", False, 5, "invalid_action", 2),
        (None, False, 0, "invalid_json", 3),
        ("unfinished", False, 12, "task_not_finished", 4),
        (None, False, 0, "invalid_json", 5),
        ("missing", False, 4, "missing_keys", 6),
    ]
    assert all(set(r) >= {"id", "ok", "verified_turns", "reason"} for r in rows)
