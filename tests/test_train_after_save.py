"""The trainer's step after a checkpoint save on a CPU backend writes its new state into the
buffers of the save before (the `SpareBufferSaves` strategy + `StepFns.train_into`) instead of
copying the state for Orbax: the run must train exactly as one that never does (losses and
every saved array bit-equal), full fine-tuning and LoRA alike. Real trainer, real Orbax."""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from agentrefine_jax.config import load_config
from agentrefine_jax.train import save_strategy
from agentrefine_jax.train.loop import train

STEPS = 3  # saves at 1, 2, 3: step 2 writes into fresh spares, step 3 into a save's handed arrays
SETTINGS = [
    "data.max_length=256",
    "train.global_batch_size=2",
    "mesh.fsdp=2",
    "mesh.tensor=4",
    f"train.max_steps={STEPS}",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=5",
    "train.eval_every=0",
    "train.export_hf_at_end=none",
]
LORA = ["train.lora.rank=4", "train.lora.targets=q,v", "train.lora.dropout=0.1"]


def _saved(run_dir, step: int) -> list[np.ndarray]:
    """Every stored array of the step (params, then opt_state), as plain Orbax reads them."""
    with ocp.StandardCheckpointer() as c:
        items = [c.restore(run_dir / "checkpoints" / str(step) / item) for item in ("params", "opt_state")]
    return [np.asarray(x) for x in jax.tree.leaves(items)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_steps_after_saves_write_into_spare_buffers_and_train_the_same(tmp_path, monkeypatch, lora) -> None:
    offered: list[bool] = []
    real = save_strategy.SpareBufferSaves.step_buffers

    def counting(self):  # the real method; only counts what it offers
        spare = real(self)
        offered.append(spare is not None)
        return spare

    monkeypatch.setattr(save_strategy.SpareBufferSaves, "step_buffers", counting)
    runs = {}
    for name, min_bytes in (("spares", 0), ("plain", 1 << 62)):
        monkeypatch.setattr(save_strategy, "SPARE_MIN_BYTES", min_bytes)
        offered.clear()
        run_dir = tmp_path / name
        cfg = load_config("tiny", [*SETTINGS, *(LORA if lora else []), f"train.run_dir={run_dir}"])
        summary = train(cfg)
        runs[name] = {
            "losses": summary["losses"],
            "offered": sum(offered),
            "saved": {s: _saved(run_dir, s) for s in range(1, STEPS + 1)},
        }
    # A save at every step: each step after one (all but the last) wrote into offered buffers.
    assert runs["spares"]["offered"] == STEPS - 1 and runs["plain"]["offered"] == 0
    assert len(runs["spares"]["losses"]) == STEPS
    assert runs["spares"]["losses"] == runs["plain"]["losses"]
    for s in range(1, STEPS + 1):
        for a, b in zip(runs["spares"]["saved"][s], runs["plain"]["saved"][s], strict=True):
            np.testing.assert_array_equal(a, b)
