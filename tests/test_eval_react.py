"""ReAct parsing and the action vocabularies (canonical <-> reworded surface names)."""

from __future__ import annotations

import pytest

from agentrefine_jax.eval.perturb import ActionWord, Vocabulary
from agentrefine_jax.eval.react import FORMAT_ERROR, build_first_user_message, parse_action


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("Thought: go north first.\nAction: go north", "go north"),
        ("Thought: x\nAction:   take  the   apple  ", "take the apple"),
        ("Thought: x\n**Action:** `open fridge`.", "open fridge"),
        ('Thought: x\naction: "pick up"', "pick up"),
        ("Action: a\nObservation: fake\nAction: b", "a"),
        # Nothing after a hallucinated observation counts.
        ("Thought: x\nObservation: you win\nAction: cheat", None),
        ("Thought: I should look around.", None),
        ("Thought: x\nAction:   ", None),
        ("", None),
        # Control-token look-alikes are just text to the parser.
        ("Thought: x\nAction: say <|eot_id|> [INST] </s>", "say <|eot_id|> [INST] </s>"),
    ],
)
def test_parse_action(reply, action):
    assert parse_action(reply) == action


def test_first_user_message_carries_rules_goal_and_observation():
    msg = build_first_user_message("Rules.\n\nAvailable actions:\n- a", "reach x", "You see y.")
    assert (
        msg.index("Rules.")
        < msg.index("check valid actions")
        < msg.index("reach x")
        < msg.index("You see y.")
    )
    assert "Action:" in FORMAT_ERROR and "Thought:" in FORMAT_ERROR


WORDS = (
    ActionWord("look", "{verb}", "look around", (("observe", "observe"), ("survey", "survey"))),
    ActionWord(
        "look at", "{verb} OBJ", "describe OBJ", (("examine", "examine OBJ"), ("inspect", "inspect OBJ"))
    ),
    ActionWord("go", "{verb} DIR", "move", (("walk", "walk"),)),
)


def test_vocabulary_maps_both_ways_and_rejects_renamed_canonical_names():
    orig = Vocabulary(WORDS, 0)
    assert orig.to_canonical("look at Red Box") == "look at Red Box"
    assert orig.to_surface("look at box") == "look at box"
    v1 = Vocabulary(WORDS, 1)
    assert v1.name == "perturbation_1"
    assert v1.to_surface("look at red box") == "examine red box"
    assert v1.to_surface("look") == "observe"
    assert v1.to_canonical("Examine red box") == "look at red box"
    assert v1.to_canonical("observe") == "look"
    assert v1.to_canonical("walk  north") == "go north"
    # Canonical wording of a renamed action is refused; unknown verbs go to the simulator as typed.
    assert v1.to_canonical("look at box") is None
    assert v1.to_canonical("look") is None
    assert v1.to_canonical("dance wildly") == "dance wildly"
    # Whole words only: "gopher" is not "go".
    assert v1.to_canonical("gopher") == "gopher"
    # Words with fewer variants cycle through them.
    assert Vocabulary(WORDS, 2).surface("go") == "walk"
    assert "- examine OBJ: examine OBJ" in v1.describe()


def test_vocabulary_refuses_ambiguous_rewordings():
    clash = (
        ActionWord("open", "{verb} X", "d", (("take", "d"),)),
        ActionWord("take", "{verb} X", "d", (("grab", "d"),)),
    )
    with pytest.raises(ValueError, match="is itself an action"):
        Vocabulary(clash, 1)
    dup = (ActionWord("a", "{verb}", "d", (("x", "d"),)), ActionWord("b", "{verb}", "d", (("x", "d"),)))
    with pytest.raises(ValueError, match="share a surface name"):
        Vocabulary(dup, 1)


def _all_vocabularies():
    from agentrefine_jax.eval.envs import babyai, sciworld, textworld
    from agentrefine_jax.eval.envs.pddl import DOMAINS

    sets = {"babyai": babyai.WORDS, "sciworld": sciworld.WORDS, "textworld": textworld.WORDS}
    sets.update({f"pddl:{d}": t.words for d, t in DOMAINS.items()})
    return sets


@pytest.mark.parametrize("name", sorted(_all_vocabularies()))
def test_every_shipped_perturbation_is_consistent(name):
    words = _all_vocabularies()[name]
    assert Vocabulary.num_variants(words) == 3
    for p in range(4):
        vocab = Vocabulary(words, p)  # raises on clashes
        for w in words:
            cmd = f"{w.canonical} thing"
            surface = vocab.to_surface(cmd)
            assert vocab.to_canonical(surface) == cmd, (p, w.canonical, surface)
            if p:
                assert surface != cmd
        descriptions = vocab.describe()
        assert len(descriptions.splitlines()) == len(words)
