"""The identity an evaluation binds its journal to, for a Hugging Face directory: its content, not its files'
modification times. The miniature's record (benchmarks/mini_paper.py --record) carried a journal of 96 base
episodes to a new machine, where the base was converted again from the same GGUF file: same bytes, new
mtimes, and the journal was refused as "another model" (parameters 64855dbd4264 vs cdc31eb1c96d)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from agentrefine_jax.eval import model_identity
from agentrefine_jax.eval.model_identity import checkpoint_identity, resumable


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": rng.normal(size=(256, 512)).astype(np.float32)
        for i in range(8)
    }


def _hf_dir(path: pathlib.Path, tensors: dict[str, np.ndarray], hidden: int = 512) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(params=["whole", "sampled"])
def mode(request, monkeypatch) -> str:
    """Files hashed whole, or (over the threshold, lowered here from 64 MiB) by their sampled blocks."""
    if request.param == "sampled":
        monkeypatch.setattr(model_identity, "WHOLE_FILE_BYTES", 1 << 20)
        monkeypatch.setattr(model_identity, "EDGE_BYTES", 64 << 10)
        monkeypatch.setattr(model_identity, "SAMPLE_BYTES", 4 << 10)
    return request.param


def test_the_same_model_written_again_is_the_same_identity(tmp_path, mode):
    tensors = _tensors()
    d = _hf_dir(tmp_path / "base", tensors)
    assert os.path.getsize(d / "model.safetensors") > (1 << 20)  # the sampled mode samples it
    first = checkpoint_identity(str(d))
    # Converted again (new files, new mtimes), as a new machine restoring a record does.
    shutil.rmtree(d)
    _hf_dir(d, tensors)
    os.utime(d / "model.safetensors", ns=(1, 1))
    assert checkpoint_identity(str(d)) == first and resumable(first)


def test_another_model_or_config_is_another_identity(tmp_path, mode):
    tensors = _tensors()
    d = _hf_dir(tmp_path / "base", tensors)
    first = checkpoint_identity(str(d))
    tuned = {k: v + np.float32(1e-3) for k, v in tensors.items()}  # every weight moved, as training does
    _hf_dir(d, tuned)
    assert checkpoint_identity(str(d))["fingerprint"] != first["fingerprint"] and not resumable(first)
    _hf_dir(d, tensors, hidden=576)  # the same weights under another config
    assert checkpoint_identity(str(d))["fingerprint"] != first["fingerprint"]
    # One tensor of eight changed (a LoRA merged into a few projections): in sampled mode, caught as long
    # as a sampled block falls in it (here 1/8 of the bytes, 256 blocks).
    _hf_dir(d, {**tensors, "model.layers.3.mlp.up_proj.weight": tuned["model.layers.3.mlp.up_proj.weight"]})
    assert checkpoint_identity(str(d))["fingerprint"] != first["fingerprint"]
