"""AgentBoard's ALFWorld protocol through the real `alfworld` + TextWorld engine, on tiny games of our own.

AgentBoard's game files are GPL data from the user's download, so the tests write their own ALFWorld games:
the `alfworld` package's PDDL domain and grammar (the grammar's put/arrive wording set back to the older one
that AgentBoard's game files carry) with a three-location problem we write here.
"""

from __future__ import annotations

import json
import pathlib

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from agentrefine_jax.eval.agentboard.checkout import Checkout, CheckoutError  # noqa: E402
from agentrefine_jax.eval.agentboard.tasks.alfworld import (  # noqa: E402
    ALFWorldEnv,
    ALFWorldTask,
    post_process,
)

CONFIG = """\
env:
  alfworld:
    name: alfworld
    split: eval_out_of_distribution
    check_actions: check valid actions
"""
BASE_CONFIG = """\
dataset:
  data_path: './data/alfworld/json_2.1.1/train'
  eval_id_data_path: './data/alfworld/json_2.1.1/valid_seen'
  eval_ood_data_path: './data/alfworld/json_2.1.1/valid_unseen'
  num_train_games: -1
  num_eval_games: -1
logic:
  domain: './data/alfworld/alfred.pddl'
  grammar: './data/alfworld/alfred.twl2'
env:
  type: 'AlfredTWEnv'
  domain_randomization: False
  task_types: [1, 2, 3, 4, 5, 6]
  goal_desc_human_anns_prob: 0.0
"""
PROBLEM = """
(define (problem tiny)
 (:domain alfred)
 (:objects
  agent1 - agent
  loc_bar_0_bar_0_bar_0_bar_0 loc_bar_1_bar_0_bar_0_bar_0 loc_bar_2_bar_0_bar_0_bar_0 - location
  CounterTop_bar__plus_01_dot_00 Cabinet_bar__plus_02_dot_00 - receptacle
  Mug_bar__plus_00_dot_10 Apple_bar__plus_00_dot_20 - object
  MugType AppleType - otype
  CounterTopType CabinetType - rtype
 )
 (:init
  (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)
  (receptacleAtLocation CounterTop_bar__plus_01_dot_00 loc_bar_1_bar_0_bar_0_bar_0)
  (receptacleAtLocation Cabinet_bar__plus_02_dot_00 loc_bar_2_bar_0_bar_0_bar_0)
  (receptacleType CounterTop_bar__plus_01_dot_00 CounterTopType)
  (receptacleType Cabinet_bar__plus_02_dot_00 CabinetType)
  (openable Cabinet_bar__plus_02_dot_00)
  (inReceptacle Mug_bar__plus_00_dot_10 CounterTop_bar__plus_01_dot_00)
  (inReceptacle Apple_bar__plus_00_dot_20 CounterTop_bar__plus_01_dot_00)
  (objectAtLocation Mug_bar__plus_00_dot_10 loc_bar_1_bar_0_bar_0_bar_0)
  (objectAtLocation Apple_bar__plus_00_dot_20 loc_bar_1_bar_0_bar_0_bar_0)
  (objectType Mug_bar__plus_00_dot_10 MugType)
  (objectType Apple_bar__plus_00_dot_20 AppleType)
  (pickupable Mug_bar__plus_00_dot_10)
  (pickupable Apple_bar__plus_00_dot_20)
  (canContain CabinetType MugType)
  (canContain CounterTopType MugType)
  (canContain CounterTopType AppleType)
 )
 (:goal (exists (?r - receptacle) (and (receptacleType ?r CabinetType)
   (exists (?o - object) (and (objectType ?o MugType) (inReceptacle ?o ?r))))))
)
"""
# (task dir, trial dir), in sorted order; RandomState(1234) plays five as e, a, b, c, d.
GAMES = [
    ("pick_and_place_simple-Mug-None-Cabinet-1", "trial_a"),
    ("pick_and_place_simple-Mug-None-Cabinet-2", "trial_b"),
    ("pick_and_place_simple-Mug-None-Cabinet-3", "trial_c"),
    ("pick_and_place_simple-Mug-None-Cabinet-4", "trial_d"),
    ("pick_and_place_simple-Mug-None-Cabinet-5", "trial_e"),
]
SUBGOALS = ["countertop 1, you see", "You pick up the mug", "put .* in/on the cabinet"]


