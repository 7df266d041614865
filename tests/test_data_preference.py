"""Preference pairs: which erroneous turns make pairs, plain TRL / LLaMA-Factory rows, masks
against a prefix-by-prefix render, and the packed rows (a pair's two replies in one row)."""

import json

import numpy as np
import pytest

from agentrefine_jax.config import DataConfig
from agentrefine_jax.data import DEMO_TRAIN
from agentrefine_jax.data.pipeline import DataError, NoPairsError, build_data, build_template
from agentrefine_jax.data.preference import (
    CHOSEN,
    NO_FEEDBACK,
    NO_REFINEMENT,
    REJECTED,
    SAME_REPLY,
    PairReport,
    plain_pair,
    render_reply,
    trajectory_pairs,
)
from agentrefine_jax.data.schema import validate_messages


def _conv():
    return validate_messages(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "obs1"},
            {"role": "assistant", "content": "bad1", "loss": False},
            {"role": "user", "content": "error: nothing happens"},
            {"role": "assistant", "content": "bad2", "loss": False},
            {"role": "user", "content": "error again"},
            {"role": "assistant", "content": "fix"},
            {"role": "user", "content": "ok"},
            {"role": "assistant", "content": "bad3", "loss": False},
            {"role": "user", "content": "error"},
        ]
    )


def test_trajectory_pairs_every_error_of_a_run_pairs_with_its_refinement():
    report = PairReport()
    msgs = _conv()
    pairs = trajectory_pairs(msgs, "r0", report)
    assert [(p.rejected, p.chosen, len(p.prompt)) for p in pairs] == [("bad1", "fix", 4), ("bad2", "fix", 6)]
    assert pairs[0].prompt == msgs[:4]
    assert report.erroneous_turns == 3
    assert dict(report.skipped) == {NO_REFINEMENT: 1}
    # An error that is the trajectory's last turn has no feedback after it.
    report = PairReport()
    assert trajectory_pairs(msgs[:11], "r0", report) == pairs
    assert dict(report.skipped) == {NO_FEEDBACK: 1}


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "task", "chosen": "good", "rejected": "bad"},  # TRL standard
        {  # TRL conversational
            "prompt": [{"role": "user", "content": "task"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        },
        {  # TRL implicit prompt
            "chosen": [{"role": "user", "content": "task"}, {"role": "assistant", "content": "good"}],
            "rejected": [{"role": "user", "content": "task"}, {"role": "assistant", "content": "bad"}],
        },
        {  # LLaMA-Factory sharegpt preference layout
            "conversations": [{"from": "human", "value": "task"}],
            "chosen": {"from": "gpt", "value": "good"},
            "rejected": {"from": "gpt", "value": "bad"},
        },
        {"instruction": "task", "chosen": "good", "rejected": "bad"},  # LLaMA-Factory alpaca
        {"messages": [{"role": "user", "content": "task"}], "chosen": "good", "rejected": "bad"},
    ],
)
def test_plain_preference_layouts(row):
    pair = plain_pair(row, "x")
    assert (pair.prompt, pair.chosen, pair.rejected) == ([{"role": "user", "content": "task"}], "good", "bad")


@pytest.fixture(scope="module", params=["llama3", "mistral"])
def template(request):
    return build_template(DataConfig(tokenizer=request.param, template=request.param))


def test_reply_mask_is_what_the_prompt_render_leaves_out(template):
    msgs = _conv()
    prompt = msgs[:4]
    ids, mask = render_reply(template, prompt, "fix it")
    head = template.encode_prompt(prompt)
    assert ids[: len(head)] == head and not any(mask[: len(head)])
    assert all(mask[len(head) :])
    # The reply's tokens and end token, as the SFT render of the whole conversation has them.
    full, full_mask = template.encode([*prompt, {"role": "assistant", "content": "fix it"}], ("correct",))
    assert full == ids
    assert full_mask[len(head) :] == mask[len(head) :]


@pytest.fixture(scope="module")
def demo_slice(tmp_path_factory):
    path = tmp_path_factory.mktemp("pref") / "demo.jsonl"
    path.write_text("".join(DEMO_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:40]))
    return path


