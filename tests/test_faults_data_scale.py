"""Data at any size (issue 32, item 5): the data CLIs and the training pipeline's index building stream
their input, so memory grows with the rows handled at once, not with the file.

Measured on real child processes (`os.wait4` gives each child's own peak RSS) on a generated ~120 MB JSONL
of rows whose bytes are mostly a field the schema ignores (so tokenizing stays quick): the peak RSS on the
big file minus the peak on a 200-row file of the same rows must stay under a fraction of the file's size
(reading the file whole costs at least its size; parsing it whole, several times that). The file is
written to a temporary directory and removed after the module. The file-backed token store (used past
`SPILL_BYTES`) is checked to give exactly the in-memory store's examples, rows and CLI output.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from agentrefine_jax.config import DataConfig
from agentrefine_jax.data import examples
from agentrefine_jax.data.examples import FileArray
from agentrefine_jax.data.pipeline import build_data, make_pipeline
from agentrefine_jax.data.sources import RecordSet

DEMO = pathlib.Path(__file__).resolve().parents[1] / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
BIG_MB = 120
PAD = 10_000  # bytes of ignored text per row
GROWTH_FRACTION = 0.3  # of the file size: reading it whole alone is 1.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    big, small = d / "big.jsonl", d / "small.jsonl"
    pad = "x" * PAD
    n = BIG_MB * 1_000_000 // (PAD + 150)
    with open(big, "w") as f, open(small, "w") as g:
        for i in range(n):
            row = {
                "id": f"row-{i}",
                "meta": pad,  # not a schema field: read and parsed, then ignored
                "messages": [
                    {"role": "user", "content": f"Task {i}: open the box."},
                    {"role": "assistant", "content": f"Thought: step {i % 97}.\nAction: open box"},
                ],
            }
            line = json.dumps(row) + "\n"
            f.write(line)
            if i < 200:
                g.write(line)
    yield big, small, n
    big.unlink()  # ~120 MB: not left for the session's end


def _peak_rss_mb(args: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(peak RSS in MB, wall seconds, stderr) of `python -m agentrefine_jax.data ARGS` or `python -c`."""
    with (
        open(os.devnull, "w") as out,
        open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "scale_err"), "w+") as err,
    ):
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        err.seek(0)
        text = err.read()
    assert proc.returncode == 0, text[-3000:]
    return usage.ru_maxrss / 1024, wall, text  # ru_maxrss is in KiB on Linux


def _growth(files, make_args) -> tuple[float, float]:
    big, small, _ = files
    rss_small, _, _ = _peak_rss_mb(make_args(small))
    rss_big, wall, _ = _peak_rss_mb(make_args(big))
    return rss_big - rss_small, wall


def _assert_bounded(files, growth: float, what: str) -> None:
    size_mb = files[0].stat().st_size / 1e6
    assert growth < GROWTH_FRACTION * size_mb, f"{what}: RSS grew {growth:.0f} MB for a {size_mb:.0f} MB file"


def test_show_row_reads_one_row(files):
    big, small, n = files
    rss_small, _, _ = _peak_rss_mb(_show(small, 199))
    rss_big, wall, _ = _peak_rss_mb(_show(big, n - 1))  # the last row: no reading up to it
    _assert_bounded(files, rss_big - rss_small, "show --row")
    assert wall < 90, f"show --row {n - 1} took {wall:.0f} s"  # start-up dominates; generous for a busy box


def test_index_memory_does_not_follow_the_file(files):
    """What `show` pays before its tokenizer loads (which masks it in the peak RSS above): the line index
    is built in blocks, so Python's allocations (numpy's included) peak far below the file's size."""
    big, _, n = files
    tracemalloc.start()
    try:
        records = RecordSet([str(big)])
        ((where, row),) = records.read([n - 1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(records) == n and row["id"] == f"row-{n - 1}" and where.endswith(f":{n}")
    assert peak < 0.25 * big.stat().st_size, f"indexing peaked at {peak / 1e6:.0f} MB"


def _show(path: pathlib.Path, row: int) -> list[str]:
    return ["-m", "agentrefine_jax.data", "show", "-i", str(path), "--row", str(row), "--color", "never"]


def test_stats_streams(files):
    growth, _ = _growth(
        files, lambda p: ["-m", "agentrefine_jax.data", "stats", "-i", str(p), "--max-length", "256"]
    )
    _assert_bounded(files, growth, "stats")


def test_dump_streams(files, tmp_path):
    out = tmp_path / "dump.jsonl"
    growth, _ = _growth(
        files,
        lambda p: [
            "-m",
            "agentrefine_jax.data",
            "dump",
            "-i",
            str(p),
            "--max-length",
            "256",
            "--out",
            str(out),
        ],
    )
    _assert_bounded(files, growth, "dump")
    assert sum(1 for _ in open(out)) > 0


_PIPELINE = """
import sys
from agentrefine_jax.config import DataConfig
from agentrefine_jax.data.pipeline import make_pipeline
cfg = DataConfig(train_files=(sys.argv[1],), max_length=256, train_size=None)
pipe = make_pipeline(cfg, global_batch_size=8, num_epochs=1)
batch = next(iter(pipe))
print(pipe.steps_per_epoch, batch["input_ids"].shape)
"""


def test_training_index_streams(files):
    growth, _ = _growth(files, lambda p: ["-c", _PIPELINE, str(p)])
    _assert_bounded(files, growth, "make_pipeline")


# ------------------------------------------------------------------ file-backed token store: same data


def test_spilled_store_is_the_in_memory_store(monkeypatch):
    cfg = DataConfig(
        train_files=(str(DEMO),),
        max_length=1024,
        train_size=64,
        general_files=(str(DEMO),),
        general_ratio=0.5,
    )
    memory = build_data(cfg, "train")
    monkeypatch.setattr(examples, "SPILL_BYTES", 0)
    spilled = build_data(cfg, "train")
    assert isinstance(spilled.store.ids, FileArray) and isinstance(memory.store.ids, np.ndarray)
    assert spilled.rows == memory.rows and spilled.store.where == memory.store.where
    assert np.array_equal(spilled.store.offsets, memory.store.offsets)
    for i in range(len(memory.store)):
        a, b = memory.store.example(i), spilled.store.example(i)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # Grain worker processes get the file-backed store by pickling (reopened through /proc)
    pipe_cfg = dataclasses.replace(cfg, num_workers=1)
    spilled_batches = list(itertools.islice(make_pipeline(pipe_cfg, global_batch_size=4, num_epochs=1), 3))
    monkeypatch.setattr(examples, "SPILL_BYTES", 1 << 40)
    memory_batches = list(itertools.islice(make_pipeline(cfg, global_batch_size=4, num_epochs=1), 3))
    for x, y in zip(spilled_batches, memory_batches, strict=True):
        assert all(np.array_equal(x[k], y[k]) for k in y)


def test_spilled_dump_is_byte_identical(tmp_path):
    outs = []
    for spill in ("0", str(1 << 40)):
        out = tmp_path / f"dump_{spill}.jsonl"
        env = dict(os.environ, AGENTREFINE_DATA_SPILL_BYTES=spill)
        _peak_rss_mb(
            [
                "-m",
                "agentrefine_jax.data",
                "dump",
                "-i",
                str(DEMO),
                "--max-length",
                "1024",
                "--out",
                str(out),
            ],
            env,
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0].count(b"\n") > 100
