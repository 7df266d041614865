"""Finished work survives a failed write (issue 32, item 2): real CLI processes, real files.

* a legal 250-byte output file name works (`data dump --out`, `eval --out`): the temporary
  sibling's name is bounded (it was `[Errno 36] File name too long`, after the work);
* a disk that is full when the results are written (a real small tmpfs: ENOSPC) ends in one
  line, exit 1, naming the file and the rescue file under $TMPDIR that holds the complete
  results (it was a traceback with the results gone); `export to-hf` on a full disk: one line,
  exit 1, no partial directory left (a traceback before);
* `export to-hf` whose disk fills while the tokenizer is saved, after the weights (issue 44: a
  traceback `Exception: No space left on device`, nothing kept): one line, exit 1, the whole
  export written again under $TMPDIR and named, and under `--overwrite` the earlier export left
  byte for byte.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from faults_disk import env, one_line, run, small_disk, snapshot
from test_eval_checkpoint import save_random_checkpoint

from agentrefine_jax.models.config import preset

DEMO_TRAIN = pathlib.Path(__file__).parents[1] / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
ORACLE = ("--policy", "oracle", "--tasks", "babyai", "--episodes", "1")
LONG = "r" * 245 + ".json"  # 250 bytes: the longest name most filesystems allow is 255


def _rescued(line: str) -> pathlib.Path:
    kept = pathlib.Path(line.split("kept in ", 1)[1].strip())
    assert kept.is_file(), line
    return kept


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> pathlib.Path:
    """The demo's first 40 rows (a quick input)."""
    path = tmp_path_factory.mktemp("rows") / "train.jsonl"
    path.write_text("".join(DEMO_TRAIN.read_text().splitlines(keepends=True)[:40]))
    return path


def _dump_args(rows: pathlib.Path, out: pathlib.Path) -> list[str]:
    return ["dump", "--input", str(rows), "--no-pack", "--out", str(out)]


def test_data_dump_to_a_250_byte_name_and_to_a_full_disk(tmp_path, rows):
    long = tmp_path / LONG
    res = run("data", *_dump_args(rows, long))
    assert res.returncode == 0, res.stderr
    dumped = long.read_bytes()
    assert dumped.count(b"\n") == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [LONG]  # no temporary sibling left
    with small_disk(f"{len(dumped) // 2}") as disk:
        out = disk / "rows.jsonl"
        line = one_line(run("data", *_dump_args(rows, out)), "data", 1, str(out), "No space left on device")
        assert _rescued(line).read_bytes() == dumped  # every row, not just what fitted
        assert list(disk.iterdir()) == []  # the abandoned temporary sibling is gone


def test_eval_out_to_a_250_byte_name_and_to_a_full_disk(tmp_path):
    long = tmp_path / LONG
    res = run("eval", *ORACLE, "--out", str(long))
    assert res.returncode == 0, res.stderr
    doc = json.loads(long.read_text())
    assert doc["episodes"] and sorted(p.name for p in tmp_path.iterdir()) == [LONG]
    with small_disk("4k") as disk:
        out = disk / "results.json"
        line = one_line(
            run("eval", *ORACLE, "--out", str(out)), "eval", 1, str(out), "No space left on device"
        )
        kept = json.loads(_rescued(line).read_text())
        assert len(kept["episodes"]) == len(doc["episodes"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("ckpt") / "run"
    return pathlib.Path(save_random_checkpoint(root, preset("tiny", max_position_embeddings=256), seed=0))


def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(checkpoint):
    with small_disk("1m") as disk:
        out = disk / "hf"
        res = run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out), env=env())
        one_line(res, "export", 1, "No space left on device")
        assert list(disk.iterdir()) == []


def _rescued_dir(line: str) -> pathlib.Path:
    kept = pathlib.Path(line.split("kept in ", 1)[1].strip())
    assert kept.is_dir(), line
    return kept


def test_export_whose_tokenizer_meets_a_full_disk_is_rescued_whole(checkpoint, tmp_path):
    """The tiny model's weights are 33 MB, the llama3 tokenizer's files 17 MB: a 40 MB disk holds
    the weights and fills while the tokenizer is saved (the Rust writer's bare Exception)."""
    reference = tmp_path / "reference"
    done = run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(reference))
    assert done.returncode == 0, done.stderr
    whole = snapshot(reference)
    assert "tokenizer.json" in whole and "model.safetensors" in whole
    with small_disk("40m") as disk:
        out = disk / "hf"
        res = run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out))
        line = one_line(res, "export", 1, str(out), "No space left on device", "kept in ")
        assert list(disk.iterdir()) == []  # no partial directory
        assert snapshot(_rescued_dir(line)) == whole  # every file, as a plain export writes them
    # An earlier export on a disk with room for it, but not for a second one beside it.
    with small_disk("90m") as disk:
        out = disk / "hf"
        first = run("export", "to-hf", "--checkpoint", str(checkpoint), "--out", str(out))
        assert first.returncode == 0, first.stderr
        before = snapshot(out)
        args = ("to-hf", "--checkpoint", str(checkpoint), "--out", str(out), "--overwrite")
        line = one_line(run("export", *args), "export", 1, str(out), "No space left on device")
        assert snapshot(out) == before and [p.name for p in disk.iterdir()] == ["hf"]
        assert snapshot(_rescued_dir(line)) == whole
