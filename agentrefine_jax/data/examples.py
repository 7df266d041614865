"""Parse + validate + tokenize + mask records into one flat, picklable token store.

Every record ends up either as an example or as a counted skip with its location. Order of
operations per row: map onto the canonical schema and validate -> trim trailing user turns
-> (drop_refinement_data) -> render with the chat template -> handle over-length -> skip if
no token carries loss (no 0/0 in the loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from agentrefine_jax.data.report import DataReport
from agentrefine_jax.data.schema import (
    FieldMap,
    RowError,
    assistant_categories,
    check_loss_on,
    drop_refinement_data,
    normalize_row,
    trim_trailing_users,
    validate_messages,
)
from agentrefine_jax.data.templates import ChatTemplate

OVERLENGTH_MODES = ("truncate", "drop")
_ENCODE_CHUNK = 256  # conversations per tokenizer batch call


@dataclasses.dataclass
class TokenStore:
    """Examples as flat arrays: example i is ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray  # int32
    mask: np.ndarray  # uint8
    offsets: np.ndarray  # int64, len n+1
    where: list[str]  # record location of each example

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]


def prepare_example(
    row: Any, field_map: FieldMap | None, fallback_id: str, drop_refinement: bool, report: DataReport
) -> tuple[str, list[dict[str, Any]]]:
    """Schema mapping, validation and the message-level edits -> (id, messages); raises RowError to skip."""
    conv = normalize_row(row, field_map, fallback_id)
    messages, trimmed = trim_trailing_users(conv["messages"])
    report.trailing_user_turns_trimmed += trimmed
    if drop_refinement:
        messages, removed = drop_refinement_data(messages)
        report.refinement_turns_removed += removed
        messages = validate_messages(messages)  # e.g. nothing but errors -> "no assistant turn"
    return conv["id"], messages


def prepare_messages(
    row: Any, field_map: FieldMap | None, fallback_id: str, drop_refinement: bool, report: DataReport
) -> list[dict[str, Any]]:
    return prepare_example(row, field_map, fallback_id, drop_refinement, report)[1]


def concat_stores(stores: Sequence[TokenStore]) -> TokenStore:
    """One store holding the examples of `stores`, in order."""
    lengths = np.concatenate([s.lengths for s in stores]) if stores else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenStore(
        ids=np.concatenate([s.ids for s in stores]) if stores else np.zeros(0, np.int32),
        mask=np.concatenate([s.mask for s in stores]) if stores else np.zeros(0, np.uint8),
        offsets=offsets,
        where=[w for s in stores for w in s.where],
    )


def fit_length(
    ids: list[int],
    mask: list[int],
    ends: list[int],
    messages: list[dict[str, Any]],
    max_length: int,
    overlength: str,
) -> tuple[list[int], list[int], int] | None:
    """Cut to the longest prefix ending after an assistant turn that fits; None to drop.

    Returns (ids, mask, number of messages kept).
    """
    if len(ids) <= max_length:
        return ids, mask, len(messages)
    if overlength == "drop":
        return None
    keep = [k for k, m in enumerate(messages) if m["role"] == "assistant" and ends[k] <= max_length]
    if not keep:
        return None
    cut = ends[keep[-1]]
    return ids[:cut], mask[:cut], keep[-1] + 1


def build_examples(
    records: Sequence[tuple[str, Any]],
    template: ChatTemplate,
    *,
    loss_on: Collection[str],
    max_length: int,
    overlength: str = "truncate",
    drop_refinement: bool = False,
    field_map: FieldMap | None = None,
    report: DataReport,
    seen_ids: dict[str, str] | None = None,
) -> TokenStore:
    """Examples of `records`, in order; `report` accumulates (call again for more records).

    `seen_ids` (id -> first location) carries duplicate-id detection across calls.
    """
    if overlength not in OVERLENGTH_MODES:
        raise ValueError(f"overlength must be one of {OVERLENGTH_MODES}, got {overlength!r}")
    if max_length < 8:
        raise ValueError(f"max_length={max_length} is too small")
    train = check_loss_on(loss_on)
    report.max_length = max_length
    seen_ids = {} if seen_ids is None else seen_ids
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    lengths: list[int] = []
    where_kept: list[str] = []

    pending: list[tuple[str, list[dict[str, Any]]]] = []

    def flush() -> None:
        encoded = template.encode_batch([m for _, m in pending], train)
        for (where, messages), (ids, mask, ends) in zip(pending, encoded, strict=True):
            fitted = fit_length(ids, mask, ends, messages, max_length, overlength)
            if fitted is None:
                first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
                report.skip(
                    where,
                    "overlength",
                    f"{len(ids)} tokens > max_length {max_length} "
                    + (
                        "(overlength=drop)"
                        if overlength == "drop"
                        else f"(first assistant turn ends at {ends[first]})"
                    ),
                )
                continue
            ids, mask, n_kept = fitted
            if n_kept < len(messages):
                report.truncated += 1
                messages = messages[:n_kept]
            n_loss = sum(mask)
            if n_loss == 0:
                report.skip(where, "no loss tokens", f"no assistant turn in loss_on={sorted(train)}")
                continue
            for cat in assistant_categories(messages):
                if cat is not None:
                    report.turns[cat] += 1
                    report.trained_turns[cat] += int(cat in train)
            ids_parts.append(np.asarray(ids, dtype=np.int32))
            mask_parts.append(np.asarray(mask, dtype=np.uint8))
            lengths.append(len(ids))
            where_kept.append(where)
            report.tokens += len(ids)
            report.loss_tokens += n_loss
        pending.clear()

    for where, row in records:
        if isinstance(row, RowError):
            report.skip(where, row.reason, row.detail)
            continue
        try:
            rid, messages = prepare_example(row, field_map, where, drop_refinement, report)
        except RowError as e:
            report.skip(where, e.reason, e.detail)
            continue
        report.parsed += 1
        if rid in seen_ids:
            report.duplicate(where, rid)
        else:
            seen_ids[rid] = where
        pending.append((where, messages))
        if len(pending) >= _ENCODE_CHUNK:
            flush()
    if pending:
        flush()

    report.examples += len(lengths)
    report.lengths = np.concatenate([report.lengths, np.asarray(lengths, dtype=np.int64)])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenStore(
        ids=np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
        mask=np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
        offsets=offsets,
        where=where_kept,
    )
