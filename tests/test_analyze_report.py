"""`analyze report` on result files written in the test by real `eval` runs (oracle and random policies
on the built-in BabyAI and PDDL tasks, one with Best-of-N, one with perturbations, two tiny checkpoints
whose training configs differ): every number in the Markdown is checked against the JSONs."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from PIL import Image

from agentrefine_jax.analyze.cli import main
from agentrefine_jax.analyze.figures import SIZES
from agentrefine_jax.eval.cli import main as eval_main

PAPER_MD = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "PAPER.md"
EVAL = ["--tasks", "babyai,pddl", "--max-steps", "8", "-q"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, pathlib.Path]:
    d = tmp_path_factory.mktemp("results")
    out = {name: d / f"{name}.json" for name in ("oracle", "random_bo3", "random_pert")}
    assert eval_main(["--policy", "oracle", "--episodes", "2", *EVAL, "--out", str(out["oracle"])]) == 0
    argv = ["--policy", "random", "--episodes", "3", "--best-of", "3", *EVAL, "--out", str(out["random_bo3"])]
    assert eval_main(argv) == 0
    argv = ["--policy", "random", "--episodes", "3", "--perturb", *EVAL, "--out", str(out["random_pert"])]
    assert eval_main(argv) == 0
    return out


def tables(markdown: str) -> dict[str, dict[str, list[str]]]:
    """heading (or bold task name) -> first cell -> the other cells, for every Markdown table."""
    out: dict[str, dict[str, list[str]]] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#") or line.startswith("**"):
            heading = line.strip("#* ")
        elif line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.setdefault(heading, {})[cells[0]] = cells[1:]
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def sp(success: float, progress: float) -> str:
    return f"{pct(success)} / {pct(progress)}"


def held_out(original: dict, prefix: str = "") -> str:
    w = original["held_out_average"]["weights"]
    s = sum(original["tasks"][t][prefix + "success_rate"] * w[t] for t in w) / sum(w.values())
    p = sum(original["tasks"][t][prefix + "progress_rate"] * w[t] for t in w) / sum(w.values())
    return sp(s, p)


def test_tables_hold_the_numbers_of_the_result_files(runs, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["report", str(runs["oracle"]), str(runs["random_bo3"]), f"random={runs['random_pert']}"]
    assert main([*argv, "--out", str(out), "-q"]) == 0
    md = capsys.readouterr().out
    assert (out / "report.md").read_text() == md
    t = tables(md)
    docs = {k: json.loads(p.read_text()) for k, p in runs.items()}

    t1 = t["Table 1: success / progress per task"]
    assert t1["model"] == ["BabyAI", "PDDL", "held-out"]
    o = docs["oracle"]["variants"]["original"]
    assert t1["oracle"] == [
        sp(o["tasks"][k]["success_rate"], o["tasks"][k]["progress_rate"]) for k in ("babyai", "pddl")
    ] + [held_out(o)]
    assert t1["oracle"] == ["100.0 / 100.0"] * 3  # the reference solvers solve every episode
    r = docs["random_pert"]["variants"]["original"]
    assert t1["random"] == [
        sp(r["tasks"][k]["success_rate"], r["tasks"][k]["progress_rate"]) for k in ("babyai", "pddl")
    ] + [held_out(r)]
    b = docs["random_bo3"]["variants"]["original"]
    first = [
        sp(b["tasks"][k]["first_sample_success_rate"], b["tasks"][k]["first_sample_progress_rate"])
        for k in ("babyai", "pddl")
    ]
    assert t1["random_bo3 (first sample)"] == first + [held_out(b, "first_sample_")]

    t4 = t["Table 4: single sample vs Best-of-N"]
    best = [sp(b["tasks"][k]["success_rate"], b["tasks"][k]["progress_rate"]) for k in ("babyai", "pddl")]
    assert t4["random_bo3 first sample"] == first and t4["random_bo3 Best-of-3"] == best
    delta = [
        sp(
            b["tasks"][k]["success_rate"] - b["tasks"][k]["first_sample_success_rate"],
            b["tasks"][k]["progress_rate"] - b["tasks"][k]["first_sample_progress_rate"],
        )
        for k in ("babyai", "pddl")
    ]
    assert t4["random_bo3 Δ"] == delta
    for k in ("babyai", "pddl"):  # Best-of-N never loses to its own first sample
        assert b["tasks"][k]["success_rate"] >= b["tasks"][k]["first_sample_success_rate"]

    variants = docs["random_pert"]["variants"]
    for task, name in (("babyai", "BabyAI"), ("pddl", "PDDL")):
        row = t[name]["random"]
        names = ["original", "perturbation_1", "perturbation_2", "perturbation_3"]
        s = np.array([variants[v]["tasks"][task]["success_rate"] for v in names])
        p = np.array([variants[v]["tasks"][task]["progress_rate"] for v in names])
        assert t[name]["model"] == ["original", "P1", "P2", "P3", "average", "std"]
        assert row[:4] == [sp(a, c) for a, c in zip(s, p, strict=True)]
        # the paper's average and population std: over the original and the perturbations
        assert row[4:] == [sp(s.mean(), p.mean()), f"{100 * s.std():.2f} / {100 * p.std():.2f}"]
    assert not any(k.startswith("Table 2") or k.startswith("Figure 11") or k.startswith("Table 5") for k in t)

    with Image.open(out / "figure1_progress.png") as im:
        assert im.format == "PNG" and im.size == SIZES["bars"]


# Independent transcription of three of the paper's Table 1 rows (success / progress).
PAPER_TABLE1 = {
    "paper: GPT-4o": ["66.4 / 79.9", "48.2 / 64.1", "40.0 / 76.9", "61.7 / 69.8", "10.0 / 34.0"],
    "paper: AgentGym (8B)": ["61.9* / 76.9*", "47.3* / 61.4*", "18.9* / 47.5*", "1.7 / 16.6", "0.0 / 12.9"],
    "paper: AgentRefine (8B)": ["44.8 / 63.8", "37.5 / 50.4", "14.4 / 42.6", "16.6 / 37.8", "10.0 / 32.3"],
}


def test_paper_rows_add_the_published_rows_labelled(runs, tmp_path, capsys):
    assert main(["report", str(runs["oracle"]), "--out", str(tmp_path), "--paper-rows", "-q"]) == 0
    md = capsys.readouterr().out
    t1 = tables(md)["Table 1: success / progress per task"]
    assert t1["model"] == ["ALFWorld", "BabyAI", "SciWorld", "PDDL", "Jericho", "held-out"]
    assert t1["oracle"] == ["–", "100.0 / 100.0", "–", "100.0 / 100.0", "–", "100.0 / 100.0"]
    for label, cells in PAPER_TABLE1.items():
        assert t1[label] == [*cells, "–"]
    assert "not results of this project" in md
    if PAPER_MD.is_file():  # every Table 1 row of the workspace's fact sheet, cell by cell
        text = PAPER_MD.read_text()
        block = text[text.index("## Table 1") : text.index("## Table 2")]
        for line in block.splitlines()[3:]:
            if line.startswith("| "):
                cells = [c.strip() for c in line.strip("|").split("|")]
                star = lambda c: c if c != "-" else None  # noqa: E731
                pairs = [(star(cells[i]), star(cells[i + 1])) for i in range(1, 11, 2)]
                want = ["–" if a is None else f"{a} / {b}" for a, b in pairs]
                assert t1[f"paper: {cells[0]}"][:5] == want, cells[0]
    t = tables(md)
    assert t["Table 2: ablations"]["paper: w/o refinement data"][1] == "30.4 / 43.1"
    assert t["ALFWorld"]["paper: AgentRefine"][-2:] == ["48.5 / 65.2", "3.73 / 3.56"]
    assert t["Table 4: single sample vs Best-of-N"]["paper: AgentRefine BoN"][0] == "93.3 / 96.6"
    assert t["Figure 8: HotpotQA exact match / F1 (%)"]["paper: AgentRefine"] == ["37.0", "44.6"]


def test_sweep_and_ablations_from_checkpoint_configs_and_settings(runs, tmp_path, capsys):
    """A tiny checkpoint's training config (read from its meta) and --setting for policy runs."""
    from flax import nnx

    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.config import Config, DataConfig
    from agentrefine_jax.models import llama
    from agentrefine_jax.models.config import preset

    cfg = preset("tiny")
    ckpt, out = tmp_path / "noref", tmp_path / "noref.json"
    config = Config(data=DataConfig(general_ratio=0.5, loss_on=("correct",)))
    save_model(ckpt, nnx.jit(lambda: llama.create(cfg, 0))(), cfg, step=1, tokenizer="llama3", config=config)
    argv = ["--checkpoint", str(ckpt), "--template", "llama3", "--tasks", "pddl", "--episodes", "1"]
    assert eval_main([*argv, "--max-steps", "1", "--max-new-tokens", "4", "--out", str(out), "-q"]) == 0
    capsys.readouterr()
    rep = tmp_path / "rep"
    settings = [
        "oracle:data.general_ratio=0.25",
        'oracle:data.loss_on=["correct", "refinement"]',
        "random:data.general_ratio=1",
    ]
    argv = ["report", f"noref={out}", str(runs["oracle"]), f"random={runs['random_pert']}", "--out", str(rep)]
    assert main([*argv, *(x for s in settings for x in ("--setting", s)), "-q"]) == 0
    t = tables(capsys.readouterr().out)
    # noref's setting comes from its checkpoint; random's training config is unknown: not a Table 2 row
    assert set(t["Table 2: ablations"]) == {"setting", "w/o refinement loss (noref)", "AgentRefine (oracle)"}
    sweep = t["Figure 11: held-out score vs `data.general_ratio`"]
    oracle = json.loads(runs["oracle"].read_text())["variants"]["original"]
    random = json.loads(runs["random_pert"].read_text())["variants"]["original"]
    assert sweep["0.25"] == held_out(oracle).split(" / ") and sweep["1"] == held_out(random).split(" / ")
    assert sweep["0.5"] == ["0.0", "0.0"]  # random tiny weights
    with Image.open(rep / "figure11_general_ratio.png") as im:
        assert im.size == SIZES["sweep"]


