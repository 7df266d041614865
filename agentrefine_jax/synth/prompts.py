"""Every prompt of the synthesis pipeline, in one place (paper §3, Figure 4).

Stage 1, script generation: a persona conditions an environment, a task and the actions
available in it (with `{slot}` parameters).  Stage 2, trajectory generation: one LLM plays
both the Dungeon Master (the environment) and the Player (the agent) and writes the whole
multi-turn interaction, with at least one erroneous Player action that the DM flags and the
Player then refines.  A trajectory that fails Algorithm 1 is regenerated from its verified
prefix with `continue_messages`.  `script_instruction` is what the tuned agent is told of its environment.
"""

from __future__ import annotations

from typing import Any

from agentrefine_jax.outputs import json_dumps

SCRIPT_SYSTEM = """\
You design text-based agent environments for training AI agents. You write precise, \
self-consistent scripts in JSON."""

SCRIPT_USER = """\
Here is a persona:
{persona}

Imagine an interactive environment this persona would plausibly work or live in, and a task \
the persona might delegate to an assistant agent acting in that environment. Write a script \
with:

1. "environment": a detailed description of the environment: its locations, the objects in \
each location and their states, tools, and any rules or constraints. An agent that reads \
only this description must have everything it needs.
2. "task": one concrete goal that takes several (roughly 5 to 15) actions to accomplish, with \
an unambiguous success condition.
3. "available_actions": the actions an agent may take, each an "action" template with \
parameters in curly braces (for example "take {{object}} from {{place}}") and a one-sentence \
"description". Include actions that are needed for the task and some that are not. Use between \
4 and 12 actions. Templates must be plain text; only parameters use curly braces.

Reply with exactly one JSON object and nothing else:
{{"environment": "...", "task": "...", "available_actions": [{{"action": "...", "description": "..."}}]}}"""

TRAJECTORY_SYSTEM = """\
You write interaction logs between a Dungeon Master (DM), who simulates an environment \
faithfully and strictly, and a Player, an AI agent solving a task in it. You output JSON only."""

_TURN_FORMAT = """\
Each turn is one JSON object:
- DM turn: {"role": "dm", "observation": "<what the Player observes>", \
"error": <true if the Player's previous action was invalid, impossible or wrong, else false>, \
"task_success": <true only when the task is now fully accomplished>}
- Player turn: {"role": "player", "thought": "<the Player's reasoning>", \
"action": "<exactly one available action with every {parameter} filled in>"}

Rules:
- The first turn is a DM turn that describes the initial situation (error and task_success false).
- Turns alternate strictly: DM, Player, DM, Player, ..., and the last turn is a DM turn with \
"task_success": true and "error": false.
- The Player makes at least one mistake: for example an action that is not in the list, a \
missing or wrong parameter, an object that is not there, or a step taken in the wrong order. The \
DM then answers with "error": true and an observation that explains what went wrong, the way \
a real environment would. The Player's next thought notices the feedback and the Player \
corrects course.
- Every Player action that is not flagged as an error must match an available action template.
- The DM never reveals the solution; it only reports the consequences of actions."""


def _script_block(script: dict[str, Any]) -> str:
    return json_dumps(script, ensure_ascii=False, indent=2)


def script_messages(persona: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SCRIPT_SYSTEM},
        {"role": "user", "content": SCRIPT_USER.format(persona=persona)},
    ]


def trajectory_messages(persona: str, script: dict[str, Any]) -> list[dict[str, str]]:
    user = (
        f"Persona of the person who set the task:\n{persona}\n\n"
        f"Script:\n{_script_block(script)}\n\n"
        "Write the complete interaction between the DM and the Player for this script.\n\n"
        f"{_TURN_FORMAT}\n\n"
        'Reply with exactly one JSON object and nothing else: {"turns": [ ... ]}'
    )
    return [{"role": "system", "content": TRAJECTORY_SYSTEM}, {"role": "user", "content": user}]


def continue_messages(
    persona: str, script: dict[str, Any], prefix: list[dict[str, Any]], failure: str
) -> list[dict[str, str]]:
    """Regeneration continuing from the verified prefix (only the remaining turns are asked for)."""
    user = (
        f"Persona of the person who set the task:\n{persona}\n\n"
        f"Script:\n{_script_block(script)}\n\n"
        "The interaction below was started but a later turn was rejected by a checker "
        f"({failure}). These first {len(prefix)} turns were accepted and stay as they are:\n"
        f"{json_dumps(prefix, ensure_ascii=False, indent=2)}\n\n"
        "Continue the interaction from exactly this point until the task is accomplished.\n\n"
        f"{_TURN_FORMAT}\n\n"
        "Reply with exactly one JSON object containing only the NEW turns that come after the "
        'accepted ones, and nothing else: {"turns": [ ... ]}'
    )
    return [{"role": "system", "content": TRAJECTORY_SYSTEM}, {"role": "user", "content": user}]


def script_instruction(script: dict[str, Any]) -> str:
    """The environment's instruction in a training conversation: its description and action list.

    agentrefine_jax.layout places it (first user turn in `chat` style, the single user message in `agentboard`
    style), exactly where the offline eval harness places each environment's own instruction."""
    descriptions: dict[str, str] = script.get("action_descriptions") or {}
    lines = []
    for item in script["available_actions"]:
        if isinstance(item, dict):
            template, desc = item["action"], item.get("description", "")
        else:
            template, desc = item, descriptions.get(item, "")
        lines.append(f"- {template}: {desc}" if desc else f"- {template}")
    actions = "\n".join(lines)
    return (
        f"{script['environment'].strip()}\n\n"
        "Available actions (replace every {parameter} with a concrete value):\n"
        f"{actions}"
    )
