"""AgentBoard's BabyAI protocol on a small AgentBoard-layout checkout of our own making, with real minigrid.

Expected texts and primitive lists are worked out by hand from the level's grid (printed in the comments);
the same implementation was cross-checked once against AgentBoard's own env on all 112 episodes (see
docs/eval.md), which a test cannot do: AgentBoard's code is not part of this project.
"""

from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("minigrid")

from agentrefine_jax.eval.agentboard.checkout import Checkout, CheckoutError  # noqa: E402
from agentrefine_jax.eval.agentboard.tasks.babyai import (  # noqa: E402
    BabyAIEnv,
    BabyAITask,
    BotOracle,
    SubgoalProgress,
    make_level,
    matches,
)

CONFIG = """\
env:
  babyai:
    name: babyai
    seed: 1234
    game_level: [2, 4]
    env_num_per_task: 2
    check_actions: "check valid actions"
"""
# Our own level table in babyai_env.py's shape (read with ast, never imported).
LEVELS_PY = """\
import gymnasium
all_levels = {
    1: "BabyAI-GoToRedBallGrey-v0",
    2: "BabyAI-GoToRedBall-v0",
    4: "BabyAI-GoToObjS6-v0",
}
"""
DONE = "The task is completed"


def write_checkout(root: pathlib.Path, lines: list[dict]) -> Checkout:
    (root / "eval_configs").mkdir(parents=True)
    (root / "eval_configs/main_results_all_tasks.yaml").write_text(CONFIG)
    (root / "agentboard/environment").mkdir(parents=True)
    (root / "agentboard/environment/babyai_env.py").write_text(LEVELS_PY)
    (root / "data/babyai").mkdir(parents=True)
    (root / "data/babyai/test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return Checkout(root)


LINES = [
    {"subgoals": ["red ball 1 right in front of you 1 steps", DONE], "difficulty": "easy"},
    {"subgoals": ["red ball", DONE], "difficulty": "easy"},
    {"subgoals_0": ["a", "b"], "subgoals_1": ["c", "d"], "difficulty": "hard"},
    {"subgoals": [DONE], "difficulty": "hard"},
]


def test_episodes_are_level_major_and_read_subgoals(tmp_path):
    task = BabyAITask()
    eps = task.episodes(write_checkout(tmp_path, LINES))
    assert [e.id for e in eps] == [
        "BabyAI-GoToRedBall-v0/1234",
        "BabyAI-GoToRedBall-v0/1235",
        "BabyAI-GoToObjS6-v0/1234",
        "BabyAI-GoToObjS6-v0/1235",
    ]
    assert [e.index for e in eps] == [0, 1, 2, 3]
    assert [e.difficulty for e in eps] == ["easy", "easy", "hard", "hard"]
    assert eps[2].info["subgoals"] == [["a", "b"], ["c", "d"]]  # every *subgoals* key, as alternatives
    assert eps[0].info["subgoals"] == LINES[0]["subgoals"]


def test_checkout_errors_are_one_line(tmp_path):
    with pytest.raises(CheckoutError, match=r"4 levels|2 levels x 2 seeds = 4"):
        BabyAITask().episodes(write_checkout(tmp_path / "a", LINES[:3]))
    ck = write_checkout(tmp_path / "b", LINES)
    (tmp_path / "b/data/babyai/test.jsonl").unlink()
    with pytest.raises(
        CheckoutError, match=r"missing .*data/babyai/test.jsonl: provided by AgentBoard's data"
    ):
        BabyAITask().episodes(ck)


def test_goto_objs6_is_minigrid_230s_room_size_4():
    # minigrid 2.3.0 (AgentBoard's pin) registered GoToObjS6-v0 with room_size=4; 3.x made v0 an error.
    env = make_level("BabyAI-GoToObjS6-v0")
    assert env.unwrapped.room_size == 4
    env.close()


def test_observation_and_macro_actions_hand_computed():
    # GoToRedBall seed 1234: the agent starts at (1, 2) facing the west wall; after `turn left` it faces south
    # down column 1 with the red ball 4 cells ahead at (1, 6), the green box at (2, 4), the purple ball at
    # (3, 3) and the purple key at (2, 5) (east is the agent's left when facing south).
    env = BabyAIEnv("BabyAI-GoToRedBall-v0", 1234, ["purple key 1", DONE])  # at most one scores per step
    obs = env.reset()
    assert env.goal == "go to the red ball"
    assert obs == (
        "In front of you in this room, you can see several objects: The room has walls around you. "
        "You are facing a wall 1 steps away. You are not carrying anything."
    )  # only walls in view: AgentBoard keeps the empty object-list sentence
    assert env.valid_actions() == ["turn left", "turn right", "check available actions"]
    assert not env.step("move forward").valid  # a wall 1 step away: not listed
    assert (
        env.step("move forward").observation == "There is a barrier in front of you, you can't move forward."
    )
    r = env.step("turn left")
    assert r.valid and not r.done and r.progress == 0.5
    assert r.observation == (
        "In front of you in this room, you can see several objects: "
        "There is a green box 1 2 steps in front of you and 1 steps to your left.  "
        "There is a purple ball 1 1 steps in front of you and 2 steps to your left.  "
        "There is a red ball 1 right in front of you 4 steps away.  "
        "There is a purple key 1 3 steps in front of you and 1 steps to your left.  "
        "The room has walls around you. You are facing a wall 5 steps away. You are not carrying anything."
    )  # sorted by Manhattan distance (3, 3, 4, 4), ties in view-scan order
    assert env.view.actions == {
        "turn left": [0],
        "turn right": [1],
        "move forward": [2],
        "pickup green box 1": [2, 2, 0, 3],  # two ahead, box on the left: turn left, pick up
        "pickup purple ball 1": [2, 0, 2, 3],
        "pickup red ball 1": [2, 2, 2, 3],
        "pickup purple key 1": [2, 2, 2, 0, 3],
        "go to green box 1": [2, 2, 0],
        "go to purple ball 1": [2, 0, 2],
        "go to red ball 1": [2, 2, 2],
        "go to purple key 1": [2, 2, 2, 0],
        "check available actions": [],
    }
    listing = env.step("check valid actions")
    assert listing.valid and listing.observation.startswith("You can take the following actions: turn left, ")
    assert not env.step("pick up red ball 1").valid  # the prompt says `pick up`; the env knows only `pickup`
    r = env.step("Go to red ball 1 ")  # lower-cased and stripped
    assert r.valid and r.done and r.progress == 1.0
    assert "There is a red ball 1 right in front of you 1 steps away." in r.observation
    assert r.observation.endswith("You are not carrying anything.\n The task is completed.")
    assert env.success


def test_pickup_then_drop_and_blocked_drop():
    env = BabyAIEnv("BabyAI-GoToRedBall-v0", 1234, [DONE])
    env.reset()
    env.step("turn left")
    r = env.step("pickup purple ball 1")
    assert r.observation.endswith("You are carrying a purple ball.")
    assert "drop" in env.valid_actions() and not any(a.startswith("pickup") for a in env.valid_actions())
    # Still facing east at (2, 3)... the ball's cell (3, 3) is empty now: dropping there is allowed.
    r = env.step("drop")
    assert r.observation.endswith(
        "You are not carrying anything."
    ) and "purple ball 1 right in front of you 1" in (r.observation)
    assert env.step("drop").observation == "You cannot drop the object, as you are not carrying anything."


def test_done_is_cleared_when_progress_is_at_most_half():
    # The level is solved, but only 1 of 3 patterns matched: AgentBoard clears done (progress 1/3 <= 0.5).
    env = BabyAIEnv("BabyAI-GoToRedBall-v0", 1234, ["zzz", "yyy", DONE])
    env.reset()
    env.step("turn left")
    r = env.step("go to red ball 1")
    assert r.progress == pytest.approx(1 / 3) and not r.done and not env.success
    assert r.observation.endswith("\n The task is completed.")  # the text says so anyway


def test_progress_reaching_one_forces_done():
    env = BabyAIEnv("BabyAI-GoToRedBall-v0", 1234, ["purple key 1"])
    env.reset()
    r = env.step("turn left")  # the level is not solved, but every pattern matched
    assert r.done and r.progress == 1.0 and r.observation.endswith("\n The task is completed.")


def test_matches_and_progress_rules():
    obs = "There is a red ball 1 right in front of you 1 steps away.  The room has walls around you. "
    assert matches(obs, "red ball*1 steps away")
    assert matches(obs, "red ball 1**right in front of you.")  # `**` splits first; pieces lose their `.`
    assert not matches(obs, "red ball*walls")  # pieces must share one `.`-separated sentence
    flat = SubgoalProgress(["walls", "red ball", "walls"])
    flat.update(obs)  # at most one pattern scores per step, the first matching one
    assert (flat.points, flat.remaining) == (1, ["red ball", "walls"])
    flat.update(obs)
    flat.update("nothing")
    assert flat.value == pytest.approx(2 / 3)
    alt = SubgoalProgress([["x", "red ball", "x"], ["walls", "q", "r"]])
    alt.update(obs)  # index 0 matches in the second sequence: item 0 leaves both
    assert alt.remaining == [["red ball", "x"], ["q", "r"]] and alt.value == pytest.approx(1 / 3)
    alt.update(obs)  # index 0 again ("red ball")
    assert alt.remaining == [["x"], ["r"]] and alt.value == pytest.approx(2 / 3)


def test_invalid_steps_never_score_and_keep_the_error_text():
    env = BabyAIEnv("BabyAI-GoToRedBall-v0", 1234, ["The action is not recognized", "barrier"])
    env.reset()
    for action, text in (
        ("fly", "The action is not recognized. Please check valid actions."),
        ("", "No change in state."),
        ("move forward", "There is a barrier in front of you, you can't move forward."),
    ):
        r = env.step(action)
        assert (r.observation, r.valid, r.progress) == (text, False, 0.0)


@pytest.mark.timeout(300)
def test_bot_oracle_solves_through_macros(tmp_path):
    task = BabyAITask()
    eps = task.episodes(write_checkout(tmp_path, LINES))
    for spec in (eps[0], eps[3]):  # GoToRedBall/1234 and GoToObjS6(room 4)/1235
        env = task.make_env(None, spec)
        env.reset()
        policy = task.oracle(env)
        assert isinstance(policy, BotOracle)
        for _ in range(10):
            r = env.step(policy.next_action(env, []))
            if r.done:
                break
        assert env.success, spec.id
        env.close()
