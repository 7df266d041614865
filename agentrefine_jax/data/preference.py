"""Preference pairs: from refinement trajectories, or from plain preference files.

A pair is (prompt, chosen, rejected): the conversation before an assistant reply and two
replies to it. From a trajectory: one pair per erroneous assistant turn that a refinement
follows — prompt = the messages before the erroneous turn, rejected = the erroneous turn's
content, chosen = the refinement's content. A run of consecutive errors ends in one
refinement: each error of the run is paired with it (every error left the state unchanged, so
the refinement answers the same state each time).

Only state-preserving errors make pairs: the refinement is a good reply to the prompt before
the error only if the error changed nothing. In the AgentRefine layouts (canonical, sharegpt,
agentflan; `loss: false` / `error: true`) an erroneous turn is by definition one the
environment answered with error feedback (Algorithm 1: the DM rejects the action, the state
does not change), so the flag decides it; the erroneous turn must be followed by a user turn
(that feedback) and, after it, by the refinement. AgentInstruct / AgentTraj-L rows have no
erroneous turns (their flag means "not trained"): they yield no pairs.

Plain preference rows (TRL, LLaMA-Factory) hold the pair themselves (`is_preference_row`).

Each reply is rendered with the SFT template as prompt + reply, every earlier assistant turn
untrained: the mask covers exactly the reply's tokens and its end token (what rendering the
prompt with its generation header leaves out). A pair is stored as two consecutive examples
of a TokenStore, chosen then rejected, their mask bits CHOSEN / REJECTED, so packing can keep
both in one row (pipeline.py) and the loss can find them (train/objectives.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from agentrefine_jax.data.examples import TokenStore
from agentrefine_jax.data.schema import (
    FieldMap,
    RowError,
    assistant_categories,
    normalize_row,
    trim_trailing_users,
    validate_messages,
)
from agentrefine_jax.data.templates import ChatTemplate

CHOSEN, REJECTED = 2, 3  # loss_mask values of a pair's reply tokens (1 = an SFT loss token)
# Why an erroneous turn gave no pair (counted per turn).
NO_REFINEMENT = "no refinement after the error"
NO_FEEDBACK = "no error feedback after the erroneous turn"
OVERLENGTH = "overlength"
SAME_REPLY = "chosen equals rejected"

Message = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: list[Message]
    chosen: str  # the reply's content
    rejected: str
    where: str
    # The reply's other parts (tool_calls, reasoning_content) where it has them: a tool-call
    # row's pair is the erroneous call against the refined one.
    chosen_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rejected_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    row: bool = False  # the whole record (a plain preference row), not one turn of a trajectory


_REPLY_KEYS = ("tool_calls", "reasoning_content")


def _extra(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: m[k] for k in _REPLY_KEYS if k in m}


def _same_reply(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal content, thinking and calls (call ids aside: they only number the calls)."""

    def calls(m: Mapping[str, Any]) -> list[Any]:
        return [c["function"] for c in m.get("tool_calls", [])]

    return (a["content"], a.get("reasoning_content"), calls(a)) == (
        b["content"],
        b.get("reasoning_content"),
        calls(b),
    )


