"""HotpotQA (the paper's Figure 8): ReAct's Wikipedia-search agent task, scored by exact match and F1.

`data.py` reads the user's questions and samples the paper's 300; `search.py` holds the two search
backends (`context`: offline, the question's own paragraphs; `wikipedia`: MediaWiki's API);
`env.py` is the environment and task; `scoring.py` the answer normalisation, EM and F1;
`prompt.py` the instruction and worked examples. See docs/hotpotqa.md.
"""

from agentrefine_jax.eval.hotpotqa.data import (
    PAPER_NUM_QUESTIONS,
    DataError,
    Question,
    load_questions,
    sample_indices,
)
from agentrefine_jax.eval.hotpotqa.env import BACKENDS, HotpotQAEnv, HotpotQATask
from agentrefine_jax.eval.hotpotqa.scoring import exact_match, f1_score, normalize_answer
from agentrefine_jax.eval.hotpotqa.search import (
    DEFAULT_WIKIPEDIA_URL,
    ContextBackend,
    NotFound,
    Page,
    SearchError,
    WikipediaBackend,
)

# Figure 8 of the paper (EM / F1, %), for reports that set our numbers beside them.
PAPER_FIGURE8: dict[str, tuple[float, float]] = {
    "LLaMA-3-8B-Instruct": (29.3, 36.6),
    "AgentGym": (28.0, 37.4),
    "Agent-FLAN": (24.6, 32.4),
    "AgentRefine": (37.0, 44.6),
}

__all__ = [
    "BACKENDS",
    "DEFAULT_WIKIPEDIA_URL",
    "PAPER_FIGURE8",
    "PAPER_NUM_QUESTIONS",
    "ContextBackend",
    "DataError",
    "HotpotQAEnv",
    "HotpotQATask",
    "NotFound",
    "Page",
    "Question",
    "SearchError",
    "WikipediaBackend",
    "exact_match",
    "f1_score",
    "load_questions",
    "normalize_answer",
    "sample_indices",
]
