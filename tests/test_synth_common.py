"""Shared material for the synth tests (no tests here): a script, trajectories, replay rules."""

from __future__ import annotations

import copy
import json
from typing import Any

SCRIPT_REPLY = {
    "environment": "A small kitchen. The fridge (closed) holds eggs and milk. A pan hangs above the stove. "
    "A clean plate is on the counter.",
    "task": "Fry an egg and serve it on the plate.",
    "available_actions": [
        {"action": "take {object} from {place}", "description": "Pick up an object from a place."},
        {"action": "put {object} on {place}", "description": "Put a held object on a place."},
        {"action": "open {container}", "description": "Open a container."},
        {"action": "cook {food} in {utensil}", "description": "Cook food in a utensil on the stove."},
        {"action": "look", "description": "Describe the surroundings."},
    ],
}
# The script as `generate` stores it (templates + descriptions aside).
SCRIPT = {
    "environment": SCRIPT_REPLY["environment"],
    "task": SCRIPT_REPLY["task"],
    "available_actions": [a["action"] for a in SCRIPT_REPLY["available_actions"]],
    "action_descriptions": {a["action"]: a["description"] for a in SCRIPT_REPLY["available_actions"]},
}

# Markers that tell the replay server which stage a request belongs to.
SCRIPT_STAGE = "Imagine an interactive environment"
FRESH_STAGE = "Write the complete interaction"
CONTINUE_STAGE = "Continue the interaction from exactly this point"


def dm(observation: str, error: bool = False, success: bool = False) -> dict[str, Any]:
    return {"role": "dm", "observation": observation, "error": error, "task_success": success}


def player(thought: str, action: str) -> dict[str, Any]:
    return {"role": "player", "thought": thought, "action": action}


def good_turns() -> list[dict[str, Any]]:
    """13 turns, two DM-flagged errors (turns 2 and 8); turn 7 is not an available action."""
    return [
        dm("You are in the kitchen. The fridge is closed. A pan hangs above the stove."),  # 0
        player("I need an egg from the fridge.", "take egg from fridge"),  # 1
        dm("The fridge is closed; you cannot take anything from it.", error=True),  # 2
        player("The fridge is closed, I must open it first.", "open fridge"),  # 3
        dm("You open the fridge. You see eggs and milk."),  # 4
        player("Now I can take an egg.", "take egg from fridge"),  # 5
        dm("You take an egg from the fridge."),  # 6
        player("Let me fry it.", "fry egg"),  # 7: not an available action, flagged below
        dm("'fry egg' is not a valid action. Valid: cook {food} in {utensil}, ...", error=True),  # 8
        player("I should use the cook action with the pan.", "cook egg in pan"),  # 9
        dm("The egg sizzles in the pan and is now fried."),  # 10
        player("Serve it on the plate.", "put fried egg on plate"),  # 11
        dm("The fried egg is on the plate. Task complete.", success=True),  # 12
    ]


def raw(turns: list[dict[str, Any]] | None = None, rid: str = "t1") -> dict[str, Any]:
    return {
        "id": rid,
        "persona": "a home cook",
        "script": copy.deepcopy(SCRIPT),
        "turns": good_turns() if turns is None else turns,
    }


def reply(obj: Any, prompt_tokens: int = 100, completion_tokens: int = 50) -> dict[str, Any]:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {"content": text, "usage": usage}


def script_reply(**kw: Any) -> dict[str, Any]:
    return reply("Here is the script:\n```json\n" + json.dumps(SCRIPT_REPLY) + "\n```", **kw)


def bad_prefix_turns() -> list[dict[str, Any]]:
    """Fails Algorithm 1 at turn 5 (unflagged invalid action): verified prefix = 5 turns."""
    turns = good_turns()
    turns[5] = player("Grab the egg.", "grab egg")
    turns[6] = dm("You grab an egg.")
    return turns


def persona_rules(
    token: str,
    *,
    script: list[dict] | None = None,
    fresh: list[dict] | None = None,
    cont: list[dict] | None = None,
) -> list[dict[str, Any]]:
    rules = []
    for stage, marker, replies in (
        ("script", SCRIPT_STAGE, script),
        ("fresh", FRESH_STAGE, fresh),
        ("continue", CONTINUE_STAGE, cont),
    ):
        if replies:
            rules.append({"name": f"{token}/{stage}", "match": [token, marker], "replies": replies})
    return rules


def read_jsonl(path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
