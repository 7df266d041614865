"""HotpotQA as a text environment: ReAct's Wikipedia actions over a search backend, scored by EM/F1.

Semantics follow ReAct's `WikiEnv` (the environment LATS evaluates in):
- `search[entity]`: the page's first five sentences, or `Could not find X. Similar: [...]`; a new
  page resets lookup;
- `lookup[keyword]`: the next sentence of the current page containing the keyword (case-insensitive),
  as `(Result i / n) ...`, then `No more results.`; a different keyword starts over;
- `finish[answer]`: ends the episode. Success is exact match, progress is token F1 (see scoring.py).
An episode that runs out of steps without `finish` scores 0/0, as ReAct's forced `finish[]` does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from agentrefine_jax.eval.envs.base import EvalTask, StepResult, TextEnv, rejected
from agentrefine_jax.eval.hotpotqa import prompt
from agentrefine_jax.eval.hotpotqa.data import PAPER_NUM_QUESTIONS, Question, load_questions, sample_indices
from agentrefine_jax.eval.hotpotqa.scoring import exact_match, f1_score
from agentrefine_jax.eval.hotpotqa.search import (
    DEFAULT_WIKIPEDIA_URL,
    ContextBackend,
    NotFound,
    SearchBackend,
    WikipediaBackend,
    title_key,
)
from agentrefine_jax.eval.perturb import Vocabulary

BACKENDS = ("context", "wikipedia")
# ReAct's and LATS's HotpotQA agents get 7 steps (LATS: depth limit 7).
DEFAULT_MAX_STEPS = 7
PAGE_SENTENCES = 5
DEFAULT_REQUEST_TIMEOUT = 20.0
OPTIONS = ("data", "backend", "wikipedia_url", "request_timeout")
START = "Interact with Wikipedia using search[], lookup[], and finish[]."
INVALID = "Invalid action: {action}. Use search[entity], lookup[keyword] or finish[answer]."

_ACTION = re.compile(r"^(search|lookup|finish)\s*\[(.*)\]$", re.IGNORECASE | re.DOTALL)
# A name: capitalised words (or numbers), possibly joined by a few lower-case connectors ("Bank of England").
_NAME = re.compile(r"[A-Z0-9][\w'’.-]*(?:\s+(?:(?:of|the|de|von|van|da)\s+)*[A-Z0-9][\w'’.-]*)*")
_POSSESSIVE = re.compile(r"(?:['’]s?|\.)$")
# Capitalised only because they open the question ("Which", "Were The Lanterns ...").
_QUESTION_WORDS = frozenset(
    "are can could did do does has have how in is of on was were what when where which who whom whose "
    "why".split()
)


def question_names(question: str) -> list[str]:
    """Capitalised spans of a question (its named entities, roughly), in order, without repeats."""
    out: list[str] = []
    for match in _NAME.finditer(question):
        words = _POSSESSIVE.sub("", match.group(0)).split()
        while words and words[0].lower() in _QUESTION_WORDS:
            words = words[1:]
        name = " ".join(words)
        if name and name not in out:
            out.append(name)
    return out


class HotpotQAEnv(TextEnv):
    task = "hotpotqa"
    intro = prompt.INTRO

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary, question: Question, backend: SearchBackend):
        super().__init__(spec, vocab)
        self.question = question
        self.backend = backend
        self.answer: str | None = None
        self._sentences: tuple[str, ...] | None = None
        self._lookup: tuple[str, list[str], int] | None = None
        self._searched: set[str] = set()

    @property
    def instruction(self) -> str:
        return prompt.instruction(self.vocab.describe())

    def _reset(self) -> tuple[str, str]:
        self.answer, self._sentences, self._lookup, self._searched = None, None, None, set()
        return f"answer this question: {self.question.question}", START

    def _step(self, canonical: str) -> StepResult:
        match = _ACTION.match(canonical.strip())
        if match is None:
            return rejected(INVALID.format(action=canonical))
        verb, arg = match.group(1).lower(), " ".join(match.group(2).split())
        if verb == "finish":
            self.answer = arg
            em = exact_match(arg, self.question.answer)
            return StepResult(
                f"Episode finished, reward = {int(em)}",
                done=True,
                success=em,
                progress=f1_score(arg, self.question.answer),
            )
        if not arg:
            return rejected(f"Invalid action: {verb}[] needs an argument inside the brackets.")
        if verb == "search":
            return StepResult(self._search(arg))
        return StepResult(self._lookup_next(arg))

    def _search(self, entity: str) -> str:
        self._searched.add(title_key(entity))
        found = self.backend.search(entity)
        if isinstance(found, NotFound):
            return f"Could not find {entity}. Similar: {list(found.similar)}."
        self._sentences, self._lookup = found.sentences, None
        return " ".join(found.sentences[:PAGE_SENTENCES]) or f"The page {found.title} has no text."

    def _lookup_next(self, keyword: str) -> str:
        if self._lookup is None or self._lookup[0] != keyword:
            needle = keyword.lower()
            hits = [s for s in self._sentences or () if needle in s.lower()]
            self._lookup = (keyword, hits, 0)
        word, hits, i = self._lookup
        if i >= len(hits):
            return "No more results."
        self._lookup = (word, hits, i + 1)
        return f"(Result {i + 1} / {len(hits)}) {hits[i]}"

    def _valid_canonical(self) -> list[str]:
        """What "check valid actions" lists and the random policy draws from: searches, lookups (with a
        page open) and answers built from the names in the question, and yes/no. Never the context's
        titles: listing them would hand the agent the gold pages the paper's agent had to find."""
        names = question_names(self.question.question)
        actions = [f"search[{n}]" for n in names]
        if self._sentences is not None:
            actions += [f"lookup[{n}]" for n in names]
        return actions + [f"finish[{n}]" for n in names] + ["finish[yes]", "finish[no]"]

    def _oracle_canonical(self) -> str:
        for title in self.question.supporting_titles:
            if title_key(title) not in self._searched:
                return f"search[{title}]"
        return f"finish[{self.question.answer}]"