@dataclasses.dataclass
class PairReport:
    """How many pairs, and why the others are not."""

    rows: int = 0  # records read
    preference_rows: int = 0  # plain preference rows among them
    erroneous_turns: int = 0
    pairs: int = 0  # pairs kept (rendered, fitting max_length)
    prompts_shortened: int = 0  # pairs whose oldest turns were dropped to fit max_length
    skipped: Counter = dataclasses.field(default_factory=Counter)
    skipped_at: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # Whole records that gave nothing (a refused preference row, a record that is no trajectory):
    # reason -> count, and (where, reason, detail) of the first ones. A pairs-only objective counts
    # them against data.max_skip_fraction, as the SFT path counts its skipped rows.
    rows_skipped: Counter = dataclasses.field(default_factory=Counter)
    rows_skipped_at: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def skip(self, where: str, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_at) < 1000:
            self.skipped_at.append((where, reason))

    def skip_row(self, where: str, reason: str, detail: str = "", *, unreadable: bool = False) -> None:
        if not unreadable:  # a record that is not even a row (bad JSON): the SFT report's line says so
            self.skip(where, reason)
        self.rows_skipped[reason] += 1
        if len(self.rows_skipped_at) < 1000:
            self.rows_skipped_at.append((where, reason, detail))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skipped"] = dict(self.skipped)
        d["rows_skipped"] = dict(self.rows_skipped)
        d.pop("skipped_at")
        d.pop("rows_skipped_at")
        return d

    def summary(self) -> str:
        why = ", ".join(f"{r} {n}" for r, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
        return (
            f"  preference pairs: {self.pairs} (from {self.erroneous_turns} erroneous turns and "
            f"{self.preference_rows} preference rows; skipped {sum(self.skipped.values())}"
            + (f": {why}" if why else "")
            + (f"; {self.prompts_shortened} prompts shortened to fit" if self.prompts_shortened else "")
            + ")"
        )


def trajectory_pairs(messages: Sequence[Message], where: str, report: PairReport) -> list[Pair]:
    """The pairs of one validated trajectory (see the module docstring)."""
    cats = assistant_categories(messages)
    pairs = []
    for i, cat in enumerate(cats):
        if cat != "erroneous":
            continue
        report.erroneous_turns += 1
        at = f"{where}#turn{i}"
        if i + 1 >= len(messages) or messages[i + 1]["role"] not in ("user", "tool"):
            report.skip(at, NO_FEEDBACK)
            continue
        # The refinement: the first trained turn after the run of errors (untrained turns between
        # would be context the prompt lacks: no pair then).
        j = i + 1
        while j < len(messages) and cats[j] in (None, "erroneous"):
            j += 1
        if j >= len(messages) or cats[j] != "refinement":
            report.skip(at, NO_REFINEMENT)
            continue
        if _same_reply(messages[j], messages[i]):
            report.skip(at, SAME_REPLY)
            continue
        pairs.append(
            Pair(
                list(messages[:i]),
                messages[j]["content"],
                messages[i]["content"],
                at,
                _extra(messages[j]),
                _extra(messages[i]),
            )
        )
    return pairs


def is_preference_row(row: Any) -> bool:
    return isinstance(row, Mapping) and "chosen" in row and "rejected" in row


def _reply(value: Any, what: str) -> str:
    """A reply as text: a string, one message, or a message list ending with the assistant's."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, Sequence) and value and isinstance(value[-1], Mapping):
        text = value[-1].get("content", value[-1].get("value"))
        if isinstance(text, str):
            return text
    raise RowError("bad preference row", f"{what!r} must be a string or assistant message(s)")


_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _messages(turns: Any) -> list[Message]:
    """Prompt turns (text, or {role, content} / ShareGPT {from, value} messages) as messages;
    checked with the reply appended by the caller."""
    if isinstance(turns, str):
        return [{"role": "user", "content": turns}]
    if not isinstance(turns, Sequence) or not turns or not all(isinstance(t, Mapping) for t in turns):
        raise RowError("bad preference row", "the prompt must be a string or a non-empty message list")
    out = []
    for t in turns:
        role = _ROLES.get(t.get("role", t.get("from")))
        content = t.get("content", t.get("value"))
        if role is None or not isinstance(content, str):
            raise RowError("bad preference row", f"prompt turn {dict(t)!r:.80} has no known role / text")
        out.append({"role": role, "content": content})
    return out


def plain_pair(row: Mapping[str, Any], where: str) -> Pair:
    """One pair from a TRL / LLaMA-Factory preference row (raises RowError).

    Layouts: {"prompt": str | messages, "chosen", "rejected"} (TRL standard / conversational),
    {"chosen": messages, "rejected": messages} (TRL implicit prompt: the common prefix),
    {"messages" | "conversations" | "conversation": prompt turns, "chosen", "rejected"}
    (LLaMA-Factory's sharegpt preference layout), {"instruction", "input"?, "chosen", "rejected"}
    (LLaMA-Factory alpaca).
    """
    chosen_raw, rejected_raw = row["chosen"], row["rejected"]
    if "prompt" in row:
        prompt_turns: Any = row["prompt"]
    elif "instruction" in row:
        prompt_turns = "\n".join(s for s in (row["instruction"], row.get("input") or "") if s)
    else:
        key = next((k for k in ("messages", "conversations", "conversation") if k in row), None)
        if key is not None:
            prompt_turns = row[key]
        elif isinstance(chosen_raw, list) and isinstance(rejected_raw, list):  # implicit prompt
            n = 0
            while n < min(len(chosen_raw), len(rejected_raw)) - 1 and chosen_raw[n] == rejected_raw[n]:
                n += 1
            prompt_turns, chosen_raw, rejected_raw = chosen_raw[:n], chosen_raw[n:], rejected_raw[n:]
        else:
            raise RowError("bad preference row", "no prompt: expected 'prompt', 'messages' or 'instruction'")
    prompt = _messages(prompt_turns)
    chosen, rejected = _reply(chosen_raw, "chosen"), _reply(rejected_raw, "rejected")
    if prompt[-1]["role"] != "user":
        raise RowError("bad preference row", "the prompt must end with a user turn")
    validate_messages([*prompt, {"role": "assistant", "content": chosen}])
    validate_messages([*prompt, {"role": "assistant", "content": rejected}])
    return Pair(prompt, chosen, rejected, where, row=True)


def render_reply(
    template: ChatTemplate, prompt: Sequence[Message], reply: str | Mapping[str, Any]
) -> tuple[list[int], list[int]]:
    """(ids, mask) of prompt + reply (its content, or the assistant message): mask 1 on the
    reply's tokens and end token only."""
    return _render(template, [(prompt, reply)])[0]


def _reply_message(reply: str | Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> Message:
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply, **(extra or {})}
    return {"role": "assistant", "content": reply["content"], **_extra(reply)}


def _render(
    template: ChatTemplate, items: Sequence[tuple[Sequence[Message], str | Mapping[str, Any]]]
) -> list[tuple[list[int], list[int]]]:
    convs = [[*(_untrained(m) for m in prompt), _reply_message(reply)] for prompt, reply in items]
    return [(ids, mask) for ids, mask, _ in template.encode_batch(convs, ("correct",))]


def _untrained(m: Mapping[str, Any]) -> Message:
    """A prompt turn as context: its tool calls, results and tools stay; its flags go."""
    out = {k: v for k, v in m.items() if k not in ("loss", "train", "_context")}
    if m["role"] == "assistant":
        out["train"] = False
    return out


def _exchange_starts(prompt: list[Message]) -> list[int]:
    """Index of each assistant turn after the first user turn (which holds the task): an exchange
    is that turn with the user / tool turns that answer it."""
    head = 2 if prompt[0]["role"] == "system" else 1
    return [k for k in range(head, len(prompt)) if prompt[k]["role"] == "assistant"]


def _shorten(prompt: list[Message], drop: int) -> list[Message]:
    """The prompt without its `drop` oldest exchanges after the first user turn (which holds the
    task, and the row's tools): roles still alternate, every call keeps its answer."""
    starts = _exchange_starts(prompt)
    head = 2 if prompt[0]["role"] == "system" else 1
    cut = starts[drop] if drop < len(starts) else len(prompt)
    return prompt[:head] + prompt[cut:]


def pairs_of_rows(
    records: Iterable[tuple[str, Any]], field_map: FieldMap | None, report: PairReport
) -> Iterable[Pair]:
    """Pairs of raw records, in order; every record that gives nothing is counted (`skip_row`)."""
    for where, row in records:
        report.rows += 1
        if isinstance(row, RowError):
            report.skip_row(where, row.reason, row.detail, unreadable=True)
            continue
        try:
            if is_preference_row(row):
                report.preference_rows += 1
                pair = plain_pair(row, where)
                if pair.chosen == pair.rejected:  # no preference: its DPO loss is a constant log 2
                    report.skip_row(where, SAME_REPLY, "the chosen and rejected replies are identical")
                else:
                    yield pair
                continue
            messages, _ = trim_trailing_users(normalize_row(row, field_map, where)["messages"])
        except RowError as e:
            report.skip_row(where, e.reason, e.detail)
            continue
        yield from trajectory_pairs(messages, where, report)


def build_pairs(
    pairs: Iterable[Pair], template: ChatTemplate, max_length: int, report: PairReport
) -> TokenStore:
    """A store holding each pair as two consecutive examples, chosen (mask CHOSEN) then
    rejected (mask REJECTED). A pair longer than `max_length` (both renders together) loses its
    prompt's oldest exchanges until it fits; one that never fits is skipped."""
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    lengths: list[int] = []
    where: list[str] = []
    for pair in pairs:
        prompt = pair.prompt
        n_exchanges = len(_exchange_starts(prompt))
        chosen = _reply_message(pair.chosen, pair.chosen_extra)
        rejected = _reply_message(pair.rejected, pair.rejected_extra)
        fitted = None
        for drop in range(n_exchanges + 1):
            p = _shorten(prompt, drop) if drop else prompt
            (c_ids, c_mask), (r_ids, r_mask) = _render(template, [(p, chosen), (p, rejected)])
            if len(c_ids) + len(r_ids) <= max_length:
                fitted = (c_ids, c_mask, r_ids, r_mask)
                report.prompts_shortened += int(drop > 0)
                break
        if fitted is None:
            if pair.row:
                report.skip_row(pair.where, OVERLENGTH, f"the pair never fits max_length={max_length}")
            else:
                report.skip(pair.where, OVERLENGTH)
            continue
        c_ids, c_mask, r_ids, r_mask = fitted
        for ids, mask, bit in ((c_ids, c_mask, CHOSEN), (r_ids, r_mask, REJECTED)):
            ids_parts.append(np.asarray(ids, np.int32))
            mask_parts.append(np.asarray(mask, np.uint8) * bit)
            lengths.append(len(ids))
            where.append(pair.where)
        report.pairs += 1
    return TokenStore.from_parts(ids_parts, mask_parts, lengths, where)
