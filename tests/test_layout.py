"""One agent chat layout (agentrefine_jax.layout) for `synth convert` and the eval harness: what the harness
sends in each `--prompt-style` is exactly the layout's rendering of the episode so far."""

from __future__ import annotations

import pytest

from agentrefine_jax.eval import EvalConfig, OraclePolicy, run_eval
from agentrefine_jax.layout import (
    SYSTEM_PROMPT,
    agentboard_head,
    agentboard_messages,
    agentboard_user,
    check_style,
    first_user_turn,
)


class Recording(OraclePolicy):
    """The reference solver, keeping every request's messages (what a model would have been sent)."""

    def __init__(self):
        self.seen: list[list[dict[str, str]]] = []

    def act(self, requests):
        self.seen += [[dict(m) for m in r.messages] for r in requests]
        return super().act(requests)


def _run(style: str, tmp_path) -> tuple[Recording, dict]:
    policy = Recording()
    cfg = EvalConfig(tasks=("babyai",), episodes=1, batch_size=1, workdir=str(tmp_path), prompt_style=style)
    return policy, run_eval(policy, cfg, log=lambda _m: None)


def test_agentboard_style_sends_one_user_message_rebuilt_from_the_history(tmp_path):
    pytest.importorskip("minigrid")
    policy, doc = _run("agentboard", tmp_path)
    [episode] = doc["episodes"]
    assert episode["success"] and len(policy.seen) == episode["steps"] >= 2
    transcript = episode["messages"]  # the chat-form record: system, opening, then assistant/observation
    first_obs = transcript[1]["content"].split("Observation: ", 1)[1]
    goal = transcript[1]["content"].split("Your goal: ", 1)[1].split("\n\n", 1)[0]
    instruction = transcript[1]["content"].split("\n\nYou can also use", 1)[0]
    history = [("Observation", first_obs)]
    for k, sent in enumerate(policy.seen):
        assert sent == agentboard_messages(SYSTEM_PROMPT, instruction, goal, history)
        assert sent[1]["content"].startswith(agentboard_head(instruction, (), goal))
        observation = transcript[3 + 2 * k]["content"].removeprefix("Observation: ")
        history = [*history, ("Action", episode["trace"][k]["action"]), ("Observation", observation)]
    assert policy.seen[0][1]["content"] == agentboard_user(
        agentboard_head(instruction, (), goal), [f"Observation: {first_obs}"]
    )


def test_chat_style_is_the_multi_turn_transcript(tmp_path):
    pytest.importorskip("minigrid")
    policy, doc = _run("chat", tmp_path)
    [episode] = doc["episodes"]
    first = policy.seen[0]
    assert first[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert first[1]["content"].startswith(first_user_turn("x", "y", None).split("x", 1)[0])
    assert "Your goal: " in first[1]["content"] and "\n\nObservation: " in first[1]["content"]
    # Each later request extends the previous one by the assistant reply and `Observation: ...`.
    for before, after in zip(policy.seen, policy.seen[1:], strict=False):
        assert after[: len(before)] == before and after[len(before)]["role"] == "assistant"
        assert after[len(before) + 1]["content"].startswith("Observation: ")
    assert episode["messages"][: len(policy.seen[-1])] == policy.seen[-1]


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="unknown prompt style"):
        check_style("other")
