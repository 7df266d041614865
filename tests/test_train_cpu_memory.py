"""Peak host memory of a real-model training run on CPU: the README demo's recipe (SmolLM2-135M,
full fine-tuning in float32, 2 x 512 tokens), two steps with a checkpoint after each, in a trainer
process of its own on one CPU device: the second step runs beside the state the first save handed
Orbax (train/save_strategy.py), as every step after a save does in a longer run.

Parameters, AdamW moments and the save's spare state are 4 x 0.54 GB; the step's temporaries were
4.2 GiB more when the CPU layout unrolled the layers without remat (peak RSS 8.1 GB, measured
2026-11-28), 1.4 GiB with remat `full` over the scanned layers (4.8 GB). The bound sits between the
two with a margin either way; RSS does not depend on the machine's load. docs/scale.md, "CPU memory
of a real model".
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

# A fresh parent whose only child is the trainer: RUSAGE_CHILDREN's ru_maxrss is then the trainer's
# peak (in the test process it would be the largest of every test's children so far).
PEAK_OF_CHILD = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(rc)\n"
)
BOUND_BYTES = 6.5e9


def test_demo_step_peak_rss_is_bounded(smollm2_gguf: pathlib.Path, smollm2_dir: pathlib.Path, tmp_path):
    del smollm2_dir  # converted once per session: the trainer finds it in the GGUF cache
    sets = [
        f"train.init_from_gguf={smollm2_gguf}",
        f"train.run_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "train.checkpoint_every=1",
        "train.eval_every=0",
        "train.export_hf_at_end=null",
    ]
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "demo"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, as the demo runs (the suite forces 8)
    r = subprocess.run(
        [sys.executable, "-c", PEAK_OF_CHILD, *cmd], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2/2" in r.stderr + r.stdout
    peak = int(r.stdout.split("peak_rss_kib")[-1].split()[0]) * 1024
    print(f"trainer peak RSS {peak / 1e9:.2f} GB")
    assert peak < BOUND_BYTES, f"trainer peak RSS {peak / 1e9:.2f} GB >= {BOUND_BYTES / 1e9:.1f} GB"
