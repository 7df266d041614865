"""HotpotQA questions from the user's file or a Hugging Face `datasets` name, and the paper's sampling.

Sources (`load_questions`):
- a JSON file in the official layout (`hotpot_dev_distractor_v1.json`, `hotpot_dev_fullwiki_v1.json`):
  a list of `{_id, question, answer, type, level, supporting_facts: [[title, sent_id]],
  context: [[title, [sentence, ...]]]}`; `.jsonl` holds one such record per line;
- a `.parquet` file (read with pyarrow), in the official layout or the Hugging Face one below;
- `hf:NAME[:CONFIG[:SPLIT]]` (defaults: config distractor, split validation; `hf:NAME::SPLIT` for a
  dataset without configurations), e.g. `hf:hotpotqa/hotpot_qa:distractor:validation`, read with the
  `datasets` package (imported only here). Its rows carry `id`, `supporting_facts: {title, sent_id}`
  and `context: {title, sentences}`; both layouts are accepted from every source.

The paper (after LATS) evaluates 300 questions sampled at random; `sample_indices` draws them with a
seeded shuffle, so the first k of a larger draw are the same questions as a draw of k.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

PAPER_NUM_QUESTIONS = 300
HF_PREFIX = "hf:"
HF_DEFAULT_CONFIG = "distractor"
HF_DEFAULT_SPLIT = "validation"


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    # "bridge" | "comparison" ("" when the file does not say).
    type: str
    level: str
    # Titles of the supporting paragraphs, in first-mention order.
    supporting_titles: tuple[str, ...]
    # (title, sentences) paragraphs shown with the question (2 gold + distractors in the official files).
    context: tuple[tuple[str, tuple[str, ...]], ...]


class DataError(ValueError):
    """The data source is missing or not in a HotpotQA layout (the CLI reports it in one line)."""


def load_questions(source: str) -> list[Question]:
    """Every question of a file or `hf:` dataset, validated; raises DataError on the first bad record."""
    rows = _read_rows(source)
    if not rows:
        raise DataError(f"{source}: no questions")
    questions = [_question(row, i, source) for i, row in enumerate(rows)]
    seen: set[str] = set()
    for q in questions:
        if q.id in seen:
            raise DataError(f"{source}: duplicate question id {q.id!r}")
        seen.add(q.id)
    return questions


def sample_indices(total: int, k: int, seed: int) -> list[int]:
    """k distinct question indices out of `total`, reproducible for a seed (a seeded shuffle's prefix)."""
    if k < 1:
        raise DataError(f"number of questions must be >= 1, got {k}")
    if k > total:
        raise DataError(f"asked for {k} questions but the data has only {total}")
    order = list(range(total))
    random.Random(seed).shuffle(order)
    return order[:k]


# --------------------------------------------------------------------------------------- reading


def _read_rows(source: str) -> list[Any]:
    if source.startswith(HF_PREFIX) and not os.path.exists(source):
        return _read_hf(source[len(HF_PREFIX) :])
    if not os.path.isfile(source):
        raise DataError(
            f"no such HotpotQA file: {source} (or name a datasets dataset as hf:NAME[:CONFIG[:SPLIT]])"
        )
    if source.endswith(".parquet"):
        return _read_parquet(source)
    try:
        with open(source, encoding="utf-8") as f:
            if source.endswith(".jsonl"):
                return [json.loads(line) for line in f if line.strip()]
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise DataError(
            f"{source}: expected a JSON list of questions (the official layout), got {type(data).__name__}"
        )
    return data


def _read_parquet(path: str) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading a .parquet file needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file: {e}") from None


def _read_hf(spec: str) -> list[Any]:
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(f"bad datasets source hf:{spec}; expected hf:NAME[:CONFIG[:SPLIT]]")
    name = parts[0]
    # An empty CONFIG (hf:NAME::SPLIT) means the dataset's only configuration, e.g. a local parquet folder.
    config = (parts[1] or None) if len(parts) > 1 else HF_DEFAULT_CONFIG
    split = parts[2] if len(parts) > 2 and parts[2] else HF_DEFAULT_SPLIT
    try:
        import datasets
    except ImportError:
        raise DataError("hf: sources need the datasets package (pip install datasets)") from None
    try:
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:  # noqa: BLE001 - datasets raises many types (missing, offline, bad config)
        raise DataError(f"datasets could not load {name!r} config {config!r} split {split!r}: {e}") from None


# --------------------------------------------------------------------------------------- records


def _question(row: Any, i: int, source: str) -> Question:
    where = f"{source}: question {i}"
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected an object, got {type(row).__name__}")
    qid = row.get("_id", row.get("id"))
    if isinstance(qid, str) and qid:
        where += f" ({qid})"
    else:
        raise DataError(f"{where}: missing '_id'")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            hint = " (HotpotQA's test files carry no answers: use the dev set)" if key == "answer" else ""
            raise DataError(f"{where}: missing or non-text '{key}'{hint}")
    context = _context(row.get("context"), where)
    facts = _supporting_facts(row.get("supporting_facts"), where)
    titles = {t for t, _ in context}
    missing = [t for t in facts if t not in titles]
    if missing:
        raise DataError(f"{where}: supporting fact titles {missing} are not in its context")
    return Question(
        id=qid,
        question=row["question"].strip(),
        answer=row["answer"].strip(),
        type=str(row.get("type") or ""),
        level=str(row.get("level") or ""),
        supporting_titles=facts,
        context=context,
    )


def _titled_pair(x: Any) -> bool:
    """`[title, something]`: the shape of a context paragraph and of a supporting fact."""
    return isinstance(x, Sequence) and not isinstance(x, str) and len(x) == 2 and isinstance(x[0], str)


def _context(value: Any, where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    # Hugging Face layout: {"title": [...], "sentences": [[...], ...]}.
    if isinstance(value, Mapping) and "title" in value and "sentences" in value:
        value = list(zip(value["title"], value["sentences"], strict=False))
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise DataError(f"{where}: 'context' must be a non-empty list of [title, [sentences]]")
    out = []
    for para in value:
        if not _titled_pair(para) or isinstance(para[1], str) or not all(isinstance(s, str) for s in para[1]):
            raise DataError(f"{where}: 'context' entry {para!r:.80} is not [title, [sentences]]")
        out.append((para[0], tuple(s.strip() for s in para[1] if s.strip())))
    return tuple(out)


def _supporting_facts(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, Mapping) and "title" in value:
        value = list(zip(value["title"], value.get("sent_id", [0] * len(value["title"])), strict=False))
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise DataError(f"{where}: 'supporting_facts' must be a non-empty list of [title, sent_id]")
    titles: list[str] = []
    for fact in value:
        if not _titled_pair(fact):
            raise DataError(f"{where}: 'supporting_facts' entry {fact!r:.80} is not [title, sent_id]")
        if fact[0] not in titles:
            titles.append(fact[0])
    return tuple(titles)
