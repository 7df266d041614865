"""Flag polarity for untrained turns (AgentInstruct / AgentTraj-L), role maps that extend
presets, deeply nested JSON, duplicate ids, and the data CLI's exits and defaults."""

import json

import pytest

from agentrefine_jax.config import DataConfig
from agentrefine_jax.data import cli
from agentrefine_jax.data.pipeline import DataError, build_data
from agentrefine_jax.data.schema import (
    assistant_categories,
    drop_refinement_data,
    normalize_row,
    resolve_field_map,
)

# The layout of THUDM/AgentInstruct: the instruction, an "Ok." ack with `loss: false` (not
# trained, not a mistake), then the task with trained turns.
INSTRUCTION = "You are an assistant that operates a shell. Answer with Act: bash or Act: answer."
AGENTINSTRUCT = {
    "id": "os_0",
    "conversations": [
        {"from": "human", "loss": None, "value": INSTRUCTION},
        {"from": "gpt", "loss": False, "value": "Ok."},
        {"from": "human", "loss": None, "value": "Task: how many files are in /etc?"},
        {"from": "gpt", "loss": True, "value": "Think: count them.\nAct: bash ls /etc | wc -l"},
        {"from": "human", "loss": None, "value": "Output: 42"},
        {"from": "gpt", "loss": True, "value": "Act: answer(42)"},
    ],
}


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _cfg(path, **kw):
    return DataConfig(train_files=(str(path),), template="mistral", tokenizer="mistral", max_length=512, **kw)


def test_agentinstruct_false_means_not_trained_not_erroneous():
    msgs = normalize_row(AGENTINSTRUCT, resolve_field_map("agentinstruct"), "x")["messages"]
    # The ack is context only; the first task turn is an ordinary correct turn, not a "refinement".
    assert [c for c in assistant_categories(msgs) if c] == ["untrained", "correct", "correct"]
    # Read with the ShareGPT (AgentRefine) polarity, the same row is an error + refinement.
    sg = normalize_row(AGENTINSTRUCT, resolve_field_map("sharegpt"), "x")["messages"]
    assert [c for c in assistant_categories(sg) if c] == ["erroneous", "refinement", "correct"]
    # drop_refinement_data keeps the instruction and the ack.
    kept, removed = drop_refinement_data(msgs)
    assert removed == 0 and kept == msgs
    # An untrained turn is transparent: error, untrained, trained -> the trained one is the refinement.
    chain = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "bad", "loss": False},
        {"role": "user", "content": "err"},
        {"role": "assistant", "content": "ack", "train": False},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "fix"},
    ]
    assert [c for c in assistant_categories(chain) if c] == ["erroneous", "untrained", "refinement"]


def test_untrained_turns_get_no_loss_under_any_loss_on_and_survive_drop_refinement(tmp_path):
    path = _write_jsonl(tmp_path / "ai.jsonl", [AGENTINSTRUCT])
    base = build_data(_cfg(path, format="agentinstruct"), "train")
    every = build_data(
        _cfg(path, format="agentinstruct", loss_on=("correct", "refinement", "erroneous")), "train"
    )
    dropped = build_data(_cfg(path, format="agentinstruct", drop_refinement_data=True), "train")
    ids, mask = (a.tolist() for a in base.store.example(0))
    assert every.store.example(0)[1].tolist() == mask  # "Ok." is never trained
    assert dropped.store.example(0)[0].tolist() == ids  # nothing removed
    assert dropped.report.refinement_turns_removed == 0
    assert dict(base.report.turns) == {"untrained": 1, "correct": 2}
    assert base.report.trained_turns["untrained"] == 0
    # The ack's tokens are untrained, the answers' are trained.
    from agentrefine_jax.data.pipeline import build_template

    tok = build_template(_cfg(path)).tokenizer
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert "Ok." not in trained and "answer(42)" in trained and "wc -l" in trained


def test_agenttraj_preset_reads_item_id_and_polarity():
    row = {"item_id": "webshop_7", "conversations": AGENTINSTRUCT["conversations"]}
    conv = normalize_row(row, resolve_field_map("agenttraj"), "fallback")
    assert conv["id"] == "webshop_7"
    assert [c for c in assistant_categories(conv["messages"]) if c] == ["untrained", "correct", "correct"]