class HotpotQATask(EvalTask):
    """The paper's Figure 8 task: questions sampled from the user's HotpotQA data, one episode each."""

    name = "hotpotqa"
    display_name = "HotpotQA"
    # Not part of the held-out average (Figure 8 is reported on its own).
    default_max_steps = DEFAULT_MAX_STEPS
    default_episodes = PAPER_NUM_QUESTIONS
    words = prompt.WORDS

    def __init__(self, workdir: str, *, questions: Sequence[Question] | None = None, **options: Any):
        """`options` (strings from the CLI's task options are accepted): `data` (a file or
        hf:NAME[:CONFIG[:SPLIT]]), `backend` (context | wikipedia), `wikipedia_url` (the MediaWiki API
        endpoint), `request_timeout` (seconds per Wikipedia request, overall). `questions` bypasses `data`."""
        super().__init__(workdir)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown hotpotqa option(s) {unknown}; choose from {', '.join(OPTIONS)}")
        backend = str(options.get("backend", "context"))
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown HotpotQA search backend {backend!r}; choose from {', '.join(BACKENDS)}"
            )
        try:
            timeout = float(options.get("request_timeout", DEFAULT_REQUEST_TIMEOUT))
        except ValueError:
            raise ValueError(
                f"hotpotqa request_timeout must be a number, got {options['request_timeout']!r}"
            ) from None
        if questions is None:
            if not options.get("data"):
                raise ValueError(
                    "HotpotQA needs its questions: --task-option hotpotqa.data=FILE (official JSON, JSONL, "
                    "parquet) or hotpotqa.data=hf:NAME[:CONFIG[:SPLIT]]"
                )
            questions = load_questions(str(options["data"]))
        self.questions = list(questions)
        self.backend = backend
        self._wikipedia = (
            WikipediaBackend(str(options.get("wikipedia_url", DEFAULT_WIKIPEDIA_URL)), timeout=timeout)
            if backend == "wikipedia"
            else None
        )

    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        out = []
        for index in sample_indices(len(self.questions), n, seed):
            q = self.questions[index]
            out.append(
                {"index": index, "id": q.id, "question": q.question, "answer": q.answer, "type": q.type}
            )
        return out

    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> HotpotQAEnv:
        question = self.questions[spec["index"]]
        if question.id != spec["id"]:
            raise ValueError(
                f"episode spec {spec['id']!r} does not match question {question.id!r} of the data"
            )
        backend = self._wikipedia or ContextBackend(question.context)
        return HotpotQAEnv(spec, self.vocabulary(perturbation), question, backend)
