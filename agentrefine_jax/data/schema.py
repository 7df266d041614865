"""Trajectory schema: canonical rows, other layouts mapped onto it, validation, turn categories.

Canonical row::

    {"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str, "loss": bool}]}

`loss` matters only on assistant messages (default true); `loss: false` marks an *erroneous*
turn. An assistant message may instead carry `"train": false`: a turn that is context only
(AgentInstruct's "Ok." acknowledgement, in-context demonstrations) - never trained, and not a
mistake. Every assistant turn falls in exactly one category:

* ``untrained``  - ``train: false`` (no loss whatever `loss_on` says; transparent for the rules below);
* ``erroneous``  - ``loss: false``;
* ``refinement`` - the next assistant turn after an erroneous one, itself not erroneous;
* ``correct``    - every other assistant turn.

`loss_on` (a subset of correct/refinement/erroneous) says which categories carry loss. The
default ``correct,refinement`` is the paper's Equation 1.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from agentrefine_jax.config_checks import CATEGORIES  # what `loss_on` may name (re-exported)
from agentrefine_jax.unicode_text import lone_surrogate

ROLES = ("system", "user", "assistant")
UNTRAINED = "untrained"  # category of `train: false` turns; never in loss_on
FLAG_MEANINGS = ("loss", "error", "train")
DEFAULT_LOSS_ON: tuple[str, ...] = ("correct", "refinement")

Message = dict[str, Any]


TOO_DEEP = "nested too deeply"  # skip reason: JSON deeper than Python's parser recursion limit
INVALID_UNICODE = "invalid unicode"  # skip reason: a lone surrogate no tokenizer or writer accepts


class RowError(ValueError):
    """A row that cannot be trained on. `reason` is a short stable key used for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class FieldMap:
    """Where a row keeps its turns, and how to read each turn.

    `flag` names the per-turn boolean; `flag_means` gives its polarity: "loss" (true = train
    on this turn, false = erroneous), "error" (true = erroneous turn), or "train" (true =
    train on it, false = context only: not trained and NOT erroneous - AgentInstruct /
    AgentTraj-L). A missing flag means "trained, not erroneous". `roles` maps the file's role
    values onto system/user/assistant.
    """

    turns: str
    role: str
    content: str
    flag: str | None = "loss"
    flag_means: str = "loss"
    roles: Mapping[str, str] = dataclasses.field(default_factory=lambda: {r: r for r in ROLES})
    id: str | None = "id"

    def __post_init__(self) -> None:
        if self.flag_means not in FLAG_MEANINGS:
            raise ValueError(f"field_map.flag_means must be one of {FLAG_MEANINGS}, got {self.flag_means!r}")
        bad = {k: v for k, v in self.roles.items() if v not in ROLES}
        if bad:
            raise ValueError(f"field_map.roles must map onto {ROLES}; bad entries: {bad}")


_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
PRESETS: dict[str, FieldMap] = {
    "canonical": FieldMap(turns="messages", role="role", content="content"),
    # ShareGPT, as in fudayuan/AgentRefine-* (columns id, conversations[{from, value, loss}]).
    "sharegpt": FieldMap(turns="conversations", role="from", content="value", roles=_SHAREGPT_ROLES),
    # Agent-FLAN's layout: conversation[{role, content, loss}].
    "agentflan": FieldMap(turns="conversation", role="role", content="content"),
    # THUDM/AgentInstruct and AgentGym/AgentTraj-L: ShareGPT columns, but `loss: false` marks
    # turns that are simply not trained (the "Ok." ack, in-context demo turns), not mistakes.
    "agentinstruct": FieldMap(
        turns="conversations", role="from", content="value", flag_means="train", roles=_SHAREGPT_ROLES
    ),
    "agenttraj": FieldMap(
        turns="conversations",
        role="from",
        content="value",
        flag_means="train",
        roles=_SHAREGPT_ROLES,
        id="item_id",
    ),
}
FORMATS = ("auto", "custom", *PRESETS)
_FIELD_MAP_KEYS = {f.name for f in dataclasses.fields(FieldMap)} | {"loss"}


