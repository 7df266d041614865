"""ReAct turn format shared by every environment and policy.

Each assistant turn is ``Thought: ...`` followed by ``Action: ...``; the environment's reply comes
back as the next user turn. This is the format the AgentRefine trajectories are written in, so a
model fine-tuned on them sees the same structure at evaluation time.
"""

from __future__ import annotations

import re

# The chat layout (system prompt, opening turn, observation turns) is owned by agentrefine_jax.layout.
from agentrefine_jax.layout import CHECK_VALID_ACTIONS, SYSTEM_PROMPT
from agentrefine_jax.layout import assistant_turn as format_response
from agentrefine_jax.layout import first_user_turn as build_first_user_message
from agentrefine_jax.layout import observation_turn as format_observation

__all__ = [
    "CHECK_VALID_ACTIONS",
    "FORMAT_ERROR",
    "SYSTEM_PROMPT",
    "build_first_user_message",
    "format_observation",
    "format_response",
    "parse_action",
]

FORMAT_ERROR = (
    "Error: your response could not be parsed. Reply with one line 'Thought: <your reasoning>' "
    "followed by one line 'Action: <one action>'."
)

# The first "Action:" wins; anything after a hallucinated next "Observation:" is ignored.
_ACTION_RE = re.compile(r"^\s*\**\s*action\s*\**\s*:\s*\**\s*(.*)$", re.IGNORECASE | re.MULTILINE)
_OBSERVATION_RE = re.compile(r"^\s*observation\s*:", re.IGNORECASE | re.MULTILINE)
_WRAPPERS = "`'\"*"


def parse_action(response: str) -> str | None:
    """Extract the action text of one assistant turn, or None when the turn is malformed.

    Models often decorate the action (quotes, backticks, markdown bold, a trailing full stop);
    those are stripped so a correct intent is not scored as a format error.
    """
    obs = _OBSERVATION_RE.search(response)
    head = response[: obs.start()] if obs else response
    match = _ACTION_RE.search(head)
    if match is None:
        return None
    action = match.group(1).strip()
    while True:  # peel decorations in any order, e.g. `open fridge`.
        peeled = action.strip(_WRAPPERS).strip()
        if peeled.endswith(".") and not peeled.endswith(".."):
            peeled = peeled[:-1].rstrip()
        if peeled == action:
            break
        action = peeled
    action = " ".join(action.split())
    return action or None
