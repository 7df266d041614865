"""Parse + validate + tokenize + mask records into one flat, picklable token store.

Every record ends up either as an example or as a counted skip with its location. Order of
operations per row: map onto the canonical schema and validate -> trim trailing user turns
-> (drop_refinement_data) -> render with the chat template -> handle over-length -> skip if
no token carries loss (no 0/0 in the loss).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
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
# Token bytes (ids + mask) held in memory before a store moves to a temporary file; past it,
# memory holds only a `_SPILL_BUFFER` of not-yet-written tokens. The environment variable is
# for tests and for hosts with little memory.
SPILL_BYTES = int(os.environ.get("AGENTREFINE_DATA_SPILL_BYTES", 256 << 20))
_SPILL_BUFFER = 16 << 20


class FileArray:
    """A read-only 1-D array in an unlinked temporary file, read with pread.

    Not a memory map on purpose: mapped pages count in the process's RSS while they stay in
    the page cache, read pages here do not. Picklable for Grain's worker processes, which
    reopen the file through /proc/<owner>/fd (it has no name, so nothing is left behind when
    the owner is killed).
    """

    def __init__(self, fd: int, dtype: np.dtype, length: int, owner_pid: int | None = None):
        self.fd = fd
        self.dtype = np.dtype(dtype)
        self.length = length
        self.owner_pid = owner_pid or os.getpid()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("FileArray supports contiguous slices only")
        a, b, _ = index.indices(self.length)
        if b <= a:
            return np.zeros(0, self.dtype)
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self.fd, (b - a) * size, a * size), dtype=self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"owner_pid": self.owner_pid, "fd": self.fd, "dtype": self.dtype.str, "length": self.length}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.owner_pid = state["owner_pid"]
        self.dtype = np.dtype(state["dtype"])
        self.length = state["length"]
        self.fd = os.open(f"/proc/{self.owner_pid}/fd/{state['fd']}", os.O_RDONLY)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


@dataclasses.dataclass
class TokenStore:
    """Examples as flat arrays: example i is ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray | FileArray  # int32
    mask: np.ndarray | FileArray  # uint8
    offsets: np.ndarray  # int64, len n+1
    where: list[str]  # record location of each example

    @classmethod
    def from_parts(
        cls, ids_parts: list[np.ndarray], mask_parts: list[np.ndarray], lengths: list[int], where: list[str]
    ) -> TokenStore:
        """One store from per-example (or per-chunk) arrays, in order."""
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(
            ids=np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
            mask=np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.uint8),
            offsets=offsets,
            where=where,
        )

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


class StoreBuilder:
    """Appends stores; the result is in memory up to `spill_bytes` of tokens, else file-backed.

    The in-memory result is exactly what concatenating the stores gives; a file-backed one
    holds the same tokens (`TokenStore.example` reads them with pread), so what training
    sees does not depend on where the tokens are kept.
    """

    def __init__(self, spill_bytes: int | None = None):
        self.spill_bytes = SPILL_BYTES if spill_bytes is None else spill_bytes
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.held = 0
        self.files: tuple[Any, Any] | None = None
        self.written = 0  # tokens in the files
        self.lengths: list[np.ndarray] = []
        self.where: list[str] = []

    def __len__(self) -> int:
        return len(self.where)

    def add(self, store: TokenStore) -> None:
        self.lengths.append(store.lengths)
        self.where.extend(store.where)
        if isinstance(store.ids, np.ndarray):
            self.pending.append((store.ids, store.mask))
            self.held += store.ids.nbytes + store.mask.nbytes
        else:  # a file-backed store: copied through in blocks
            n = len(store.ids)
            for a in range(0, n, _SPILL_BUFFER):
                b = min(n, a + _SPILL_BUFFER)
                self.pending.append((store.ids[a:b], store.mask[a:b]))
                self.held += (b - a) * 5
                self._maybe_spill(force=True)
        self._maybe_spill()

    def _maybe_spill(self, force: bool = False) -> None:
        """Write the pending tokens out once past the budget (then whenever a buffer is full)."""
        limit = self.spill_bytes if self.files is None else _SPILL_BUFFER
        if force or self.held > limit:
            self._write()

    def _write(self) -> None:
        if self.files is None:
            self.files = (tempfile.TemporaryFile(), tempfile.TemporaryFile())  # unlinked at once
        for ids, mask in self.pending:
            self.files[0].write(memoryview(np.ascontiguousarray(ids, dtype=np.int32)))
            self.files[1].write(memoryview(np.ascontiguousarray(mask, dtype=np.uint8)))
            self.written += len(ids)
        self.pending.clear()
        self.held = 0

    def finish(self) -> TokenStore:
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if self.files is None:
            parts = self.pending
            ids = np.concatenate([i for i, _ in parts]) if parts else np.zeros(0, np.int32)
            mask = np.concatenate([m for _, m in parts]) if parts else np.zeros(0, np.uint8)
            return TokenStore(ids=ids, mask=mask, offsets=offsets, where=self.where)
        self._write()
        arrays = []
        for f, dtype in zip(self.files, (np.int32, np.uint8), strict=True):
            f.flush()
            arrays.append(FileArray(os.dup(f.fileno()), np.dtype(dtype), self.written))
            f.close()
        return TokenStore(ids=arrays[0], mask=arrays[1], offsets=offsets, where=self.where)


def concat_stores(stores: Sequence[TokenStore]) -> TokenStore:
    """One store holding the examples of `stores`, in order (file-backed past `SPILL_BYTES`)."""
    builder = StoreBuilder()
    for store in stores:
        builder.add(store)
    return builder.finish()


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
    max_examples: int | None = None,
) -> TokenStore:
    """Examples of `records`, in order; `report` accumulates (call again for more records).

    `seen_ids` (id -> first location) carries duplicate-id detection across calls.
    `max_examples` stops at that many examples (`data.train_size`: a row the template splits into
    several examples can otherwise pass it).
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

    def encode_pending() -> list[tuple[str, list[dict[str, Any]], tuple[list[int], list[int], list[int]]]]:
        try:
            encoded = template.encode_batch([m for _, m in pending], train)
            return [(w, m, e) for (w, m), e in zip(pending, encoded, strict=True)]
        except RowError:  # a row the template refuses (e.g. reasoning for llama3): find it, skip it
            out = []
            for where, messages in pending:
                try:
                    out.append((where, messages, template.encode_batch([messages], train)[0]))
                except RowError as e:
                    report.skip(where, e.reason, e.detail)
            return out

    def flush() -> None:
        for where, messages, (ids, mask, ends) in encode_pending():
            if max_examples is not None and len(lengths) >= max_examples:
                break
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
            for m, cat in zip(messages, assistant_categories(messages), strict=True):
                if cat is not None and not m.get("_context"):  # counted in the example that trains it
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
        try:
            # One example per render context: the conversation itself unless the template is not
            # append-only for it (hf, e.g. Qwen3's thinking), see ChatTemplate.contexts.
            pieces = template.contexts(messages, train)
        except RowError as e:
            report.skip(where, e.reason, e.detail)
            continue
        pending.extend((where, piece) for piece in pieces)
        if len(pending) >= _ENCODE_CHUNK:
            flush()
    if pending:
        flush()

    report.examples += len(lengths)
    report.lengths = np.concatenate([report.lengths, np.asarray(lengths, dtype=np.int64)])
    return TokenStore.from_parts(ids_parts, mask_parts, lengths, where_kept)
