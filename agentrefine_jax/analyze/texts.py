"""The texts `analyze diversity` compares, read through the data stage's own readers.

A source is any dataset the data stage reads (JSONL/JSON/parquet files, directories, `datasets`
names) in any of its layouts (`data.format` presets: canonical, sharegpt = AgentRefine,
agentinstruct, agentflan, agenttraj), mapped onto canonical rows by `data.schema.normalize_row`.
From each row we take:

* the **Thought** of every assistant turn: the text after `Thought:` up to the next
  `Action:` / `Act:` / `Observation:` line (assistant turns without one are counted);
* its **environment description**: the system message (if any) and the first user turn.

Rows are sampled (seeded) before they are read, so a cap bounds the reading too.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from agentrefine_jax.data.schema import RowError, normalize_row, resolve_field_map
from agentrefine_jax.data.sources import RecordSet

_THOUGHT = re.compile(
    r"(?:^|\n)\s*thought\s*:\s*(.*?)(?=\n\s*(?:action|act|observation)\s*:|\Z)", re.IGNORECASE | re.DOTALL
)


class TextsError(ValueError):
    """A source that yields nothing to compare: one line for the CLI."""


@dataclasses.dataclass
class SourceTexts:
    label: str
    # (row id, message index, Thought text)
    thoughts: list[tuple[str, int, str]]
    # (row id, environment text)
    environments: list[tuple[str, str]]
    rows_total: int
    rows_read: int
    assistant_turns: int
    without_thought: int
    skipped: collections.Counter[str]


def thought_of(content: str) -> str | None:
    m = _THOUGHT.search(content)
    if not m:
        return None
    text = " ".join(m.group(1).split())
    return text or None


def read_source(
    label: str,
    specs: Sequence[str],
    fmt: str = "auto",
    field_map: Mapping[str, Any] | None = None,
    *,
    max_rows: int | None = None,
    max_thoughts: int | None = None,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> SourceTexts:
    """Read (a seeded sample of) one source's rows and extract its Thoughts and environments."""
    records = RecordSet(list(specs))
    fm = resolve_field_map(fmt, field_map)
    rng = np.random.default_rng([seed, _stable(label)])
    order = rng.permutation(len(records))
    if max_rows is not None:
        order = order[:max_rows]
    thoughts: list[tuple[str, int, str]] = []
    envs: list[tuple[str, str]] = []
    skipped: collections.Counter[str] = collections.Counter()
    assistant = without = 0
    chunk = 256
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        for (_where, raw), idx in zip(records.read(part.tolist()), part, strict=True):
            if isinstance(raw, RowError):
                skipped[raw.reason] += 1
                continue
            try:
                row = normalize_row(raw, fm, fallback_id=f"{label}-{int(idx)}")
            except RowError as e:
                skipped[e.reason] += 1
                continue
            msgs = row["messages"]
            env = [m["content"] for m in msgs if m["role"] == "system"][:1]
            env += [m["content"] for m in msgs if m["role"] == "user"][:1]
            envs.append((row["id"], "\n".join(env)))
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                assistant += 1
                text = thought_of(m["content"])
                if text is None:
                    without += 1
                else:
                    thoughts.append((row["id"], i, text))
        if progress:
            progress(len(part), len(order))  # rows just read, rows this source will read
    if not thoughts:
        raise TextsError(
            f"source {label!r}: no assistant turn with a 'Thought:' in {len(order)} row(s) read "
            f"({assistant} assistant turns, {sum(skipped.values())} rows skipped"
            f"{': ' + str(dict(skipped)) if skipped else ''}); check --format"
        )
    if max_thoughts is not None and len(thoughts) > max_thoughts:
        keep = np.sort(rng.choice(len(thoughts), size=max_thoughts, replace=False))
        thoughts = [thoughts[i] for i in keep]
    if max_thoughts is not None and len(envs) > max_thoughts:
        keep = np.sort(rng.choice(len(envs), size=max_thoughts, replace=False))
        envs = [envs[i] for i in keep]
    return SourceTexts(label, thoughts, envs, len(records), len(order), assistant, without, skipped)


def _stable(label: str) -> int:
    """A per-source seed component that does not depend on Python's string-hash seed."""
    return zlib.crc32(label.encode("utf-8"))
