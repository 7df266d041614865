"""Recovery metrics (docs/eval.md, "Metrics"): exact numbers on hand-built episodes of both sources, the
results document and `analyze report` carrying them, and a real run of a tiny random-weight model."""

from __future__ import annotations

import json

import pytest
from test_eval_checkpoint import CFG, save_random_checkpoint

from agentrefine_jax.analyze.cli import main as analyze_main
from agentrefine_jax.eval.agentboard.tasks.base import EpisodeSpec
from agentrefine_jax.eval.cli import main as eval_main
from agentrefine_jax.eval.core import EpisodeResult
from agentrefine_jax.eval.metrics import (
    AGENTBOARD_COLUMNS,
    group_metrics,
    recovery_counts,
    recovery_rates,
    task_metrics,
)
from agentrefine_jax.eval.results import results_document

# Two episodes as (action, valid) turns; None = a reply the parser could not read.
EP1 = [
    ("go to hall", True),
    ("grab key", False),  # a run of 2 rejections, recovered after 2 turns
    ("grab key", False),  # repeats the same rejected action
    ("take key from desk", True),
    (None, False),  # a run of 2 unparseable replies, then a different rejected action: a run of 3
    (None, False),  # repeats (a second unparseable reply)
    ("Jump", False),  # not a repeat
    ("look", True),  # recovers after 3 turns
]
EP2 = [
    ("open box", False),  # recovered next turn (1 step)
    ("open box", True),
    ("fly", False),  # ends the episode: no next turn, not recovered
]
# after_error: EP1 turns 3,4,6,7,8 (5) + EP2 turns 2 (1) = 6; valid next: EP1 4, 8; EP2 2 -> 3
# repeated: EP1 3, 6 -> 2; runs: EP1 2 (both recovered: 2 + 3 steps), EP2 2 (1 recovered: 1 step)
EXPECTED = {
    "recovery_rate": 3 / 6,
    "mean_steps_to_recover": (2 + 3 + 1) / 3,
    "repeated_error_rate": 2 / 6,
    "recovery_counts": {
        "after_error": 6,
        "recovered_next": 3,
        "repeated": 2,
        "streaks": 4,
        "recovered_streaks": 3,
        "steps_to_recover": 6,
    },
}


def _builtin(turns, episode: int) -> EpisodeResult:
    trace = [
        {"step": i + 1, "action": a, "valid": v, "executed": a is not None} for i, (a, v) in enumerate(turns)
    ]
    return EpisodeResult(
        task="demo_world",
        variant="original",
        episode=episode,
        sample=0,
        spec={"seed": episode},
        success=False,
        progress=0.0,
        steps=len(turns),
        termination="max_steps",
        error=None,
        invalid_actions=sum(a is not None and not v for a, v in turns),
        format_errors=sum(a is None for a, _ in turns),
        seconds=0.0,
        messages=[],
        trace=trace,
    )


def _agentboard(turns, index: int) -> EpisodeResult:
    spec = EpisodeSpec(task="pddl", index=index, id=f"p{index}", difficulty="easy", info={})
    # AgentBoard's parser always yields an action; an unreadable reply is the raw text, rejected
    logged = [
        {"action": a if a is not None else "???", "observation": "", "progress": 0.0, "valid": v}
        for a, v in turns
    ]
    return EpisodeResult(
        task="pddl",
        variant="original",
        episode=index,
        sample=0,
        spec=spec,
        success=False,
        progress=0.0,
        steps=len(turns),
        termination="max_steps",
        error=None,
        invalid_actions=sum(not v for _, v in turns),
        format_errors=0,
        seconds=0.0,
        messages=[],
        trace=logged,
    )


def test_counts_of_one_episode_are_exact():
    assert recovery_counts(EP1) == {
        "after_error": 5,
        "recovered_next": 2,
        "repeated": 2,
        "streaks": 2,
        "recovered_streaks": 2,
        "steps_to_recover": 5,
    }
    assert recovery_counts([("look", True)]) == dict.fromkeys(EXPECTED["recovery_counts"], 0)


def test_both_sources_records_give_the_same_exact_rates():
    builtin = [_builtin(EP1, 0), _builtin(EP2, 1)]
    assert recovery_rates(builtin) == EXPECTED
    # the results file's JSON form of the records reads the same
    assert recovery_rates([r.to_json() for r in builtin]) == EXPECTED
    # AgentBoard's records: its parser's raw text stands for the unparseable replies (repeated as well)
    assert recovery_rates([_agentboard(EP1, 0), _agentboard(EP2, 1)]) == EXPECTED
    # the per-task metrics of both sources carry them
    assert {k: task_metrics(builtin)["original"]["demo_world"][k] for k in EXPECTED} == EXPECTED
    ab = group_metrics([_agentboard(EP1, 0), _agentboard(EP2, 1)], AGENTBOARD_COLUMNS)
    assert {k: ab[k] for k in EXPECTED} == EXPECTED
    # nothing rejected: nothing to divide by
    clean = recovery_rates([_builtin([("look", True)] * 3, 0)])
    assert (clean["recovery_rate"], clean["mean_steps_to_recover"], clean["repeated_error_rate"]) == (
        None,
    ) * 3


def test_results_document_and_analyze_report_show_them(tmp_path, capsys):
    records = [_builtin(EP1, 0), _builtin(EP2, 1)]
    variants = task_metrics(records)
    doc = results_document(
        "builtin",
        "scripted",
        {"tasks": ["demo_world"], "best_of": 1, "seed": 0},
        tasks=variants["original"],
        variants=variants,
        episodes=[r.to_json() for r in records],
        extra={"policy": "scripted"},
    )
    assert doc["tasks"]["demo_world"]["recovery_rate"] == 0.5
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert analyze_main(["report", f"scripted={path}", "--out", str(tmp_path / "rep"), "-q"]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    section = report.split("## Recovery", 1)[1].split("\n## ", 1)[0]
    assert "| model | Demo world |" in section
    assert "| scripted | 50.0 / 2.00 / 33.3 |" in section


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "run", CFG, seed=0)


def test_a_real_run_of_a_tiny_model_stores_its_recovery(checkpoint, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--checkpoint", checkpoint, "--tasks", "demo_world", "--episodes", "2", "--max-steps", "4"]
    argv += ["--max-new-tokens", "12", "--batch-size", "2", "--workdir", str(tmp_path / "w"), "-q"]
    assert eval_main([*argv, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    doc = json.loads(out.read_text())
    m = doc["tasks"]["demo_world"]
    # the stored numbers are the records' own
    assert {k: m[k] for k in EXPECTED} == recovery_rates(doc["episodes"])
    turns = [(e["action"], e["valid"]) for ep in doc["episodes"] for e in ep["trace"]]
    assert len(turns) == 8
    # a random-weight model never writes the format: every turn rejected, never recovered, each a repeat
    assert all(a is None and not v for a, v in turns)
    assert (m["recovery_rate"], m["mean_steps_to_recover"], m["repeated_error_rate"]) == (0.0, None, 1.0)
    assert m["recovery_counts"] == {
        "after_error": 6,
        "recovered_next": 0,
        "repeated": 6,
        "streaks": 2,
        "recovered_streaks": 0,
        "steps_to_recover": 0,
    }
    assert "recover / repeat" in table
