"""ALFWorld reworded-action variants (the paper's Table 3): rules, prompt rewriting, the game behind them."""

from __future__ import annotations

import pytest

from agentrefine_jax.eval.perturb import REWORDINGS, RewordedEnv, reword_prompt, rewording, summary

INSTRUCTION = (
    "Please ensure that any objects ('{obj}') you mention are present.\n"
    "- 'take {obj} from {recep}'\n- 'put {obj} in/on {recep}'\n- 'open {recep}'\n"
    "- 'clean {obj} using {recep}'\n- 'go to {recep}'\n"
)
EXAMPLE = (
    "Your task is to: put a clean mug on shelf.\nAction: go to countertop 1\n"
    "Observation: You arrive at loc 3. On the countertop 1, you see a mug 1.\n"
    "Action: take mug 1 from countertop 1\nObservation: You pick up the mug 1 from the countertop 1.\n"
    "Action: clean mug 1 with sinkbasin 1\nAction: put mug 1 in/on shelf 1\n"
)


def test_five_rules_change_wording_not_meaning():
    assert [r.index for r in REWORDINGS] == [1, 2, 3, 4, 5]
    commands = [
        "go to cabinet 1",
        "take mug 1 from countertop 1",
        "put mug 1 in/on shelf 1",
        "heat egg 2 with microwave 1",
        "open fridge 1",
        "look",
    ]
    assert [rewording(1).surface(c) for c in commands] == ["move to cabinet 1", *commands[1:]]
    assert rewording(2).surface(commands[1]) == "pick up mug 1 from countertop 1"
    assert rewording(3).surface(commands[2]) == "place mug 1 in/on shelf 1"
    assert rewording(4).surface(commands[3]) == "use microwave 1 to heat egg 2"  # token order
    assert [rewording(5).surface(c) for c in commands] == [
        "move to cabinet 1",
        "pick up mug 1 from countertop 1",
        "place mug 1 in/on shelf 1",
        "use microwave 1 to heat egg 2",
        "open fridge 1",
        "look",
    ]
    with pytest.raises(ValueError, match="1..5"):
        rewording(6)


def test_prompt_rewording_touches_commands_only():
    instruction, (example,) = reword_prompt(rewording(5), INSTRUCTION, [EXAMPLE])
    assert instruction == (
        "Please ensure that any objects ('{obj}') you mention are present.\n"
        "- 'pick up {obj} from {recep}'\n- 'place {obj} in/on {recep}'\n- 'open {recep}'\n"
        "- 'use {recep} to clean {obj}'\n- 'move to {recep}'\n"
    )
    assert example == (
        "Your task is to: put a clean mug on shelf.\nAction: move to countertop 1\n"
        "Observation: You arrive at loc 3. On the countertop 1, you see a mug 1.\n"
        "Action: pick up mug 1 from countertop 1\nObservation: You pick up the mug 1 from the countertop 1.\n"
        "Action: use sinkbasin 1 to clean mug 1\nAction: place mug 1 in/on shelf 1\n"
    )


def test_summary_mean_and_population_std():
    s = summary(0.5, [0.2, 0.4, 0.4, 0.6, 0.4])
    assert s["original"] == 0.5 and s["mean"] == pytest.approx(0.4)
    assert s["std"] == pytest.approx((0.08 / 5) ** 0.5)


@pytest.mark.timeout(300)
def test_reworded_game_accepts_new_wording_only(tmp_path):
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    from test_agentboard_alfworld import write_checkout

    from agentrefine_jax.eval.agentboard.tasks.alfworld import ALFWorldTask

    task = ALFWorldTask()
    spec = task.episodes(write_checkout(tmp_path))[0]
    env = RewordedEnv(task.make_env(None, spec), rewording(1))
    env.reset()
    assert "move to countertop 1" in env.valid_actions() and "go to countertop 1" not in env.valid_actions()
    r = env.step("go to countertop 1")  # the original wording of a reworded command
    assert (r.observation, r.valid) == ("Nothing happens.", False)
    r = env.step("move to countertop 1")
    assert r.observation == "On the countertop 1, you see a apple 1, and a mug 1." and r.valid
    assert r.progress == 0.25
    r = env.step("check valid actions")
    assert "move to cabinet 1" in r.observation and "go to cabinet" not in r.observation and r.valid
    env.close()

    base = task.make_env(None, spec)
    env = RewordedEnv(base, rewording(5))
    policy = task.oracle(base)  # the expert's commands come out in the rewording's wording
    env.reset()
    actions = []
    for _ in range(30):
        actions.append(policy.next_action(env, []))
        if env.step(actions[-1]).done:
            break
    assert env.success and actions == [
        "look",
        "move to countertop 1",
        "pick up mug 1 from countertop 1",
        "move to cabinet 1",
        "open cabinet 1",
        "place mug 1 in/on cabinet 1",
    ]


def test_both_sources_rewordings_share_one_wording_interface():
    """`perturb.Wording`: the built-in `Vocabulary` (phrase by phrase) and ALFWorld's `Rewording` (whole
    commands, mapped back through the admissible ones) both round-trip a command and both refuse the
    original wording of an action they renamed."""
    from agentrefine_jax.eval.perturb import ActionWord, Vocabulary, Wording

    vocab = Vocabulary((ActionWord("go to", "{verb} OBJ", "walk", (("move to", "walk"),)),), 1)
    cases: list[tuple[Wording, str, str]] = [
        (vocab, "go to cabinet 1", "open cabinet 1"),
        (rewording(1), "go to cabinet 1", "open cabinet 1"),
        (rewording(5), "take mug 1 from countertop 1", "look"),
    ]
    for wording, renamed, kept in cases:
        candidates = [renamed, kept]
        surface = wording.to_surface(renamed)
        assert surface != renamed and wording.to_canonical(surface, candidates) == renamed
        assert wording.to_canonical(renamed, candidates) is None  # the original wording: refused
        assert wording.to_surface(kept) == kept and wording.to_canonical(kept, candidates) == kept
    # ALFWorld's rules rewrite whole commands: a reworded command not admissible now is left to the game
    assert rewording(1).to_canonical("move to desk 9", ["go to cabinet 1"]) == "move to desk 9"
