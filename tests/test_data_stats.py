"""`data stats` at size (issue 44): one pass with progress lines, pair counts as before, --sample.

On a 1 GB JSONL (454k rows) it printed nothing for 10 minutes and needed ~27: it read, parsed and
tokenized the input twice (the second time for the preference-pair counts, re-tokenizing each
pair's prompt pair by pair). Oracles: the pipeline's own two-pass `pair_counts` and `build_data`.
"""

from __future__ import annotations

import json
import re

import pytest

from agentrefine_jax.config import DataConfig
from agentrefine_jax.data import DEMO_TRAIN, cli
from agentrefine_jax.data.pipeline import build_data, build_template, pair_counts
from agentrefine_jax.data.sources import RecordSet

ROWS = 1100  # three read chunks (512 rows each)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    demo = [json.loads(line) for line in DEMO_TRAIN.read_text(encoding="utf-8").splitlines()]
    path = tmp_path_factory.mktemp("stats") / "big.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(ROWS):
            f.write(json.dumps({**demo[i % len(demo)], "id": f"row-{i}"}) + "\n")
    return path


COMMON = ["--template", "mistral", "--max-length", "1024"]


def _stats(path, capsys, *extra: str) -> tuple[int, str, str]:
    code = cli.main(["stats", "-i", str(path), *COMMON, *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_progress_lines_with_rate_and_eta(big, capsys):
    code, _, err = _stats(big, capsys, "--progress-every", "0")
    assert code == 0, err
    progress = re.findall(
        r"stats: ([\d,]+) of 1,100 rows \(\d+%\), ([\d,]+) rows/s, about (\d+ s|\d+ min \d+ s) left", err
    )
    assert [p[0] for p in progress] == ["512", "1,024"], err
    assert all(int(p[1].replace(",", "")) > 0 for p in progress), err
    assert re.search(r"stats: 1,100 rows in \d+ s \([\d,]+ rows/s\)", err), err
    # The default: a line every 30 s (this run is shorter), and the closing rate.
    code, _, err = _stats(big, capsys)
    assert code == 0 and "of 1,100 rows" not in err and "stats: 1,100 rows in" in err, err


def test_one_pass_counts_equal_the_pipeline_s_two_passes(big, capsys):
    code, out, err = _stats(big, capsys, "--json")
    assert code == 0, err
    stats = json.loads(out)
    cfg = DataConfig(train_files=(str(big),), tokenizer="mistral", template="mistral", max_length=1024)
    expected_pairs = pair_counts(cfg, build_template(cfg), RecordSet(cfg.train_files))
    assert expected_pairs.pairs > 0 and expected_pairs.prompts_shortened > 0  # both paths run
    assert stats["preference"] == json.loads(json.dumps(expected_pairs.to_dict()))
    report = build_data(cfg, "train").report
    assert stats["tokens"] == report.tokens and stats["loss_tokens"] == report.loss_tokens
    assert stats["length_percentiles"] == report.length_percentiles()
    assert stats["examples"] == report.examples == ROWS and "sample" not in stats


def test_sample_is_stated_and_reproducible(big, capsys):
    code, out, err = _stats(big, capsys, "--sample", "100", "--json")
    assert code == 0, err
    stats = json.loads(out)
    assert stats["sample"] == {"records": 100, "of": ROWS, "seed": 0}
    assert stats["records_total"] == 100 and stats["examples"] == 100
    assert "a sample of 100 of 1100 records" in stats["sources"]
    code, again, _ = _stats(big, capsys, "--sample", "100", "--json")
    assert json.loads(again) == stats  # seeded: the same rows
    code, other, _ = _stats(big, capsys, "--sample", "100", "--seed", "1", "--json")
    assert json.loads(other)["tokens"] != stats["tokens"]
    code, text, _ = _stats(big, capsys, "--sample", "100")
    assert text.startswith("SAMPLE: 100 of 1100 records (uniform, --seed 0)"), text
    code, _, err = _stats(big, capsys, "--sample", "0")
    assert code == 2 and err.strip() == "[data] error: --sample must be >= 1, got 0", err
