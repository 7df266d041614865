"""The paper's data studies as data settings: a deterministic training-set size (its
8k/16k/32k/64k study) and general chat data mixed in at a ratio (its ShareGPT study)."""

import dataclasses
import json

import pytest

from agentrefine_jax.config import DataConfig, load_config
from agentrefine_jax.data import DEMO_TRAIN
from agentrefine_jax.data.pipeline import DataError, build_data, make_pipeline

N_ROWS = 60


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sel")
    agent = d / "agent.jsonl"
    lines = DEMO_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:N_ROWS]
    lines.insert(5, "{broken\n")  # a bad row inside the permutation: selection counts valid examples
    agent.write_text("".join(lines))
    general = d / "sharegpt.jsonl"
    rows = [
        {
            "id": f"chat{i}",
            "conversations": [
                {"from": "human", "value": f"Write a haiku about the number {i}."},
                {
                    "from": "gpt",
                    "value": f"Number {i} hums softly / in a quiet list of rows / padding never comes",
                },
            ],
        }
        for i in range(30)
    ]
    general.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(agent), str(general)


def _cfg(files, **kw):
    agent, general = files
    base = DataConfig(train_files=(agent,), template="mistral", tokenizer="mistral", max_length=1024, seed=1)
    return dataclasses.replace(base, **kw)


def _sources(data):
    return [w.rsplit(":", 1)[0].rsplit("/", 1)[1] + ":" + w.rsplit(":", 1)[1] for w in data.store.where]


def test_train_size_takes_the_first_valid_examples_of_a_seeded_permutation(files):
    small = build_data(_cfg(files, train_size=8), "train")
    big = build_data(_cfg(files, train_size=16), "train")
    again = build_data(_cfg(files, train_size=8), "train")
    other = build_data(_cfg(files, train_size=8, seed=2), "train")
    assert len(small.store) == 8 and len(big.store) == 16
    assert small.store.where == again.store.where  # deterministic
    assert big.store.where[:8] == small.store.where  # nested: 8 of the 16 are the 8-run's
    assert other.store.where != small.store.where  # the seed picks
    everything = build_data(_cfg(files, max_skip_fraction=1.0), "train")
    assert len(everything.store) == N_ROWS  # the broken row is skipped, N_ROWS valid
    assert small.store.where != everything.store.where[:8]  # a permutation, not the file's head
    assert "train_size: the first 8 valid examples" in small.report.summary()
    # Exactly the records read are reported (tokens of unread records are not counted).
    assert small.report.examples == 8 and small.report.records_in_shard - small.report.skipped_total == 8


def test_train_size_larger_than_the_data_is_a_clear_error(files):
    with pytest.raises(DataError, match=f"train_size=1000 but only {N_ROWS} usable examples"):
        build_data(_cfg(files, train_size=1000), "train")
    # Bad values are refused when the config is loaded, before any data is read.
    with pytest.raises(ValueError, match="data.train_size"):
        load_config("tiny", ["data.train_size=0"])


def test_general_chat_is_mixed_at_the_ratio(files):
    agent, general = files
    mixed = build_data(_cfg(files, train_size=20, general_files=(general,), general_ratio=0.5), "train")
    src = [s.split(":")[0] for s in _sources(mixed)]
    assert src.count("agent.jsonl") == 20 and src.count("sharegpt.jsonl") == 10
    gen = mixed.report.general
    assert gen is not None and gen.examples == 10 and "mixed in (general chat)" in mixed.report.summary()
    # General turns are ordinary correct turns: trained.
    assert gen.trained_turns["correct"] == 10 and gen.loss_tokens > 0
    # The general examples are the first of a seeded permutation, not the file's head.
    picked = [s for s in _sources(mixed) if s.startswith("sharegpt")]
    assert picked != [f"sharegpt.jsonl:{i}" for i in range(1, 11)]
    again = build_data(_cfg(files, train_size=20, general_files=(general,), general_ratio=0.5), "train")
    assert again.store.where == mixed.store.where
    # Every row is packed from both sources together; the eval split gets none of it.
    assert sum(len(r) for r in mixed.rows) == 30
    ev = build_data(_cfg(files, eval_fraction=0.2, general_files=(general,), general_ratio=0.5), "eval")
    assert all("sharegpt" not in w for w in ev.store.where) and ev.report.general is None


def test_general_mix_errors(files):
    agent, general = files
    with pytest.raises(DataError, match="needs 60 general examples; data.general_files has only 30"):
        build_data(_cfg(files, general_files=(general,), general_ratio=1.0), "train")
    with pytest.raises(ValueError, match="general_ratio > 0 needs data.general_files"):
        load_config("tiny", ["data.general_ratio=0.5"])
    with pytest.raises(ValueError, match="data.general_ratio"):
        load_config("tiny", ["data.general_ratio=-1.0"])


def test_knobs_are_config_settings(files):
    agent, general = files
    cfg = load_config(
        "tiny",
        [
            f"data.train_files={agent}",
            "data.train_size=8",
            f"data.general_files={general}",
            "data.general_ratio=0.5",
            "data.template=mistral",
            "data.tokenizer=mistral",
        ],
    )
    assert cfg.data.train_size == 8 and cfg.data.general_ratio == 0.5
    p = make_pipeline(cfg.data, global_batch_size=2, num_epochs=1)
    assert len(p.store) == 12 and p.report.general.examples == 4
