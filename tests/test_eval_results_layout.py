"""One results layout (schema `agentrefine_jax.eval/2`) for both sources, and the older files still read.

The schema-/1 files under data/eval_schema1/ were written by the eval of the last /1 release (a5b69e4)
from the same commands the tests run here (their episode lists cut): a /1 file and today's /2 file of the
same run must read to the same scores (`analyze/results.py` upgrades the /1 layouts to /2 first).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from agentrefine_jax.analyze.results import RunResult, read_result
from agentrefine_jax.eval.cli import main as eval_main

V1 = pathlib.Path(__file__).parent / "data" / "eval_schema1"
SECTIONS = {
    "schema",
    "source",
    "protocol",
    "agent",
    "config",
    "tasks",
    "held_out",
    "variants",
    "perturbation_summary",
    "best_of",
    "episodes",
}
EXTRAS = {"builtin": {"policy", "seconds"}, "agentboard": {"agentboard_dir", "max_steps"}}
EVAL = ["--tasks", "babyai,pddl", "--max-steps", "8", "-q"]


def _builtin(tmp: pathlib.Path, name: str, *extra: str) -> pathlib.Path:
    out = tmp / f"{name}.json"
    argv = ["--policy", "random", "--episodes", "3", *extra, *EVAL, "--workdir", str(tmp / "w")]
    assert eval_main([*argv, "--out", str(out)]) == 0
    return out


def _agentboard(tmp: pathlib.Path, name: str, *extra: str) -> pathlib.Path:
    from agentboard_fixture import make_checkout

    out = tmp / f"{name}.json"
    ck = make_checkout(tmp / f"AgentBoard_{name}")
    argv = ["--agentboard-dir", str(ck), "--tasks", "pddl", "--policy", "random", "--episodes", "3"]
    assert eval_main([*argv, *extra, "--out", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    tmp = tmp_path_factory.mktemp("layout")
    return {
        "builtin_best_of_3": _builtin(tmp, "bo3", "--best-of", "3"),
        "builtin_perturb_2": _builtin(tmp, "pert", "--perturb", "--num-perturbations", "2"),
        "agentboard_best_of_3": _agentboard(tmp, "ab", "--best-of", "3", "--temperature", "1.0"),
    }


def test_both_sources_write_the_same_sections_with_the_same_meaning(files):
    docs = {k: json.loads(p.read_text()) for k, p in files.items()}
    builtin, agentboard = docs["builtin_best_of_3"], docs["agentboard_best_of_3"]
    for doc in (builtin, agentboard):
        assert doc["schema"] == "agentrefine_jax.eval/2" and doc["protocol"] == doc["source"]
        assert set(doc) == SECTIONS | EXTRAS[doc["source"]], doc["source"]
        # the headline is the greedy run: Table 4's greedy row, under either source
        for t, m in doc["best_of"]["tasks"].items():
            assert m["greedy"] == {k: doc["tasks"][t][k] for k in ("success_rate", "progress_rate")}
    assert set(builtin["held_out"]) - {"unweighted_mean"} == set(agentboard["held_out"]) - {"note"}
    assert set(builtin["best_of"]) - {"greedy_episodes"} == set(agentboard["best_of"]) - {"episodes"}
    assert builtin["best_of"]["greedy_run"] == "sample 0"  # the random policy: its first sample
    assert agentboard["best_of"]["greedy_run"] == "temperature 0"  # AgentBoard runs it apart
    # variants hold each variant's scores over its samples: Best-of-3 on the built-in source...
    for t, m in builtin["variants"]["original"]["tasks"].items():
        best = builtin["best_of"]["tasks"][t]["best_of"]
        assert (m["success_rate"], m["progress_rate"]) == (best["success_rate"], best["progress_rate"])
    # ...and AgentBoard's greedy original, its samples apart in best_of
    assert agentboard["variants"]["original"]["tasks"] == agentboard["tasks"]
    # the held-out average of the headline: built-in renormalises over the two tasks run, AgentBoard's
    # source gives none without all four held-out tasks (AgentBoard's summaries never average a subset)
    held, w = builtin["held_out"], builtin["held_out"]["weights"]
    assert held["missing"] == ["sciworld", "textworld"] and held["tasks"] == ["babyai", "pddl"]
    assert held["success_rate"] == pytest.approx(sum(builtin["tasks"][t]["success_rate"] * w[t] for t in w))
    assert agentboard["held_out"]["success_rate"] is None and agentboard["held_out"]["note"]
    assert agentboard["held_out"]["missing"] == ["babyai", "sciworld", "jericho"]
    pert = json.loads(files["builtin_perturb_2"].read_text())
    assert sorted(pert["variants"]) == ["original", "perturbation_1", "perturbation_2"]
    assert pert["tasks"] == pert["variants"]["original"]["tasks"]  # one sample: the variant is the headline


def _scores(r: RunResult) -> dict:
    def sp(s):
        return None if s is None else (s.success, s.progress, s.episodes)

    return {
        "tasks": {t: sp(s) for t, s in r.tasks.items()},
        "single_kind": r.single_kind,
        "held_out": None
        if r.held_out is None
        else (round(r.held_out.success, 12), round(r.held_out.progress, 12)),
        "best_of": r.best_of,
        "best_of_tasks": {t: sp(s) for t, s in r.best_of_tasks.items()},
        "perturbations": {t: [sp(s) for s in ss] for t, ss in r.perturbations.items()},
        "protocol": r.protocol,
        "agent": r.agent,
    }


@pytest.mark.parametrize("name", ["builtin_best_of_3", "builtin_perturb_2", "agentboard_best_of_3"])
def test_a_schema_1_file_reads_as_the_same_run_written_today(files, name):
    old = read_result(V1 / f"{name}.json")
    assert json.loads((V1 / f"{name}.json").read_text())["schema"] == "agentrefine_jax.eval/1"
    assert _scores(read_result(files[name])) == _scores(old)


def test_schema_1_files_keep_their_own_meaning():
    """What analyze read from /1 files before the /2 layout: a built-in Best-of-N file's headline is its
    first sample, Best-of-N its variant's rates; AgentBoard's perturbations come from `perturbation`."""
    doc = json.loads((V1 / "builtin_best_of_3.json").read_text())
    r = read_result(V1 / "builtin_best_of_3.json")
    orig = doc["variants"]["original"]["tasks"]
    assert r.single_kind == "first sample" and r.best_of == 3
    for t, m in orig.items():
        assert (r.tasks[t].success, r.tasks[t].progress) == (
            m["first_sample_success_rate"],
            m["first_sample_progress_rate"],
        )
        assert (r.best_of_tasks[t].success, r.best_of_tasks[t].progress) == (
            m["success_rate"],
            m["progress_rate"],
        )
    w = doc["variants"]["original"]["held_out_average"]["weights"]
    want = sum(orig[t]["first_sample_success_rate"] * w[t] for t in w) / sum(w.values())
    assert r.held_out is not None and r.held_out.success == pytest.approx(want)

    doc = json.loads((V1 / "agentboard_alfworld_perturb_2.json").read_text())
    r = read_result(V1 / "agentboard_alfworld_perturb_2.json")
    p = doc["perturbation"]["alfworld"]
    assert [s.progress for s in r.perturbations["alfworld"]] == [
        doc["tasks"]["alfworld"]["progress_rate"],
        *(v["progress_rate"] for v in p["variants"]),
    ]
    assert r.held_out is None and r.protocol == "agentboard"


def test_agentboard_held_out_means_only_over_all_four_tasks():
    """AgentBoard's source averages the four held-out tasks or none: with all four, the paper-weighted
    mean (= the episode-weighted one on full sets) and the unweighted one; with a subset, neither is
    printed (no line of dashes)."""
    from agentrefine_jax.eval.config import EvalConfig
    from agentrefine_jax.eval.results import results_document
    from agentrefine_jax.eval.tables import format_table

    def m(rate: float, n: int) -> dict:
        splits = {"success_rate_easy": None, "success_rate_hard": None}
        return {"episodes": n, "success_rate": rate, "progress_rate": rate, "grounding_acc": 1.0} | splits

    full = {"babyai": m(0.5, 112), "sciworld": m(0.0, 90), "pddl": m(1.0, 60), "jericho": m(0.0, 20)}
    for tasks in (full, {"pddl": full["pddl"]}):
        cfg = EvalConfig(tasks=tuple(tasks), source="agentboard")
        cfg.validate()
        doc = results_document("agentboard", "x", cfg, tasks=tasks, variants={"original": tasks}, episodes=[])
        lines = [x for x in format_table(doc | {"max_steps": 30}).splitlines() if x.startswith("held-out")]
        if tasks is full:
            assert doc["held_out"]["success_rate"] == pytest.approx((56 + 60) / 282)
            assert doc["held_out"]["unweighted_mean"]["success_rate"] == pytest.approx(1.5 / 4)
            assert len(lines) == 2 and "41.1%" in lines[1] and "37.5%" in lines[0]
        else:
            assert doc["held_out"]["success_rate"] is None and doc["held_out"]["missing"]
            assert lines == []