@pytest.mark.parametrize("objective", ["dpo", "sft+dpo"])
def test_packed_rows_keep_each_pair_together(demo_slice, objective):
    cfg = DataConfig(train_files=(str(demo_slice),), tokenizer="llama3", template="llama3", max_length=512)
    data = build_data(cfg, "train", objective=objective)
    pref = data.report.preference
    assert pref.pairs > 10 and pref.erroneous_turns >= pref.pairs
    kinds = [int(data.store.example(i)[1].max()) for i in range(len(data.store))]
    n_sft = kinds.count(1)
    assert (n_sft > 0) == (objective == "sft+dpo")
    assert kinds.count(CHOSEN) == kinds.count(REJECTED) == pref.pairs
    seen = 0
    for row in data.rows:
        assert sum(int(data.store.lengths[e]) for e in row) <= cfg.max_length
        row_kinds = [kinds[e] for e in row]
        for j, k in enumerate(row_kinds):  # every chosen is followed by its rejected, in the same row
            if k == CHOSEN:
                assert row_kinds[j + 1] == REJECTED and row[j + 1] == row[j] + 1
                seen += 1
    assert seen == pref.pairs
    assert "preference pairs:" in data.report.summary()
    # Fill counts every token in the rows against their slots; "one example per row" gives each
    # example and each pair (chosen + rejected: one unit) a row of its own.
    rep = data.report
    assert rep.tokens == int(data.store.lengths.sum())
    assert rep.packing_efficiency == rep.tokens / (len(data.rows) * cfg.max_length)
    assert rep.padded_efficiency == rep.tokens / ((n_sft + pref.pairs) * cfg.max_length)
    assert 0 < rep.padded_efficiency <= rep.packing_efficiency <= 1


def test_no_pairs_is_one_error(tmp_path):
    path = tmp_path / "clean.jsonl"
    rows = [json.loads(line) for line in DEMO_TRAIN.read_text().splitlines()[:30]]
    clean = [r for r in rows if all(m.get("loss", True) for m in r["messages"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in clean))
    cfg = DataConfig(train_files=(str(path),), tokenizer="llama3", template="llama3", max_length=512)
    with pytest.raises(NoPairsError, match="objective=dpo needs preference pairs"):
        build_data(cfg, "train", objective="dpo")
    assert np.all(build_data(cfg, "train").store.mask <= 1)  # the SFT path is untouched


def test_cli_stats_counts_pairs_and_show_pair_renders_one(demo_slice, capsys):
    from agentrefine_jax.data import cli

    common = ["-i", str(demo_slice), "--template", "llama3", "--max-length", "512"]
    assert cli.main(["stats", *common]) == 0
    out = capsys.readouterr().out
    assert "preference pairs:" in out and "erroneous turns" in out
    assert cli.main(["show", *common, "--pair", "0", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert "── chosen (the refinement)" in out and "── rejected (the erroneous turn)" in out
    assert cli.main(["show", *common, "--pair", "100000"]) == 2


def _trl_file(tmp_path, rows):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pair_cfg(path, **kw):
    return DataConfig(train_files=(str(path),), tokenizer="llama3", template="llama3", max_length=512, **kw)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_skipped_preference_rows_count_toward_max_skip_fraction(tmp_path, objective):
    """Issue 44: 8 of 10 malformed rows were skipped and a pairs-only objective built on the rest."""
    good = [{"prompt": f"task {i}", "chosen": "good", "rejected": "bad"} for i in range(2)]
    bad = [{"prompt": 5, "chosen": "a", "rejected": "b"}] * 7 + [
        {"prompt": "t", "chosen": 1, "rejected": "b"}
    ]
    path = _trl_file(tmp_path, good + bad)
    with pytest.raises(
        DataError, match=r"train: 8 of 10 records skipped \(bad preference row 8\); first at "
    ):
        build_data(_pair_cfg(path), "train", objective=objective)
    # Allowed: built, the skips reported as the SFT path reports its own.
    data = build_data(_pair_cfg(path, max_skip_fraction=0.8), "train", objective=objective)
    rep = data.report
    assert rep.preference.pairs == 2 and dict(rep.skipped) == {"bad preference row": 8}
    assert (rep.records_in_shard, rep.parsed, rep.skipped_total) == (10, 2, 8)
    assert "8 skipped" in rep.summary() and f"{path}:3" in rep.summary()


def test_a_pair_with_identical_replies_is_skipped_and_counted(tmp_path):
    """Its DPO loss is log 2 whatever the model does: it was kept (and counted as a pair)."""
    rows = [{"prompt": f"task {i}", "chosen": "good", "rejected": "bad"} for i in range(3)]
    rows.insert(
        1, {"prompt": "task x", "chosen": [{"role": "assistant", "content": "same"}], "rejected": "same"}
    )
    path = _trl_file(tmp_path, rows)
    data = build_data(_pair_cfg(path), "train", objective="dpo")
    pref = data.report.preference
    assert pref.pairs == 3 and pref.preference_rows == 4 and dict(pref.skipped) == {SAME_REPLY: 1}
    assert dict(data.report.skipped) == {SAME_REPLY: 1} and f"{path}:2" in data.report.summary()
    assert len(data.store) == 2 * 3  # chosen + rejected of each kept pair
    # A trajectory's refinement that repeats its error was already skipped the same way.
    report = PairReport()
    msgs = validate_messages(
        [
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "go", "loss": False},
            {"role": "user", "content": "error"},
            {"role": "assistant", "content": "go"},
        ]
    )
    assert trajectory_pairs(msgs, "r", report) == [] and dict(report.skipped) == {SAME_REPLY: 1}