def test_custom_train_polarity():
    fm = resolve_field_map("custom", {"flag": "trainable", "flag_means": "train"})
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "trainable": 0}]
    }
    msg = normalize_row(row, fm, "x")["messages"][1]
    assert msg["train"] is False and msg["loss"] is True


def test_roles_override_extends_the_preset():
    fm = resolve_field_map("sharegpt", {"roles": {"observation": "user", "function_call": "assistant"}})
    assert (
        fm.roles["human"] == "user" and fm.roles["gpt"] == "assistant" and fm.roles["observation"] == "user"
    )
    row = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "function_call", "value": "call()"},
            {"from": "observation", "value": "result"},
            {"from": "gpt", "value": "done"},
        ]
    }
    assert [m["role"] for m in normalize_row(row, fm, "x")["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    # A value may still remap a preset key.
    assert resolve_field_map("sharegpt", {"roles": {"human": "assistant"}}).roles["human"] == "assistant"


GOOD = {
    "id": "ok",
    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
}
DEEP = "[" * 100_000 + "]" * 100_000


def test_deeply_nested_json_is_a_counted_skip(tmp_path):
    path = _write_jsonl(tmp_path / "deep.jsonl", [GOOD, DEEP, dict(GOOD, id="ok2")])
    rep = build_data(_cfg(path), "train").report
    assert rep.examples == 2 and dict(rep.skipped) == {"nested too deeply": 1}
    assert rep.skipped_at[0][0].endswith("deep.jsonl:2")
    # The same inside a turn list stored as a JSON string (parquet exports).
    row = {"id": "s", "conversations": DEEP}
    path = _write_jsonl(tmp_path / "deep_string.jsonl", [GOOD, row, dict(GOOD, id="ok2")])
    rep = build_data(_cfg(path), "train").report
    assert rep.skipped["nested too deeply"] == 1


def test_duplicate_ids_are_counted_and_shown(tmp_path):
    path = _write_jsonl(tmp_path / "dup.jsonl", [GOOD, dict(GOOD, id="other"), GOOD, GOOD])
    rep = build_data(_cfg(path), "train").report
    assert rep.examples == 4 and rep.duplicate_ids == 2  # kept, but reported
    assert [w.rsplit(":", 1)[1] for w, _ in rep.duplicate_ids_at] == ["3", "4"]
    assert "duplicate ids (rows kept): 2" in rep.summary() and "'ok'" in rep.summary()
    assert rep.to_dict()["duplicate_ids"] == 2


@pytest.mark.parametrize("cmd", ["stats", "dump"])
def test_cli_exits_2_with_one_line_when_nothing_is_usable(tmp_path, capsys, cmd):
    path = _write_jsonl(tmp_path / "bad.jsonl", ["{not json", DEEP, {"messages": []}])
    argv = [cmd, "-i", path, "--template", "mistral", "--max-skip-fraction", "1.0"]
    if cmd == "dump":
        argv += ["--out", str(tmp_path / "out.jsonl")]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "[data] error: no usable train examples: 3 of 3 records skipped"
    )
    assert "nested too deeply 1" in lines[0] and captured.out == ""


def test_cli_and_training_share_the_max_skip_fraction_default(tmp_path, capsys):
    sub = cli.build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse has no API
    for name in ("dump", "stats", "show"):
        action = next(a for a in sub[name]._actions if a.dest == "max_skip_fraction")  # noqa: SLF001
        assert action.default == DataConfig().max_skip_fraction == 0.5
    # 2 of 3 rows bad: training refuses, and so does `stats` by default (it used to exit 0).
    path = _write_jsonl(tmp_path / "mostly_bad.jsonl", ["{not json", {"messages": []}, GOOD])
    with pytest.raises(DataError, match="max_skip_fraction=0.5"):
        build_data(_cfg(path), "train")
    assert cli.main(["stats", "-i", path, "--template", "mistral"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_skip_fraction=0.5" in err[0]


def test_training_on_unusable_data_stops_with_one_line(tmp_path):
    import os
    import subprocess
    import sys

    path = _write_jsonl(tmp_path / "bad.jsonl", ["{not json", DEEP])
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny"]
    cmd += ["--set", f"data.train_files={path}", "--set", f"train.run_dir={tmp_path / 'run'}"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("[train] error:")]
    assert len(errors) == 1 and "no usable train examples: 2 of 2 records skipped" in errors[0]
