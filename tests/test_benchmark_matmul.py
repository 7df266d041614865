"""benchmarks/matmul.py end to end at toy widths: both stacks' workers start, alternate, and report every
product of a layer's training step; each stack's products agree with float64 (the printed error is a
real comparison, not a placeholder)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_matmul_benchmark_reports_every_product_of_both_stacks():
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "matmul.py"),
        "--rows",
        "16",
        "--hidden",
        "32",
        "--kv",
        "8",
    ]
    cmd += ["--mlp", "48", "--reps", "1", "--rounds", "2", "--threads", "1", "--json"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.splitlines()[-1])
    products = doc["per_product_last_round"]
    assert len(products) == 21 and {p.split(".")[1] for p in products} == {"fwd", "dx", "dw"}
    assert all(v["xla"] > 0 and v["torch"] > 0 for v in products.values())
    assert doc["rounds"] == 2 and doc["ratio"]["xla"]["min"] > 0
    assert doc["max_rel_error"]["xla"] < 1e-5 and doc["max_rel_error"]["torch"] < 1e-5
    assert doc["setting"]["rows"] == 16 and doc["machine"]["cpu_model"]
    assert "[matmul] round 2/2" in r.stderr
