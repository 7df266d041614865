"""AgentBoard's ScienceWorld task on a hand-made checkout: episode list from test.jsonl, AgentBoard's
simplifications, regex-subgoal progress, the help listing, grounding after the step, and the gold-path oracle
through the real simulator."""

from __future__ import annotations

import pytest
from agentboard_fixture import make_checkout

from agentrefine_jax.eval.agentboard.checkout import Checkout, CheckoutError
from agentrefine_jax.eval.agentboard.protocol import Agent, AgentBoardProtocol, episode_jobs
from agentrefine_jax.eval.agentboard.tasks.sciworld import SIMPLIFICATION, SciWorldTask
from agentrefine_jax.eval.core import run_episodes
from agentrefine_jax.eval.policies import OraclePolicy

# Gold paths may pick any plant (the simulator's choice varies between runs): subgoals that any of them meets.
SUBGOALS = ["move to the greenhouse", r"^You focus on the \w+", "to the red box"]


def line(task: str, var: int, goal: str, subgoals=SUBGOALS, difficulty: str = "easy") -> dict:
    return {
        "goal": goal,
        "subgoals": subgoals,
        "difficulty": difficulty,
        "additional_info": {"env_name": task, "var": var},
    }


def test_episode_list_is_keyed_like_agentboard(tmp_path):
    rows = [
        line("find-plant", 0, "first"),
        line("boil", 3, "boil it", difficulty="hard"),
        line("find-plant", 0, "second"),  # same key: keeps the first place, takes this line's values
    ]
    specs = SciWorldTask().episodes(Checkout(make_checkout(tmp_path, pddl=False, sciworld_lines=rows)))
    assert [(s.index, s.id, s.info["goal"], s.difficulty) for s in specs] == [
        (0, "find-plant_0", "second", "easy"),
        (1, "boil_3", "boil it", "hard"),
    ]
    assert SIMPLIFICATION == "selfWateringFlowerPots,openContainers,openDoors,noElectricalAction"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"goal": "g", "subgoals": ["x"]}, "no additional_info"),
        (line("boil", 0, "g", subgoals=[]), "non-empty list"),
        (line("boil", 0, "g", subgoals=["(unclosed"]), "bad subgoal regex"),
    ],
)
def test_bad_label_lines_are_one_line_errors(tmp_path, row, message):
    co = Checkout(make_checkout(tmp_path, pddl=False, sciworld_lines=[row]))
    with pytest.raises(CheckoutError, match=message) as e:
        SciWorldTask().episodes(co)
    assert "test.jsonl:1" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_progress_help_grounding_and_gold_path_oracle(tmp_path):
    pytest.importorskip("scienceworld")
    co = Checkout(
        make_checkout(tmp_path, pddl=False, sciworld_lines=[line("find-plant", 0, "Find a plant.")])
    )
    task = SciWorldTask()
    [spec] = task.episodes(co)
    try:
        env = task.make_env(co, spec)
        first = env.reset()
        assert env.goal == "Find a plant."  # test.jsonl's goal replaces the simulator's task text
        assert (
            first.startswith("This room is called the hallway.") and "\nIn your inventory, you see:" in first
        )
        # openDoors: the door to the greenhouse is already open.
        assert "A door to the greenhouse (that is open)" in first
        r = env.step(" check valid actions ")
        assert r.observation.startswith("Choose an action from these valid actions: ")
        assert r.observation.endswith(", check valid actions") and "reset" not in r.observation
        assert (r.valid, r.progress, r.done) == (True, 0.0, False)
        r = env.step("dance wildly")
        assert (r.valid, r.progress) == (False, 0.0)
        r = env.step("go to greenhouse")
        assert r.observation == "You move to the greenhouse." and r.progress == pytest.approx(1 / 3)
        # Grounding is judged on the new room's combinations, where going to the greenhouse is not one.
        assert r.valid is False
        r = env.step("look around")
        assert r.valid and r.progress == pytest.approx(1 / 3) and not r.done
        env.close()

        task.gold_paths = True
        oracle = Agent(policy=OraclePolicy())
        [log] = run_episodes(episode_jobs(task, [spec], 30), AgentBoardProtocol(task, co, oracle))
        assert (log.success, log.progress, log.end) == (True, 1.0, "done"), [t["action"] for t in log.turns]
        assert [p for _, p in log.score_change_record] == pytest.approx([1 / 3, 2 / 3, 1.0])
        assert log.turns[-1]["observation"].endswith("to the red box.")
    finally:
        task.close()


class _LookAndWait:
    """A deterministic model backend: `look around` and `wait1` in turn, whatever the episode."""

    name, context_length, max_tokens = "look-wait", 10**6, 100

    def num_tokens(self, system, user):
        return len(user)

    def generate(self, prompts, keys=None):
        return ["wait1" if u.count("\nAction: ") % 2 == 0 else "look around" for _, u in prompts]

    def forget(self, key):
        pass

    def close(self):
        pass


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_episodes_are_reproducible_whatever_the_batch_size(tmp_path):
    """The same episodes at batch 1 (one after another) and batch 8 (all in flight): identical trajectories.
    A JVM that ran other episodes before draws other random numbers for the same seeded variation (animals
    wander elsewhere), so episodes must not share a simulator."""
    pytest.importorskip("scienceworld")
    rows = [
        line("use-thermometer", 3, "Measure."),
        line("identify-life-stages-1", 2, "Stages."),
        line("lifespan-longest-lived", 0, "Lifespan."),
    ]
    co = Checkout(make_checkout(tmp_path, pddl=False, sciworld_lines=rows))

    def run(batch):
        task = SciWorldTask()
        try:
            logs = run_episodes(
                episode_jobs(task, task.episodes(co), 4),
                AgentBoardProtocol(task, co, Agent(model=_LookAndWait()), batch),
            )
        finally:
            task.close()
        return [(x.initial_observation, x.turns) for x in logs]

    one, eight = run(1), run(8)
    assert one == eight
