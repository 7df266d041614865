"""The HotpotQA agent prompt: a ReAct/LATS-style instruction and two worked examples (written for this
project) in the harness's `Thought:`/`Action:`/`Observation:` turn format."""

from __future__ import annotations

from agentrefine_jax.eval.perturb import ActionWord

INTRO = (
    "Answer a question by interleaving Thought, Action and Observation steps. Thought reasons about "
    "the current situation; Action looks things up in Wikipedia or gives the final answer. An action "
    "is one of the three forms below, with its argument in square brackets. The answer should be a "
    "short span (a name, a date, a number) or yes/no, not a sentence."
)

WORDS = (
    ActionWord(
        "search",
        "{verb}[ENTITY]",
        "searches the exact entity on Wikipedia and returns the first sentences of its page if it "
        "exists; if not, it returns some similar entities to search",
    ),
    ActionWord(
        "lookup",
        "{verb}[KEYWORD]",
        "returns the next sentence containing KEYWORD in the page last found by search",
    ),
    ActionWord("finish", "{verb}[ANSWER]", "gives ANSWER as the final answer and ends the task"),
)

# Each example is a list of lines joined by newlines (kept under the line-length limit).
_EXAMPLE_LINES = (
    (
        "Question: In which city was the engineer whose company built the Eiffel Tower born?",
        "Thought: I need to find whose company built the Eiffel Tower, then where that engineer was born.",
        "Action: search[Eiffel Tower]",
        "Observation: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in "
        "Paris, France. It is named after the engineer Gustave Eiffel, whose company designed and "
        "built the tower between 1887 and 1889.",
        "Thought: The tower was built by the company of Gustave Eiffel. I need his birthplace, so I"
        " search Gustave Eiffel.",
        "Action: search[Gustave Eiffel]",
        "Observation: Alexandre Gustave Eiffel was a French civil engineer. He made his name with "
        "bridges for the French railway network, most famously the Garabit Viaduct.",
        'Thought: These sentences do not say where he was born. I look up the word "born" on his page.',
        "Action: lookup[born]",
        "Observation: (Result 1 / 1) Eiffel was born in Dijon, in the Côte-d'Or department of "
        "Burgundy, France.",
        "Thought: Gustave Eiffel was born in Dijon, so the answer is Dijon.",
        "Action: finish[Dijon]",
    ),
    (
        "Question: Were the Beatles and Queen formed in the same city?",
        "Thought: I need the city where each band was formed, then compare them.",
        "Action: search[The Beatles]",
        "Observation: The Beatles were an English rock band formed in Liverpool in 1960. The core "
        "line-up of the band comprised John Lennon, Paul McCartney, George Harrison and Ringo "
        "Starr.",
        "Thought: The Beatles were formed in Liverpool. Now I search Queen.",
        "Action: search[Queen]",
        "Observation: Could not find Queen. Similar: ['Queen (band)', 'Queen Victoria', 'Queen "
        "Elizabeth II', 'Queen consort', 'Queen Latifah'].",
        "Thought: The band's page is Queen (band).",
        "Action: search[Queen (band)]",
        "Observation: Queen are a British rock band formed in London in 1970 by Freddie Mercury, "
        "Brian May and Roger Taylor.",
        "Thought: The Beatles were formed in Liverpool and Queen in London, which are different "
        "cities. The answer is no.",
        "Action: finish[no]",
    ),
)
EXAMPLES = tuple("\n".join(lines) for lines in _EXAMPLE_LINES)


def instruction(actions: str) -> str:
    """The instruction block: description, the action list (`Vocabulary.describe()`), the examples."""
    examples = "\n\n".join(EXAMPLES)
    return f"{INTRO}\n\nAvailable actions:\n{actions}\n\nHere are examples:\n{examples}\n(END OF EXAMPLES)"
