"""`analyze diversity` (Figures 6-7) on the shipped demo trajectories and a set whose Thoughts come
from another vocabulary (a laboratory robot), with TF-IDF and with a tiny checkpoint's hidden states."""

from __future__ import annotations

import csv
import json
import pathlib
import random

import numpy as np
import pytest
from PIL import Image

from agentrefine_jax.analyze import diversity as div
from agentrefine_jax.analyze.cli import main
from agentrefine_jax.analyze.embed import ModelEmbedder, tfidf
from agentrefine_jax.analyze.figures import SIZES
from agentrefine_jax.analyze.texts import read_source

DEMO = str(pathlib.Path(__file__).parents[1] / "agentrefine_jax" / "data" / "demo" / "train.jsonl")


def write_lab_source(path: pathlib.Path, rows: int = 40) -> str:
    """ShareGPT-layout rows (the AgentRefine release's layout) of a laboratory robot: Thoughts share
    no content word with the household demo."""
    rng = random.Random(0)
    verbs = ["calibrate", "titrate", "centrifuge", "pipette", "incubate", "measure", "dilute"]
    objs = ["the reagent", "the sample vial", "the buffer solution", "the spectrometer", "the culture plate"]
    whys = ["to verify the concentration", "before the assay starts", "so the enzyme stays active"]
    with path.open("w") as f:
        for i in range(rows):
            conv = [
                {
                    "from": "system",
                    "value": "You are a laboratory robot. Instruments: spectrometer, centrifuge.",
                },
                {"from": "human", "value": f"Protocol {i}: prepare assay {rng.randint(1, 99)}."},
            ]
            for _ in range(rng.randint(2, 4)):
                v, o = rng.choice(verbs), rng.choice(objs)
                conv.append(
                    {"from": "gpt", "value": f"Thought: I {v} {o} {rng.choice(whys)}.\nAction: {v} {o}"}
                )
                conv.append({"from": "human", "value": f"Observation: You {v} {o}."})
            f.write(json.dumps({"id": f"lab-{i}", "conversations": conv}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> str:
    return write_lab_source(tmp_path_factory.mktemp("lab") / "lab.jsonl")


def _separation(vectors_demo, vectors_lab, seed: int = 0) -> tuple[float, float]:
    """(similarity between the two sources, similarity between two random halves of the demo)."""
    perm = np.random.default_rng(seed).permutation(vectors_demo.shape[0])
    half = len(perm) // 2
    a, b = vectors_demo[np.sort(perm[:half])], vectors_demo[np.sort(perm[half:])]
    return div.mean_similarity(vectors_demo, vectors_lab), div.mean_similarity(a, b)


def test_tfidf_separates_different_sources_more_than_halves_of_one(lab):
    demo = read_source("demo", [DEMO], "canonical", max_rows=120, seed=0)
    other = read_source("lab", [lab], "sharegpt", seed=0)
    assert len(other.thoughts) == sum(1 for _ in other.thoughts) > 40 and demo.without_thought == 0
    emb = div.embed_sources([demo, other], tfidf)
    across, halves = _separation(emb.thoughts[0], emb.thoughts[1])
    assert across < 0.5 * halves, (across, halves)
    # The sampled halves agree with each other like the whole source does with itself.
    assert halves == pytest.approx(div.mean_similarity(emb.thoughts[0]), rel=0.1)
    # Pair means from row sums equal the explicit n x n mean.
    x = emb.thoughts[1].toarray()
    sims = x @ x.T
    n = len(x)
    assert div.mean_similarity(emb.thoughts[1]) == pytest.approx(
        (sims.sum() - np.trace(sims)) / (n * (n - 1))
    )
    assert div.diversity(emb.thoughts[1]) == pytest.approx(1 - (sims.sum() - np.trace(sims)) / (n * (n - 1)))


def _run(out: pathlib.Path, lab: str, *extra: str, cap: int = 80) -> dict:
    argv = ["diversity", "--source", f"demo={DEMO}", "--source", f"lab={lab}", "--format", "lab=sharegpt"]
    argv += [
        "--max-rows",
        "60",
        "--max-thoughts",
        str(cap),
        "--threads",
        "1",
        "--seed",
        "3",
        "--out",
        str(out),
    ]
    assert main([*argv, *extra, "-q"]) == 0
    return json.loads((out / "diversity.json").read_text())


def test_cli_writes_csvs_pngs_and_is_repeatable(lab, tmp_path, capsys):
    first = _run(tmp_path / "a", lab)
    stdout = capsys.readouterr().out
    second = _run(tmp_path / "b", lab)
    for name in ("tsne.csv", "environment_similarity.csv", "thought_similarity.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    with (tmp_path / "a" / "tsne.csv").open() as f:
        rows = list(csv.DictReader(f))
    for label in ("demo", "lab"):
        sampled = [r for r in rows if r["source"] == label]
        assert len(sampled) == first["sources"][label]["thoughts"] == 80
        assert all(np.isfinite([float(r["x"]), float(r["y"])]).all() for r in sampled)
        assert len({(r["id"], r["message"]) for r in sampled}) == 80  # every sampled turn, once
        assert f"{label}: {first['sources'][label]['diversity']:.4f}" in stdout
    assert first == second | {"files": first["files"]}
    env = first["environment_similarity"]
    assert env["demo"]["lab"] < min(env["demo"]["demo"], env["lab"]["lab"])
    for name, kind in (("figure6_tsne.png", "tsne"), ("figure7_similarity.png", "heatmap")):
        with Image.open(tmp_path / "a" / name) as im:
            assert im.format == "PNG" and im.size == SIZES[kind]


def test_model_embeddings_from_a_tiny_checkpoint(lab, tmp_path, capsys):
    from flax import nnx

    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.models import llama
    from agentrefine_jax.models.config import preset

    cfg = preset("tiny")
    ckpt = tmp_path / "ckpt"
    save_model(
        ckpt, nnx.jit(lambda: llama.create(cfg, 0))(), cfg, step=0, tokenizer="llama3", template="llama3"
    )
    # The pooled vector of a text is the mean of the model's own final hidden states over its tokens
    # (batched and padded here, one text at a time there). Random weights: no separation asserted.
    embedder = ModelEmbedder(str(ckpt), max_tokens=32, batch_size=4)
    texts = ["I take the towel from the counter.", "I calibrate the spectrometer.", "go"]
    got = embedder(texts)
    for text, row in zip(texts, got, strict=True):
        hidden, _ = embedder.model.forward(np.asarray([embedder.encode(text)], np.int32))
        want = np.asarray(hidden[0]).mean(axis=0)
        np.testing.assert_allclose(row, want / np.linalg.norm(want), atol=2e-5)
    summary = _run(tmp_path / "m", lab, "--model", str(ckpt), "--max-tokens", "32", cap=30)
    assert summary["embedding"].startswith(f"model:{ckpt}")
    assert {k: v["thoughts"] for k, v in summary["sources"].items()} == {"demo": 30, "lab": 30}
    with (tmp_path / "m" / "tsne.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 60
    with Image.open(tmp_path / "m" / "figure6_tsne.png") as im:
        assert im.size == SIZES["tsne"]


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, capsys):
    no_thought = tmp_path / "plain.jsonl"
    rows = [
        {
            "id": str(i),
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go"}],
        }
        for i in range(3)
    ]
    no_thought.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = [
        (["--source", f"plain={no_thought}"], "no assistant turn with a 'Thought:'"),
        (["--source", f"demo={DEMO}", "--format", "other=sharegpt"], "no --source labelled 'other'"),
        (["--source", "nolabel"], "expected LABEL=VALUE"),
    ]
    for argv, message in cases:
        assert main(["diversity", *argv, "--out", str(tmp_path / "o"), "-q"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[analyze] error:") and message in err[0], err
    assert not (tmp_path / "o").exists()