def resolve_field_map(fmt: str, overrides: Mapping[str, Any] | None = None) -> FieldMap | None:
    """The FieldMap for `fmt` with `overrides` applied; None means "auto-detect per row".

    `custom` starts from the canonical keys, so a custom map only names what differs.
    A `roles` override extends the preset's role map (a value may also remap a preset key).
    """
    overrides = dict(overrides or {})
    unknown = set(overrides) - _FIELD_MAP_KEYS
    if unknown:
        raise ValueError(f"unknown field_map keys {sorted(unknown)}; allowed: {sorted(_FIELD_MAP_KEYS)}")
    if "loss" in overrides:  # friendlier alias for the flag column
        overrides.setdefault("flag", overrides.pop("loss"))
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; choose from {FORMATS}")
    if fmt == "auto":
        if overrides:
            raise ValueError("field_map overrides need an explicit format (e.g. format=custom)")
        return None
    base = PRESETS["canonical" if fmt == "custom" else fmt]
    if "roles" in overrides and not isinstance(overrides["roles"], Mapping):
        raise ValueError("field_map.roles must be an object mapping file values to system/user/assistant")
    if "roles" in overrides:
        overrides["roles"] = {**base.roles, **overrides["roles"]}
    return dataclasses.replace(base, **overrides)


def detect_field_map(row: Mapping[str, Any]) -> FieldMap:
    for name in ("canonical", "sharegpt", "agentflan"):
        if PRESETS[name].turns in row:
            return PRESETS[name]
    raise RowError(
        "unknown layout",
        f"no 'messages', 'conversations' or 'conversation' field (keys: {sorted(row)[:10]}); "
        "set data.format / data.field_map",
    )


def _read_flag(value: Any, where: int) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_ from parquet/pandas
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    raise RowError("bad loss flag", f"turn {where}: flag must be a boolean (or 0/1), got {value!r}")


