"""Bin packing of examples into fixed-length rows, and row materialisation.

The packing plan is computed once (best-fit decreasing) from the example lengths, so the
number of rows - and therefore `steps_per_epoch` - is known before the first batch and is
the same in every epoch; epochs reshuffle the rows. A row holds whole examples only (no
example is split across rows), each with its own segment id (1..k) and positions restarting
at 0; padding has segment 0, mask 0. Each segment starts with BOS (mask 0), so the
prediction that would cross a segment boundary is never trained.
"""

from __future__ import annotations

import numpy as np

from agentrefine_jax.data.examples import TokenStore

# The arrays of every batch row, as the train step receives them (all int32, [rows, seq]).
BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")


class _FirstAtLeast:
    """Multiset of bin capacities 0..size with O(log size) "smallest capacity >= x" queries."""

    def __init__(self, size: int):
        self.n = 1
        while self.n < size + 1:
            self.n *= 2
        self.count = np.zeros(2 * self.n, dtype=np.int64)

    def add(self, cap: int, delta: int) -> None:
        i = cap + self.n
        while i:
            self.count[i] += delta
            i //= 2

    def first_at_least(self, x: int) -> int:
        """Smallest present value >= x, or -1."""
        if x >= self.n:
            return -1
        # Walk up from leaf x collecting right siblings, then descend into the first non-empty one.
        i = x + self.n
        if self.count[i]:
            return x
        while i > 1:
            if i % 2 == 0 and self.count[i + 1]:
                i += 1
                while i < self.n:
                    i = 2 * i if self.count[2 * i] else 2 * i + 1
                return i - self.n
            i //= 2
        return -1


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: each example (longest first) goes into the fullest bin it fits.

    Deterministic (ties broken by example index). Returns example indices per row, in the
    order they are laid out in the row.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        raise ValueError(f"example of length {lengths.max()} exceeds row capacity {capacity}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))
    tree = _FirstAtLeast(capacity)
    bins_with_cap: dict[int, list[int]] = {}  # remaining capacity -> bin ids (LIFO)
    rows: list[list[int]] = []
    remaining: list[int] = []
    for ex in order.tolist():
        n = int(lengths[ex])
        cap = tree.first_at_least(n)
        if cap < 0:
            b = len(rows)
            rows.append([])
            remaining.append(capacity)
        else:
            b = bins_with_cap[cap].pop()
            tree.add(cap, -1)
        rows[b].append(ex)
        remaining[b] -= n
        left = remaining[b]
        bins_with_cap.setdefault(left, []).append(b)
        tree.add(left, 1)
    return rows


def materialize(
    store: TokenStore, example_ids: list[int] | tuple[int, ...], max_length: int, pad_id: int
) -> dict[str, np.ndarray]:
    """One row: input_ids / loss_mask / segment_ids / positions, int32 [max_length]."""
    input_ids = np.full(max_length, pad_id, dtype=np.int32)
    loss_mask = np.zeros(max_length, dtype=np.int32)
    segment_ids = np.zeros(max_length, dtype=np.int32)
    positions = np.zeros(max_length, dtype=np.int32)
    pos = 0
    for seg, ex in enumerate(example_ids, start=1):
        ids, mask = store.example(ex)
        n = len(ids)
        if pos + n > max_length:
            raise ValueError(f"row overflows: {pos + n} > {max_length}")
        input_ids[pos : pos + n] = ids
        loss_mask[pos : pos + n] = mask
        segment_ids[pos : pos + n] = seg
        positions[pos : pos + n] = np.arange(n, dtype=np.int32)
        pos += n
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "segment_ids": segment_ids,
        "positions": positions,
    }


def padding_efficiency(lengths: np.ndarray, batch_size: int, seed: int = 0) -> float:
    """Token fraction if random batches were padded to their own longest example (no packing)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        return 0.0
    perm = np.random.default_rng(seed).permutation(len(lengths))
    slots = 0
    for i in range(0, len(perm), batch_size):
        chunk = lengths[perm[i : i + batch_size]]
        slots += int(chunk.max()) * batch_size
    return float(lengths.sum()) / slots
