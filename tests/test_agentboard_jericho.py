"""AgentBoard's Jericho protocol through the real `jericho` FrotzEnv, on a z-machine game TextWorld compiles.

AgentBoard's 20 games come from the user's download; here `tw-make` builds a two-room game (z8) once per
module, placed in a checkout of our own as `snacktime.z8` (one of the four games AgentBoard loads as .z8).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("jericho")
pytest.importorskip("textworld")

from agentrefine_jax.eval.agentboard.checkout import Checkout, CheckoutError  # noqa: E402
from agentrefine_jax.eval.agentboard.tasks.jericho import (  # noqa: E402
    JerichoTask,
    clean_feedback,
    parse_action,
)

CONFIG = """\
env:
  jericho:
    name: jericho
    game_name: ["snacktime", "905"]
    check_actions: "check valid actions"
"""
# Our own tables in jericho_env.py's shape (read with ast, never imported).
ENV_PY = """\
from jericho import *
game_goals = {
    "snacktime": "Put the teacup on the counter.",
}
game_init_obs = {
    "905": "You wake up.",
}
"""
TAKE, PUT = "You take the teacup from the chair.", "You put the teacup on the counter."


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> pathlib.Path:
    work = tmp_path_factory.mktemp("tw")
    out = work / "game.z8"
    tw_make = shutil.which("tw-make") or str(pathlib.Path(sys.executable).with_name("tw-make"))
    cmd = [tw_make, "custom", "--world-size", "2", "--nb-objects", "3", "--quest-length", "2", "--seed", "7"]
    # Inform 7 writes $HOME/Inform: keep it in the test's own directory, not the suite's HOME.
    env = {**os.environ, "HOME": str(work)}
    subprocess.run([*cmd, "--output", str(out), "-f"], check=True, capture_output=True, timeout=600, env=env)
    return out


def write_checkout(root: pathlib.Path, story: pathlib.Path) -> Checkout:
    (root / "eval_configs").mkdir(parents=True)
    (root / "eval_configs/main_results_all_tasks.yaml").write_text(CONFIG)
    (root / "agentboard/environment").mkdir(parents=True)
    (root / "agentboard/environment/jericho_env.py").write_text(ENV_PY)
    games = root / "data/jericho/z-machine-games-master/jericho-game-suite"
    games.mkdir(parents=True)
    shutil.copy(story, games / "snacktime.z8")
    shutil.copy(
        story.with_suffix(".json"), games / "snacktime.json"
    )  # TextWorld's walkthrough, for the oracle
    lines = [
        {"subgoals": ["teacup from the chair", "You put the teacup, on the counter"], "difficulty": "hard"},
        {"subgoals": ["x"], "difficulty": "easy"},
    ]
    (root / "data/jericho/test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return Checkout(root)


def test_action_cut_and_feedback_cleanup():
    assert parse_action("take teacup from chair, then go north.") == "take teacup from chair"
    assert parse_action("open the door. Then leave") == "open the door"
    assert parse_action(" ".join(["w"] * 30)) == " ".join(["w"] * 20)
    assert clean_feedback("\nYou see\n\n  a  box.   [Your score has gone up by 1]") == " You see a box. "


@pytest.mark.timeout(600)
def test_episodes_goal_tables_and_missing_game(tmp_path, story):
    task = JerichoTask()
    ck = write_checkout(tmp_path, story)
    specs = task.episodes(ck)
    assert [(s.id, s.difficulty) for s in specs] == [("snacktime", "hard"), ("905", "easy")]
    assert specs[0].info["game_file"].endswith("jericho-game-suite/snacktime.z8")
    assert specs[1].info["game_file"].endswith("jericho-game-suite/905.z5")
    assert (specs[0].info["goal"], specs[0].info["init_obs"]) == (
        "Put the teacup on the counter.",
        "Not written yet.",
    )
    assert (specs[1].info["goal"], specs[1].info["init_obs"]) == ("Not written yet.", "You wake up.")
    with pytest.raises(CheckoutError, match=r"missing .*905\.z5: provided by AgentBoard's data"):
        task.make_env(ck, specs[1])
    (tmp_path / "data/jericho/test.jsonl").write_text(
        json.dumps({"subgoals": ["a"], "difficulty": "easy"}) + "\n"
    )
    with pytest.raises(CheckoutError, match="1 lines for 2 games"):
        task.episodes(ck)


@pytest.mark.timeout(600)
def test_steps_progress_and_success(tmp_path, story):
    task = JerichoTask()
    ck = write_checkout(tmp_path, story)
    env = task.make_env(ck, task.episodes(ck)[0])
    assert env.reset() == "Not written yet."  # the table's text, not the game's banner
    assert env.goal == "Put the teacup on the counter."
    r = env.step("Check valid actions please")
    # jericho lists nothing for a story file it does not support; the help entry is always there
    assert (r.observation, r.valid, r.progress) == (
        "You can take the following actions: check valid actions",
        True,
        0,
    )
    r = env.step("take teacup from chair, quickly")
    assert TAKE in r.observation and "\n" not in r.observation and "  " not in r.observation
    assert (r.valid, r.progress, r.done) == (True, 0.5, False)
    r = env.step("put teacup on counter")
    # "You put the teacup, on the counter" matches once punctuation is stripped from both sides
    assert PUT in r.observation and (r.progress, r.done) == (1.0, True) and env.success
    env.close()


@pytest.mark.timeout(600)
def test_walkthrough_oracle(tmp_path, story):
    task = JerichoTask()
    ck = write_checkout(tmp_path, story)
    env = task.make_env(ck, task.episodes(ck)[0])
    env.reset()
    policy = task.oracle(env)
    actions = []
    for _ in range(5):
        actions.append(policy.next_action(env, []))
        if env.step(actions[-1]).done:
            break
    assert actions == ["take teacup from chair", "put teacup on counter"] and env.success
    env.close()