def normalize_row(row: Any, field_map: FieldMap | None, fallback_id: str) -> dict[str, Any]:
    """Map one raw row onto the canonical schema and validate it (raises RowError)."""
    if not isinstance(row, Mapping):
        raise RowError("not an object", f"row is {type(row).__name__}, expected a JSON object")
    bad_text = lone_surrogate(row)
    if bad_text:
        raise RowError(INVALID_UNICODE, bad_text)
    fm = field_map or detect_field_map(row)
    if fm.turns not in row:
        raise RowError("missing turns field", f"no {fm.turns!r} field (keys: {sorted(row)[:10]})")
    turns = row[fm.turns]
    if isinstance(turns, str):  # some parquet exports store the turn list as a JSON string
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as e:
            raise RowError("bad turns field", f"{fm.turns!r} is a string but not JSON: {e}") from None
        except RecursionError:
            raise RowError(TOO_DEEP, f"{fm.turns!r} is a JSON string nested too deeply") from None
    if not isinstance(turns, Sequence) or isinstance(turns, (str, bytes)):
        raise RowError("bad turns field", f"{fm.turns!r} must be a list, got {type(turns).__name__}")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise RowError("bad turn", f"turn {i} is {type(turn).__name__}, expected an object")
        raw_role = turn.get(fm.role)
        if raw_role not in fm.roles:
            raise RowError("unknown role", f"turn {i}: role {raw_role!r} (known: {sorted(fm.roles)})")
        role = fm.roles[raw_role]
        content = turn.get(fm.content)
        if not isinstance(content, str):
            raise RowError("non-string content", f"turn {i} ({role}): content is {type(content).__name__}")
        msg: Message = {"role": role, "content": content}
        if role == "assistant":
            flag = _read_flag(turn.get(fm.flag), i) if fm.flag else None
            msg["loss"] = True
            if flag is not None:
                if fm.flag_means == "train":
                    msg["train"] = flag
                else:
                    msg["loss"] = flag if fm.flag_means == "loss" else not flag
        messages.append(msg)
    rid = row.get(fm.id) if fm.id else None
    return {"id": str(rid) if rid is not None else fallback_id, "messages": validate_messages(messages)}


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Check the structure every template relies on; return the messages in canonical form.

    Allowed: an optional system message first, then user / assistant strictly alternating,
    starting with user, with at least one assistant turn. Trailing user turns are legal here
    (an agent loop's final observation); the training path trims them (they carry no loss).
    """
    if not isinstance(messages, Sequence) or not messages:
        raise RowError("empty conversation", "no messages")
    out: list[Message] = []
    expected = "user"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RowError("bad turn", f"message {i} is {type(m).__name__}, expected an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowError("unknown role", f"message {i}: role {role!r} (expected one of {ROLES})")
        if not isinstance(content, str):
            raise RowError("non-string content", f"message {i} ({role}): content is {type(content).__name__}")
        if role == "system":
            if i != 0:
                raise RowError("role order", f"message {i}: a system message may only come first")
        elif role != expected:
            raise RowError(
                "role order", f"message {i}: got {role}, expected {expected} (roles must alternate)"
            )
        else:
            expected = "assistant" if role == "user" else "user"
        msg: Message = {"role": role, "content": content}
        if role == "assistant":
            loss = m.get("loss", True)
            if loss is None:
                loss = True
            if not isinstance(loss, bool):
                raise RowError("bad loss flag", f"message {i}: loss must be a boolean, got {loss!r}")
            if not content.strip():
                raise RowError("empty assistant turn", f"message {i}: assistant content is empty")
            msg["loss"] = loss
            trained = m.get("train", True)
            if not isinstance(trained, bool):
                raise RowError("bad loss flag", f"message {i}: train must be a boolean, got {trained!r}")
            if not trained:
                msg["train"] = False
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise RowError("no assistant turn", "a trajectory needs at least one assistant turn")
    return out


def trim_trailing_users(messages: list[Message]) -> tuple[list[Message], int]:
    """Drop user turns after the last assistant turn (no loss, nothing to learn)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[: last + 1], len(messages) - last - 1


def assistant_categories(messages: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """Category per message (None for system/user).

    An untrained turn neither is a mistake nor ends one: an error, then an untrained turn,
    then a trained turn makes that trained turn the refinement.
    """
    cats: list[str | None] = []
    after_error = False
    for m in messages:
        if m["role"] != "assistant":
            cats.append(None)
        elif m.get("train", True) is False:
            cats.append(UNTRAINED)
        elif not m.get("loss", True):
            cats.append("erroneous")
            after_error = True
        else:
            cats.append("refinement" if after_error else "correct")
            after_error = False
    return cats


def check_loss_on(loss_on: Collection[str]) -> frozenset[str]:
    if isinstance(loss_on, str):
        loss_on = [s.strip() for s in loss_on.split(",") if s.strip()]
    chosen = frozenset(loss_on)
    bad = chosen - set(CATEGORIES)
    if bad or not chosen:
        raise ValueError(f"loss_on must be a non-empty subset of {CATEGORIES}, got {sorted(loss_on)}")
    return chosen


def drop_refinement_data(messages: list[Message]) -> tuple[list[Message], int]:
    """Table 2's "w/o refinement data": remove every erroneous assistant turn together with the
    user turn right after it (the environment's error feedback).

    The refinement turn then directly follows the observation the mistake was made on, i.e.
    the trajectory reads as if the agent had acted correctly first time; it is then an
    ordinary `correct` turn. Returns the new messages and the number of turns removed.
    """
    out: list[Message] = []
    removed = 0
    skip_next_user = False
    for m in messages:
        if m["role"] == "assistant" and not m.get("loss", True) and m.get("train", True) is not False:
            removed += 1
            skip_next_user = True
            continue
        if skip_next_user and m["role"] == "user":
            removed += 1
            skip_next_user = False
            continue
        skip_next_user = False
        out.append(m)
    return out, removed