def test_agentboard_best_of_n_and_hotpotqa_results(tmp_path, capsys):
    """AgentBoard's source (greedy, Best-of-3 and Δ recorded by eval) and HotpotQA's EM/F1 (Figure 8)."""
    from agentboard_fixture import make_checkout

    checkout = make_checkout(tmp_path / "AgentBoard")
    ab, hq = tmp_path / "ab.json", tmp_path / "hq.json"
    argv = ["--agentboard-dir", str(checkout), "--tasks", "pddl", "--policy", "random", "--episodes", "3"]
    assert (
        eval_main(
            [*argv, "--best-of", "3", "--temperature", "1.0", "--name", "ab-random", "--out", str(ab), "-q"]
        )
        == 0
    )
    fixture = pathlib.Path(__file__).parent / "data" / "hotpotqa_fixture.json"
    argv = ["--tasks", "hotpotqa", "--task-option", f"hotpotqa.data={fixture}", "--policy", "oracle"]
    assert eval_main([*argv, "--episodes", "6", "--out", str(hq), "-q"]) == 0
    capsys.readouterr()
    assert main(["report", str(ab), str(hq), "--out", str(tmp_path / "rep"), "-q"]) == 0
    t = tables(capsys.readouterr().out)
    doc = json.loads(ab.read_text())
    bon = doc["best_of"]["tasks"]["pddl"]
    t4 = t["Table 4: single sample vs Best-of-N"]
    assert t4["model"] == ["PDDL"]  # the label is the run's --name
    assert t4["ab-random greedy"] == [sp(bon["greedy"]["success_rate"], bon["greedy"]["progress_rate"])]
    assert t4["ab-random Best-of-3"] == [sp(bon["best_of"]["success_rate"], bon["best_of"]["progress_rate"])]
    assert t4["ab-random Δ"] == [sp(bon["delta"]["success_rate"], bon["delta"]["progress_rate"])]
    pddl = doc["tasks"]["pddl"]
    assert t["Table 1: success / progress per task"]["ab-random"] == [
        sp(pddl["success_rate"], pddl["progress_rate"]),
        "–",
    ]
    metrics = json.loads(hq.read_text())["variants"]["original"]["tasks"]["hotpotqa"]
    assert t["Figure 8: HotpotQA exact match / F1 (%)"]["hq"] == [
        pct(metrics["success_rate"]),
        pct(metrics["progress_rate"]),
    ]
    assert t["Figure 8: HotpotQA exact match / F1 (%)"]["hq"] == ["100.0", "100.0"]  # the oracle
    assert "hq" not in t["Table 1: success / progress per task"]


