"""The agent's chat layout, owned here for every stage that writes or reads agent conversations.

`synth convert` builds training conversations with it and the offline `eval` harness builds its prompts with
it, so a model meets at test time the layout it was tuned on. Two styles (`--prompt-style`):

- `chat` (multi-turn): system = the agent's answer-format rules; first user turn = the environment's
  instruction (description and action list), the "check valid actions" hint, the goal and `Observation: ...`;
  each assistant turn is `Thought: ...\\nAction: ...`; each later user turn is `Observation: ...`.
- `agentboard` (AgentBoard's VanillaAgent layout): one user message rebuilt every step from the instruction,
  `\\nHere are examples:\\n` + examples, `You should perform actions to accomplish the goal: ...`, the help
  line(s), the `Observation: ...` / `Action: ...` history joined by newlines and a closing `\\nAction: `.
  The AgentBoard-protocol evaluation (eval/agentboard) assembles its prompts with `agentboard_user`.
"""

from __future__ import annotations

from collections.abc import Sequence

PROMPT_STYLES = ("chat", "agentboard")
CHECK_VALID_ACTIONS = "check valid actions"

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves tasks by interacting with an environment. "
    "At every turn, first think about what to do next, then choose exactly one action. "
    "Always answer in this format:\n"
    "Thought: <your reasoning>\n"
    "Action: <one action>\n"
    "If the environment reports an error, use its feedback to correct your next action."
)

# AgentBoard's fixed sentences (VanillaAgent.make_prompt).
GOAL_PREFIX = "You should perform actions to accomplish the goal: "
HELP_PREFIX = "You should use the following commands for help when your action cannot be understood: "
EXAMPLES_HEADER = "\nHere are examples:\n"


def check_style(style: str) -> str:
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; choose from {', '.join(PROMPT_STYLES)}")
    return style


def assistant_turn(thought: str, action: str) -> str:
    return f"Thought: {thought}\nAction: {action}"


def observation_turn(observation: str) -> str:
    return f"Observation: {observation.strip()}"


def first_user_turn(instruction: str, goal: str, observation: str | None) -> str:
    """`chat` style's opening user turn: instruction, the help hint, the goal, the first observation."""
    text = (
        f"{instruction.strip()}\n\n"
        f'You can also use the action "{CHECK_VALID_ACTIONS}" to list the actions that are valid now.\n\n'
        f"Your goal: {goal.strip()}"
    )
    return text if observation is None else f"{text}\n\n{observation_turn(observation)}"


def agentboard_head(
    instruction: str,
    examples: Sequence[str],
    goal: str,
    check_actions: str | None = CHECK_VALID_ACTIONS,
    check_inventory: bool = False,
    need_goal: bool = True,
) -> str:
    """Everything before the history in AgentBoard's single user message (never truncated)."""
    head = instruction
    if examples:
        head += EXAMPLES_HEADER + "".join(e + "\n" for e in examples)
    if need_goal:
        head += GOAL_PREFIX + goal + "\n"
    if check_actions is not None:
        head += HELP_PREFIX + check_actions + "\n"
    if check_inventory:
        head += HELP_PREFIX + "inventory\n"  # the word is fixed whatever the config says
    return head


def history_lines(history: Sequence[tuple[str, str]]) -> list[str]:
    """("Observation" | "Action", text) items as AgentBoard's `Kind: text` lines."""
    return [f"{kind}: {text}" for kind, text in history]


def agentboard_user(head: str, lines: Sequence[str]) -> str:
    return head + "\n".join(lines) + "\nAction: "


def agentboard_messages(
    system: str, instruction: str, goal: str, history: Sequence[tuple[str, str]], examples: Sequence[str] = ()
) -> list[dict[str, str]]:
    """`agentboard` style's whole prompt for the next step: the system message and one user message."""
    user = agentboard_user(agentboard_head(instruction, examples, goal), history_lines(history))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
