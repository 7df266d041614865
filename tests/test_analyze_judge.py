"""`analyze judge-agreement` (Figure 10): `synth verify`'s per-turn verdicts against human labels."""

from __future__ import annotations

import json

import pytest
from sklearn.metrics import cohen_kappa_score
from test_synth_common import dm, player, raw

from agentrefine_jax.analyze import judge
from agentrefine_jax.analyze.cli import main
from agentrefine_jax.synth import cli as synth_cli


def _trajectories() -> list[dict]:
    """Three raw trajectories; the judge (the DM's error flag) says right/wrong per player turn."""

    def play(flags: list[bool]) -> list[dict]:
        turns = [dm("You are in the kitchen.")]
        for k, err in enumerate(flags):
            turns.append(player("I open the fridge.", "open fridge"))
            turns.append(dm("Done." if not err else "You cannot.", error=err, success=k == len(flags) - 1))
        return turns

    return [
        raw(play([False, True, False]), rid="a"),  # player turns 1 R, 3 W, 5 R
        raw(play([True, False]), rid="b"),  # 1 W, 3 R
        raw(play([False, True, False, False]), rid="c"),  # 1 R, 3 W, 5 R, 7 R
    ]


# (id, turn, human says needs refinement); c/5 is judged only, a/7 and d/1 are labelled only.
HUMAN = [
    ("a", 1, False),  # judge right: RR
    ("a", 3, False),  # judge wrong: human right, judge wrong
    ("a", 5, False),  # RR
    ("b", 1, True),  # WW
    ("b", 3, True),  # judge right: human wrong, judge right
    ("c", 1, False),  # RR
    ("c", 3, True),  # WW
    ("c", 7, False),  # RR
    ("a", 7, False),
    ("d", 1, True),
]


@pytest.fixture
def files(tmp_path):
    src = tmp_path / "raw.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in _trajectories()) + "not json\n")
    verdicts = tmp_path / "verify.jsonl"
    assert synth_cli.main(["verify", "--input", str(src), "--out", str(verdicts)]) == 0
    human = tmp_path / "human.jsonl"
    human.write_text(
        "".join(json.dumps({"id": i, "turn": t, "needs_refinement": w}) + "\n" for i, t, w in HUMAN)
    )
    return src, verdicts, human


def test_verify_writes_the_judges_per_turn_verdicts(files):
    _, verdicts, _ = files
    rows = [json.loads(line) for line in verdicts.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c", None]
    assert rows[0]["turns"] == [
        {"turn": 1, "needs_refinement": False},
        {"turn": 3, "needs_refinement": True},
        {"turn": 5, "needs_refinement": False},
    ]
    assert [t["needs_refinement"] for t in rows[2]["turns"]] == [False, True, False, False]
    assert rows[3]["turns"] == []


def test_hand_computed_table_accuracy_kappa_and_unmatched(files, tmp_path, capsys):
    _, verdicts, human = files
    out = tmp_path / "agreement.json"
    assert main(["judge-agreement", "--judge", str(verdicts), "--human", str(human), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(out.read_text())
    # By hand: RR = a1 a5 c1 c7, RW = a3, WR = b3, WW = b1 c3.
    assert doc["table"] == {
        "human_right/judge_right": 4,
        "human_right/judge_wrong": 1,
        "human_wrong/judge_right": 1,
        "human_wrong/judge_wrong": 2,
    }
    assert doc["matched"] == 8 and doc["accuracy"] == 0.75
    # p_e = (5*5 + 3*3) / 64; kappa = (0.75 - p_e) / (1 - p_e) = 7/15
    assert doc["kappa"] == pytest.approx(7 / 15)
    j, h = judge.read_judge(verdicts), judge.read_human(human)
    both = sorted(set(j) & set(h))
    assert doc["kappa"] == pytest.approx(cohen_kappa_score([h[k] for k in both], [j[k] for k in both]))
    assert doc["unmatched"]["judge_only"] == 1 and doc["unmatched"]["judge_only_turns"] == [["c", 5]]
    assert doc["unmatched"]["human_only_turns"] == [["a", 7], ["d", 1]]
    assert "| human: right | 4 | 1 |" in captured.out and "| human: wrong | 1 | 2 |" in captured.out
    assert "accuracy 75.0%, Cohen's kappa 0.467; unmatched: 1 judged only, 2 labelled only" in captured.out
    assert "3 unmatched turn(s)" in captured.err


def test_paper_rows_add_figure_10(files, capsys):
    _, verdicts, human = files
    assert (
        main(["judge-agreement", "--judge", str(verdicts), "--human", str(human), "--paper-rows", "-q"]) == 0
    )
    out = capsys.readouterr().out
    assert "| human: right | 47 | 9 |" in out and "| human: wrong | 3 | 41 |" in out
    # 88 of 100 agree; marginals 56/44 (human) and 50/50 (GPT-4): kappa = (0.88 - 0.5) / 0.5
    assert "accuracy 88.0%, Cohen's kappa 0.760" in out


def test_bad_inputs_are_one_line_and_exit_2(files, tmp_path, capsys):
    src, verdicts, human = files
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "zzz", "turn": 1, "needs_refinement": True}) + "\n")
    bad_label = tmp_path / "bad.jsonl"
    bad_label.write_text(json.dumps({"id": "a", "turn": 1, "needs_refinement": "yes"}) + "\n")
    cases = [
        (src, human, "not a `synth verify --out` row"),  # raw trajectories instead of verify's report
        (verdicts, other, "no turn is in both files"),
        (verdicts, bad_label, "needs_refinement must be true or false"),
        (verdicts, tmp_path / "missing.jsonl", "no such file"),
    ]
    for j, h, message in cases:
        assert main(["judge-agreement", "--judge", str(j), "--human", str(h)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[analyze] error:") and message in err[0], err


def test_module_entry_point_in_a_process(files, tmp_path):
    """`python -m agentrefine_jax.analyze` as users run it: a table on stdout; bad input: one line, exit 2."""
    import subprocess
    import sys

    _, verdicts, human = files
    run = [sys.executable, "-m", "agentrefine_jax.analyze", "judge-agreement", "--judge", str(verdicts)]
    ok = subprocess.run([*run, "--human", str(human)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "| human: right | 4 | 1 |" in ok.stdout, ok.stderr
    bad = subprocess.run(
        [*run, "--human", str(tmp_path / "absent.jsonl")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [f"[analyze] error: {tmp_path / 'absent.jsonl'}: no such file"]
