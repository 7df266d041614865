"""What happened to every record: parsed, skipped (why and where), truncated, packed."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

MAX_KEPT_LOCATIONS = 10_000  # counts stay exact beyond this; only the location list is capped


@dataclasses.dataclass
class DataReport:
    split: str = "train"
    process_index: int = 0
    process_count: int = 1
    sources: str = ""
    records_total: int = 0  # all records in the inputs (before the split / selection)
    records_in_shard: int = 0  # records read (every process reads the same, see pipeline.py)
    parsed: int = 0  # rows that passed validation
    skipped: Counter = dataclasses.field(default_factory=Counter)  # reason -> count
    skipped_at: list[tuple[str, str, str]] = dataclasses.field(
        default_factory=list
    )  # (where, reason, detail)
    duplicate_ids: int = 0  # valid rows whose id an earlier row already had (kept, reported)
    duplicate_ids_at: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (where, id)
    selection: str = ""  # data.train_size: how the examples were chosen
    general: DataReport | None = None  # the mixed-in general chat data (data.general_*)
    preference: Any = None  # data.preference.PairReport: pair counts (a preference objective, `data stats`)
    trailing_user_turns_trimmed: int = 0
    refinement_turns_removed: int = 0  # drop_refinement_data: erroneous turns + their feedback
    truncated: int = 0
    examples: int = 0
    pair_units: int = 0  # preference pairs in the rows (chosen + rejected share a row)
    tokens: int = 0  # every row token: examples' and pairs'
    loss_tokens: int = 0
    turns: Counter = dataclasses.field(default_factory=Counter)  # category -> assistant turns kept
    trained_turns: Counter = dataclasses.field(default_factory=Counter)  # category -> turns with loss
    lengths: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    max_length: int = 0
    packed: bool = True
    rows: int = 0  # packed (or padded) rows this process holds
    rows_per_epoch: int = 0  # rows this process emits per epoch (steps_per_epoch * local batch)
    steps_per_epoch: int = 0
    last_batch: str = "drop"

    def skip(self, where: str, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_at) < MAX_KEPT_LOCATIONS:
            self.skipped_at.append((where, reason, detail))

    def duplicate(self, where: str, rid: str) -> None:
        self.duplicate_ids += 1
        if len(self.duplicate_ids_at) < MAX_KEPT_LOCATIONS:
            self.duplicate_ids_at.append((where, rid))

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    @property
    def packing_efficiency(self) -> float:
        """Fraction of row slots holding real tokens (1.0 = no padding)."""
        tokens = self.tokens + (self.general.tokens if self.general else 0)  # rows hold both
        return tokens / (self.rows * self.max_length) if self.rows and self.max_length else 0.0

    @property
    def padded_efficiency(self) -> float:
        """Same fraction if every example (and every preference pair) were padded to max_length
        on its own row."""
        tokens = self.tokens + (self.general.tokens if self.general and self.rows else 0)
        examples = self.examples + self.pair_units
        examples += self.general.examples if self.general and self.rows else 0
        return tokens / (examples * self.max_length) if examples and self.max_length else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("lengths", "general", "preference")
        }
        d["preference"] = self.preference.to_dict() if self.preference is not None else None
        d["general"] = self.general.to_dict() if self.general is not None else None
        d["skipped"] = dict(self.skipped)
        d["turns"] = dict(self.turns)
        d["trained_turns"] = dict(self.trained_turns)
        d["skipped_total"] = self.skipped_total
        d["packing_efficiency"] = self.packing_efficiency
        d["padded_efficiency"] = self.padded_efficiency
        d["length_percentiles"] = self.length_percentiles()
        return d

    def length_percentiles(self) -> dict[str, int]:
        if not len(self.lengths):
            return {}
        qs = (0, 50, 90, 99, 100)
        return {
            f"p{q}": int(v)
            for q, v in zip(qs, np.percentile(self.lengths, qs, method="nearest"), strict=True)
        }

    def summary(self, max_locations: int = 5) -> str:
        who = f" (process {self.process_index}/{self.process_count})" if self.process_count > 1 else ""
        lines = [f"data[{self.split}]{who}: {self.sources}"]
        lines.append(
            f"  records: {self.records_in_shard} read of {self.records_total}, {self.parsed} valid, "
            f"{self.skipped_total} skipped"
        )
        for reason, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            at = [w for w, r, _ in self.skipped_at if r == reason][:max_locations]
            first = next((d for _, r, d in self.skipped_at if r == reason), "")
            lines.append(f"    - {reason}: {n} (e.g. {', '.join(at)}{'...' if n > len(at) else ''}) {first}")
        if self.duplicate_ids:
            shown = ", ".join(f"{rid!r} at {w}" for w, rid in self.duplicate_ids_at[:max_locations])
            more = "..." if self.duplicate_ids > max_locations else ""
            lines.append(f"  duplicate ids (rows kept): {self.duplicate_ids} (e.g. {shown}{more})")
        if self.selection:
            lines.append(f"  {self.selection}")
        if self.truncated:
            lines.append(f"  truncated at a turn boundary to {self.max_length} tokens: {self.truncated}")
        if self.trailing_user_turns_trimmed:
            lines.append(f"  trailing user turns trimmed (no loss): {self.trailing_user_turns_trimmed}")
        if self.refinement_turns_removed:
            lines.append(f"  drop_refinement_data removed {self.refinement_turns_removed} turns")
        frac = self.loss_tokens / self.tokens if self.tokens else 0.0
        lines.append(
            f"  examples: {self.examples}, tokens: {self.tokens}, "
            f"loss tokens: {self.loss_tokens} ({frac:.1%})"
        )
        if len(self.lengths):
            lines.append("  length " + " ".join(f"{k}={v}" for k, v in self.length_percentiles().items()))
        if self.turns:
            turns = ", ".join(
                f"{c}={self.turns[c]} (trained {self.trained_turns[c]})" for c in sorted(self.turns)
            )
            lines.append(f"  assistant turns: {turns}")
        if self.preference is not None:
            lines.append(self.preference.summary())
        mode = "packed" if self.packed else "padded"
        if self.rows:  # a mixed-in source's own report has no rows: they are packed with the main data
            lines.append(
                f"  {mode} rows: {self.rows} x {self.max_length}, fill {self.packing_efficiency:.1%} "
                f"(one example per row: {self.padded_efficiency:.1%})"
            )
        unused = self.rows - self.rows_per_epoch
        tail = (
            f"; {unused} rows/epoch not used (final partial batch dropped, reshuffled each epoch)"
            if unused > 0
            else ""
        )
        if unused < 0:
            tail = f"; {-unused} empty padding rows/epoch (final partial batch padded)"
        if self.steps_per_epoch:  # only once a pipeline has fixed the batch layout
            lines.append(f"  steps/epoch: {self.steps_per_epoch}{tail}")
        if self.general is not None:
            lines.append("  mixed in (general chat):")
            lines.extend("  " + line for line in self.general.summary(max_locations).splitlines())
        return "\n".join(lines)

    def one_line(self) -> str:
        """The skip counts on one line, for errors (the full summary is for logs)."""
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
        first = f"; first at {self.skipped_at[0][0]}: {self.skipped_at[0][2]}" if self.skipped_at else ""
        return f"{self.skipped_total} of {self.records_in_shard} records skipped ({reasons or 'none'}){first}"