def _game(domain: str, grammar: str) -> str:
    return json.dumps({"pddl_domain": domain, "grammar": grammar, "pddl_problem": PROBLEM, "solvable": True})


def write_checkout(root: pathlib.Path, games=GAMES, labels=GAMES) -> Checkout:
    import alfworld

    data = pathlib.Path(alfworld.__file__).parent / "data"
    domain = (data / "alfred.pddl").read_text()
    grammar = (
        (data / "alfred.twl2")
        .read_text()
        .replace("UNKNOWN GOAL", "put some mug on cabinet")
        .replace('template :: "move {o} to {r}"', 'template :: "put {o} in/on {r}"')
        .replace('"You arrive at {r.name}. ', '"You arrive at loc 7. ')
    )
    (root / "eval_configs").mkdir(parents=True)
    (root / "eval_configs/main_results_all_tasks.yaml").write_text(CONFIG)
    (root / "agentboard/environment/alfworld").mkdir(parents=True)
    (root / "agentboard/environment/alfworld/base_config.yaml").write_text(BASE_CONFIG)
    params = {"object_target": "Mug", "parent_target": "Cabinet", "toggle_target": "", "mrecep_target": ""}
    for task, trial in games:
        d = root / "data/alfworld/json_2.1.1/valid_unseen" / task / trial
        d.mkdir(parents=True)
        (d / "game.tw-pddl").write_text(_game(domain, grammar))
        traj = {"task_type": "pick_and_place_simple", "pddl_params": {**params, "object_sliced": False}}
        (d / "traj_data.json").write_text(json.dumps(traj))
    lines = [
        {
            "additional_info": {"description": f"{t}/{r}"},
            "subgoals": SUBGOALS,
            "difficulty": "easy" if i else "hard",
        }
        for i, (t, r) in enumerate(labels)
    ]
    (root / "data/alfworld/test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return Checkout(root)


def test_post_process():
    assert post_process(" put mug 1 in cabinet 1. ") == "put mug 1 in/on cabinet 1"
    assert post_process("put mug 1 on cabinet 1") == "put mug 1 in/on cabinet 1"
    assert post_process("go to cabinet 1.") == "go to cabinet 1"
    assert post_process("take mug 1 from countertop 1") == "take mug 1 from countertop 1"


@pytest.mark.timeout(300)
def test_episode_order_is_textworlds_shuffle_of_the_sorted_games(tmp_path):
    import textworld
    from textworld.gym.envs.textworld_batch import TextworldBatchGymEnv

    ck = write_checkout(tmp_path)
    specs = ALFWorldTask().episodes(ck)
    assert len(specs) == 5 and [s.index for s in specs] == [0, 1, 2, 3, 4]
    # The real thing: TextWorld's batch env, given the sorted list as AgentBoard does, plays in this order.
    files = sorted(s.info["game_file"] for s in specs)
    batch = TextworldBatchGymEnv(files, textworld.EnvInfos(), batch_size=1)
    assert [s.info["game_file"] for s in specs] == [next(batch._gamefiles_iterator) for _ in files]
    assert [s.id for s in specs] == [f"{t}/{r}" for t, r in GAMES[4:] + GAMES[:4]]
    by_id = {s.id: s for s in specs}
    assert by_id["pick_and_place_simple-Mug-None-Cabinet-1/trial_a"].difficulty == "hard"
    assert ALFWorldTask().examples_key(specs[0]) == "put"


def test_missing_label_or_games_is_a_one_line_error(tmp_path):
    ck = write_checkout(tmp_path / "a", labels=GAMES[1:])
    with pytest.raises(
        CheckoutError, match="no line for game pick_and_place_simple-Mug-None-Cabinet-1/trial_a"
    ):
        ALFWorldTask().episodes(ck)
    import shutil

    shutil.rmtree(tmp_path / "a/data/alfworld/json_2.1.1")
    with pytest.raises(CheckoutError, match=r"missing .*valid_unseen: provided by AgentBoard's data"):
        ALFWorldTask().episodes(ck)
    (tmp_path / "a/agentboard/environment/alfworld/base_config.yaml").unlink()
    with pytest.raises(CheckoutError, match=r"missing .*base_config.yaml: provided by the AgentBoard repo"):
        ALFWorldTask().episodes(ck)


@pytest.mark.timeout(300)
def test_reset_step_look_help_and_progress(tmp_path):
    specs = ALFWorldTask().episodes(write_checkout(tmp_path))
    env = ALFWorldTask().make_env(None, specs[0])
    obs = env.reset()
    assert (
        obs == "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, "
        "and a countertop 1."
    )
    assert env.goal == "put some mug on cabinet."
    assert env.valid_actions()[-1] == "check valid actions" and "look" in env.valid_actions()
    r = env.step("go to countertop 1")
    # `You arrive at loc 7. ` is cut; the first subgoal regex matches: 1 of 3 (+1 never-set flag) = 1/4
    assert r.observation == "On the countertop 1, you see a apple 1, and a mug 1."
    assert (r.valid, r.done, r.progress) == (True, False, 0.25)
    r = env.step("look")  # steps the game, answers the remembered location text
    assert r.observation == "On the countertop 1, you see a apple 1, and a mug 1." and r.valid
    r = env.step("check valid actions")
    assert r.observation == (
        "Choose an action from these valid actions: examine countertop 1, go to cabinet 1, help, inventory, "
        "look, take apple 1 from countertop 1, take mug 1 from countertop 1, check valid actions"
    )
    r = env.step("take mug 1 from the countertop 1")  # not admissible: TextWorld's own answer, not grounded
    assert (r.observation, r.valid) == ("Nothing happens.", False)
    assert env.step("take mug 1 from countertop 1").progress == 0.5
    env.step("go to cabinet 1")
    r = env.step("put mug 1 in cabinet 1")  # closed: not admissible yet
    assert (r.observation, r.valid, r.done) == ("Nothing happens.", False, False)
    assert env.step("look").observation == "The cabinet 1 is closed."
    env.step("open cabinet 1")
    r = env.step("put mug 1 on cabinet 1.")
    assert r.done and r.progress == 1.0 and env.success
    env.close()


@pytest.mark.timeout(300)
def test_handcoded_expert_oracle_succeeds(tmp_path):
    task = ALFWorldTask()
    spec = task.episodes(write_checkout(tmp_path))[1]
    env = task.make_env(None, spec)
    policy = task.oracle(env)  # asked before reset: the expert rides along from the start
    assert isinstance(env, ALFWorldEnv) and env.expert
    env.reset()
    actions = []
    for _ in range(30):
        actions.append(policy.next_action(env, []))
        if env.step(actions[-1]).done:
            break
    assert env.success and actions == [
        "look",  # alfworld's expert says `look` before it has seen a step
        "go to countertop 1",
        "take mug 1 from countertop 1",
        "go to cabinet 1",
        "open cabinet 1",
        "put mug 1 in/on cabinet 1",
    ]


class _Scripted:
    """A model backend replying a fixed script per episode; it records every user prompt it is sent."""

    name, context_length, max_tokens = "scripted", 10**6, 100

    def __init__(self, replies: list[str]):
        self.replies, self.prompts = list(replies), []

    def num_tokens(self, system, user):
        return len(user)

    def generate(self, prompts, keys=None):
        self.prompts += [u for _, u in prompts]
        return [self.replies.pop(0) for _ in prompts]

    def forget(self, key):
        pass

    def close(self):
        pass


@pytest.mark.timeout(300)
def test_history_holds_agentboards_parsed_action(tmp_path):
    """AgentBoard's ALFWorld loop parses the reply (`put X in Y` -> `put X in/on Y`, no trailing `.`) and
    writes that action into the memory the next prompt shows, not the raw reply."""
    from agentrefine_jax.eval.agentboard.protocol import Agent, AgentBoardProtocol, episode_jobs
    from agentrefine_jax.eval.core import run_episodes

    ck = write_checkout(tmp_path)
    prompt = {"instruction": "I.", "system_msg": "S.", "examples": {"put": ["Action: go to desk 1\n"]}}
    (tmp_path / "agentboard/prompts/VanillaAgent").mkdir(parents=True)
    (tmp_path / "agentboard/prompts/VanillaAgent/alfworld_base.json").write_text(json.dumps(prompt))
    task = ALFWorldTask()
    spec = task.episodes(ck)[0]
    script = [
        "go to countertop 1.",
        "take mug 1 from countertop 1",
        "go to cabinet 1",
        "put mug 1 in cabinet 1.",  # closed: not admissible, the episode goes on
        "open cabinet 1",
        "put mug 1 on cabinet 1",
    ]
    model = _Scripted(script)
    [log] = run_episodes(episode_jobs(task, [spec], 10), AgentBoardProtocol(task, ck, Agent(model=model)))
    assert (log.success, log.end, log.steps) == (True, "done", 6)
    parsed = [
        "go to countertop 1",
        "take mug 1 from countertop 1",
        "go to cabinet 1",
        "put mug 1 in/on cabinet 1",
        "open cabinet 1",
        "put mug 1 in/on cabinet 1",
    ]
    assert [t["action"] for t in log.turns] == parsed
    assert log.turns[0]["reply"] == "go to countertop 1." and "reply" not in log.turns[1]
    last = model.prompts[-1]  # the prompt of the sixth step shows the first five parsed actions
    assert "Action: go to countertop 1\nObservation: " in last
    assert "Action: put mug 1 in/on cabinet 1\nObservation: Nothing happens.\nAction: open cabinet 1" in last
    assert "Action: put mug 1 in cabinet 1" not in last and "Action: go to countertop 1." not in last


@pytest.mark.timeout(300)
def test_perturbed_runs_fill_the_shared_variants_and_summary(tmp_path):
    """`--perturb` on AgentBoard's ALFWorld writes the layout both sources share: each rewording's metrics
    under `variants.perturbation_k`, Table 3 under `perturbation_summary`, and the table prints it."""
    from agentrefine_jax.eval.agentboard.runner import run
    from agentrefine_jax.eval.config import EvalConfig
    from agentrefine_jax.eval.perturb import rewording
    from agentrefine_jax.eval.tables import format_table

    cfg = EvalConfig(tasks=("alfworld",), source="agentboard", episodes=2, perturbations=2, max_steps=10)
    doc = run(write_checkout(tmp_path), cfg, policy="random", log=lambda _m: None)
    variants = doc["variants"]
    assert sorted(variants) == ["original", "perturbation_1", "perturbation_2"]
    assert variants["original"]["tasks"] == doc["tasks"]
    for k in (1, 2):
        m = variants[f"perturbation_{k}"]["tasks"]["alfworld"]
        assert m["rewording"] == rewording(k).name and m["episodes"] == 2
    s = doc["perturbation_summary"]["alfworld"]["progress_rate"]
    values = [variants[f"perturbation_{k}"]["tasks"]["alfworld"]["progress_rate"] for k in (1, 2)]
    assert s["original"] == doc["tasks"]["alfworld"]["progress_rate"]
    assert s["perturbations"] == {"perturbation_1": values[0], "perturbation_2": values[1]}
    assert s["mean"] == pytest.approx(sum(values) / 2)
    assert "alfworld progress_rate under reworded actions" in format_table(doc)
    # the episode records behind every variant, each saying which (as the built-in source's do)
    ran = [(e["variant"], e["index"]) for e in doc["episodes"]]
    assert ran == [(v, i) for v in ("original", "perturbation_1", "perturbation_2") for i in (0, 1)]


def test_loading_a_game_leaves_the_command_line_alone(tmp_path, monkeypatch):
    """fast-downward's translator, run in-process when TextWorld loads an ALFWorld game, overwrites
    sys.argv; an evaluation (whose CLI and journal are keyed by its command) must not see that."""
    import sys

    monkeypatch.setattr(sys, "argv", ["eval", "--tasks", "alfworld"])
    specs = ALFWorldTask().episodes(write_checkout(tmp_path))
    env = ALFWorldTask().make_env(None, specs[0])
    env.reset()
    env.step("go to countertop 1")
    env.close()
    assert sys.argv == ["eval", "--tasks", "alfworld"]