def test_bad_inputs_are_one_line_and_exit_2(runs, tmp_path, capsys):
    verify_report = tmp_path / "verify.jsonl"
    verify_report.write_text('{"id": "a", "ok": true, "turns": []}\n{"id": "b", "ok": false, "turns": []}\n')
    diversity = tmp_path / "diversity.json"
    diversity.write_text(json.dumps({"embedding": "tfidf", "sources": {}}))
    cases = [
        ([str(diversity)], "not an eval result"),
        ([str(verify_report)], "not a JSON document"),
        ([str(tmp_path / "missing.json")], "no such file"),
        ([str(runs["oracle"]), f"oracle={runs['random_pert']}"], "two results are labelled 'oracle'"),
        ([str(runs["oracle"]), "--setting", "nobody:data.train_size=8"], "no result has that label"),
    ]
    for argv, message in cases:
        assert main(["report", *argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[analyze] error:") and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_table3_summary_reproduces_the_papers_averages():
    """The paper's Table 3 averages are means over the original and the five perturbations (all rows);
    population std over the same six values gives the cells below (others it does not: see docs)."""
    from agentrefine_jax.analyze import paper
    from agentrefine_jax.analyze.tables import paper_style_summary

    for row in paper.TABLE3:
        for k in (0, 1):
            mean, std = paper_style_summary([v[k] / 100 for v in (row.original, *row.perturbations)])
            assert round(100 * mean, 1) == row.average[k], (row.model, k)
            if (row.model, k) in (("AgentRefine", 0), ("LLaMA3-8B-Instruct", 1)):
                assert round(100 * std, 2) == row.std[k], (row.model, k)


def test_ablation_names_carry_the_training_objective():
    from agentrefine_jax.analyze.tables import ablation_name

    sft = {"data.loss_on": ["correct", "refinement"], "data.drop_refinement_data": False}
    assert ablation_name(sft) == ablation_name({**sft, "train.objective": "sft"}) == "AgentRefine"
    assert ablation_name({**sft, "train.objective": "sft+dpo"}) == "AgentRefine + DPO"
    assert ablation_name({**sft, "train.objective": "orpo"}) == "AgentRefine (ORPO)"
    dpo = {"data.loss_on": ["correct"], "train.objective": "dpo"}
    assert ablation_name(dpo) == "w/o refinement loss (DPO only)"
    assert ablation_name({"train.objective": "dpo"}) is None  # no data settings recorded
