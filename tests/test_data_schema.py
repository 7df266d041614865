"""Schema mapping, validation, categories, ablation edits, bad-row reporting and input formats."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrefine_jax.config import DataConfig
from agentrefine_jax.data.pipeline import build_data
from agentrefine_jax.data.schema import (
    RowError,
    assistant_categories,
    drop_refinement_data,
    normalize_row,
    resolve_field_map,
)

SYS = {"role": "system", "content": "You act in a world."}


def _u(text):
    return {"role": "user", "content": text}


def _a(text, loss=True):
    return {"role": "assistant", "content": text, "loss": loss}


CONVO = [SYS, _u("o1"), _a("a1"), _u("o2"), _a("bad1", False), _u("err1"), _a("bad2", False), _u("err2")]
CONVO += [_a("fix"), _u("o3"), _a("a3"), _u("o4"), _a("bad3", False), _u("err3"), _a("fix2")]


def test_categories_by_hand():
    cats = [c for c in assistant_categories(CONVO) if c]
    assert cats == ["correct", "erroneous", "erroneous", "refinement", "correct", "erroneous", "refinement"]


def test_drop_refinement_data_removes_errors_and_their_feedback():
    out, removed = drop_refinement_data(CONVO)
    assert removed == 6
    assert [m["content"] for m in out] == [
        "You act in a world.",
        "o1",
        "a1",
        "o2",
        "fix",
        "o3",
        "a3",
        "o4",
        "fix2",
    ]
    assert all(c in (None, "correct") for c in assistant_categories(out))


def _write_jsonl(path, rows):
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)
    )
    return str(path)


def _cfg(files, **kw):
    base = dict(
        train_files=(files,) if isinstance(files, str) else tuple(files), max_length=256, template="mistral"
    )
    base.update(tokenizer=base["template"], **{k: v for k, v in kw.items()})
    base["tokenizer"] = base["template"]
    return DataConfig(**base)


GOOD = {"id": "ok", "messages": [_u("hello"), _a("Thought: hi\nAction: look")]}


def test_bad_rows_are_counted_with_line_numbers(tmp_path):
    rows = [
        GOOD,
        "{not json",
        "",  # blank line: not a row
        {"id": "r4", "messages": [_u("x"), {"role": "assistant", "content": 5}]},
        {"id": "r5", "messages": [_a("first"), _u("x")]},
        {"id": "r6", "messages": [_u("only a question")]},
        {"id": "r7", "turns": []},
        {"id": "r8", "messages": [_u("x"), {"role": "assistant", "content": "y", "loss": "no"}]},
        {"id": "r9", "messages": [_u("x"), {"role": "robot", "content": "y"}]},
        GOOD,
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    local = build_data(_cfg(path, max_skip_fraction=0.9), "train")
    rep = local.report
    assert rep.records_in_shard == 9 and rep.parsed == 2 and rep.examples == 2
    assert dict(rep.skipped) == {
        "invalid json": 1,
        "non-string content": 1,
        "role order": 1,
        "no assistant turn": 1,
        "unknown layout": 1,
        "bad loss flag": 1,
        "unknown role": 1,
    }
    where = {reason: w for w, reason, _ in rep.skipped_at}
    assert where["invalid json"].endswith("mixed.jsonl:2")
    assert where["non-string content"].endswith("mixed.jsonl:4")  # line 3 was blank
    assert where["unknown role"].endswith("mixed.jsonl:9")
    summary = rep.summary()
    assert "7 skipped" in summary and "mixed.jsonl:2" in summary


def test_too_many_skips_fail_loudly(tmp_path):
    path = _write_jsonl(
        tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "x"}]}] * 3 + [GOOD]
    )
    with pytest.raises(ValueError, match="max_skip_fraction"):
        build_data(_cfg(path), "train")


def test_no_loss_tokens_and_overlength_are_counted(tmp_path):
    only_errors = {"messages": [_u("x"), _a("wrong", False)]}
    long = {"messages": [_u("word " * 400), _a("late answer")]}
    two_turns = {"messages": [_u("q"), _a("short answer"), _u("more " * 300), _a("second")]}
    path = _write_jsonl(tmp_path / "len.jsonl", [only_errors, long, two_turns, GOOD])
    rep = build_data(_cfg(path, max_skip_fraction=1.0), "train").report
    assert rep.skipped["no loss tokens"] == 1
    assert rep.skipped["overlength"] == 1  # first assistant turn ends past max_length
    assert rep.truncated == 1 and rep.examples == 2  # two_turns kept up to its first answer
    assert rep.lengths.max() <= 256
    rep = build_data(_cfg(path, max_skip_fraction=1.0, overlength="drop"), "train").report
    assert rep.skipped["overlength"] == 2 and rep.truncated == 0


def test_drop_refinement_option_and_trailing_users(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"id": "c", "messages": CONVO + [_u("final observation")]}])
    rep = build_data(_cfg(path), "train").report
    assert rep.trailing_user_turns_trimmed == 1
    assert dict(rep.turns) == {"correct": 2, "erroneous": 3, "refinement": 2}
    assert dict(rep.trained_turns) == {"correct": 2, "erroneous": 0, "refinement": 2}
    rep = build_data(_cfg(path, drop_refinement_data=True), "train").report
    assert rep.refinement_turns_removed == 6
    assert dict(rep.turns) == {"correct": 4}


def _canonical_ids(tmp_path, rows):
    path = _write_jsonl(tmp_path / "canon.jsonl", rows)
    local = build_data(_cfg(path), "train")
    return [local.store.example(i)[0].tolist() for i in range(len(local.store))], [
        local.store.example(i)[1].tolist() for i in range(len(local.store))
    ]


def test_sharegpt_agentflan_parquet_custom_and_datasets_agree(tmp_path):
    import datasets

    canon = [{"id": "t", "messages": [SYS, _u("o1"), _a("bad", False), _u("err"), _a("fix")]}]
    want = _canonical_ids(tmp_path, canon)
    role_sg = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [
        {
            "id": "t",
            "conversations": [
                {"from": role_sg[m["role"]], "value": m["content"], "loss": m.get("loss")}
                for m in canon[0]["messages"]
            ],
        }
    ]
    agentflan = [
        {"id": "t", "conversation": [dict(m, loss=m.get("loss", False)) for m in canon[0]["messages"]]}
    ]
    # A custom layout: other column names, role values, and an is_error flag (opposite polarity).
    roles = {"system": "S", "user": "env", "assistant": "agent"}
    custom = [
        {
            "traj": [
                {"who": roles[m["role"]], "text": m["content"], "is_error": not m.get("loss", True)}
                for m in canon[0]["messages"]
            ]
        }
    ]
    fm = {"turns": "traj", "role": "who", "content": "text", "flag": "is_error", "flag_means": "error"}
    fm["roles"] = {v: k for k, v in roles.items()}

    sg_path = _write_jsonl(tmp_path / "sg.jsonl", sharegpt)
    af_path = tmp_path / "af.json"
    af_path.write_text(json.dumps(agentflan))
    pq_path = tmp_path / "sg.parquet"
    pq.write_table(pa.Table.from_pylist(sharegpt), pq_path)
    custom_path = tmp_path / "custom.parquet"
    # The turns stored as a JSON string column, as some exports do.
    pq.write_table(pa.Table.from_pylist([{"traj": json.dumps(custom[0]["traj"])}]), custom_path)
    ds_dir = tmp_path / "saved"
    datasets.Dataset.from_list(sharegpt).save_to_disk(str(ds_dir))

    cases = [
        (str(sg_path), "auto", {}),
        (str(sg_path), "sharegpt", {}),
        (str(af_path), "agentflan", {}),
        (str(pq_path), "auto", {}),
        (str(custom_path), "custom", fm),
        (str(ds_dir), "sharegpt", {}),
    ]
    for path, fmt, field_map in cases:
        local = build_data(_cfg(path, format=fmt, field_map=field_map), "train")
        got = [local.store.example(i)[0].tolist() for i in range(len(local.store))]
        masks = [local.store.example(i)[1].tolist() for i in range(len(local.store))]
        assert (got, masks) == want, (path, fmt)


def test_field_map_errors_are_clear():
    with pytest.raises(ValueError, match="unknown field_map keys"):
        resolve_field_map("custom", {"turn": "x"})
    with pytest.raises(ValueError, match="flag_means"):
        resolve_field_map("custom", {"flag_means": "maybe"})
    with pytest.raises(ValueError, match="explicit format"):
        resolve_field_map("auto", {"turns": "x"})
    with pytest.raises(RowError, match="unknown layout"):
        normalize_row({"foo": 1}, None, "x")


def test_numeric_flags_and_missing_flag_default(tmp_path):
    fm = resolve_field_map("sharegpt", {})
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "loss": 0}]}
    assert normalize_row(row, fm, "x")["messages"][1]["loss"] is False
    row["conversations"][1].pop("loss")
    assert normalize_row(row, fm, "x")["messages"][1]["loss"] is True
