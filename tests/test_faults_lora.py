"""LoRA resumes and merges are checked: a changed `train.lora` is refused on resume, and the base's
identity (content hash of the init_from_hf weights, or the random base's seed and shapes) recorded
in the checkpoint is checked on resume, `export --merge-lora` and load — other weights of the same
shapes in the init_from_hf directory are refused in one line."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import subprocess
import sys

import pytest
from test_train_loop import FAST, REPO, _env

from agentrefine_jax.checkpoint import LoraBase, load_model, read_meta, shapes_digest, weights_digest


def _cfg(tmp: pathlib.Path, hf_dir: pathlib.Path | None, *extra: str):
    from agentrefine_jax.config import load_config
    from agentrefine_jax.hf.io import read_hf_config

    cfg = load_config(
        "tiny",
        [
            *FAST[1::2],
            "train.max_steps=2",
            "mesh.fsdp=2",
            "mesh.tensor=4",
            f"train.run_dir={tmp / 'run'}",
            "train.export_hf_at_end=none",
            "train.lora.rank=4",
            # The directory has no tokenizer files (Llama-3's vocabulary): named, never implied.
            *([f"train.init_from_hf={hf_dir}", "data.tokenizer=llama3"] if hf_dir else []),
            *extra,
        ],
    )
    if hf_dir:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(read_hf_config(hf_dir), dtype="float32"))
    return cfg


@pytest.fixture(scope="module")
def hf_lora_run(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """A 2-step LoRA run on an HF base (in-process trainer); returns (tmp, hf_dir)."""
    from hf_fixtures import TINY_LLAMA3, make_checkpoint

    from agentrefine_jax.train.loop import train

    tmp = tmp_path_factory.mktemp("lora_base")
    hf_dir = make_checkpoint(tmp / "hf", "llama", seed=0, **TINY_LLAMA3)
    assert train(_cfg(tmp, hf_dir))["step"] == 2
    return tmp, hf_dir


def test_changed_lora_settings_are_refused_on_resume(hf_lora_run):
    from agentrefine_jax.train.loop import TrainingInputError, train

    tmp, hf_dir = hf_lora_run
    for change in ("train.lora.alpha=32", "train.lora.dropout=0.2", "train.lora.base_dtype=float32"):
        cfg = _cfg(tmp, hf_dir, change, "train.max_steps=3", "train.allow_schedule_change=true")
        with pytest.raises(TrainingInputError, match=r"different configuration \(train\.lora changed\)"):
            train(cfg)


def test_other_weights_of_the_same_shapes_are_refused_on_resume_merge_and_load(hf_lora_run, tmp_path):
    from hf_fixtures import TINY_LLAMA3, make_checkpoint

    from agentrefine_jax.train.loop import TrainingInputError, train

    tmp, hf_dir = hf_lora_run
    meta = read_meta(tmp / "run" / "checkpoints", 2)
    assert meta.lora.base == LoraBase(init_from_hf=str(hf_dir), sha256=weights_digest(hf_dir))
    original = tmp_path / "original"
    shutil.copytree(hf_dir, original)
    try:
        make_checkpoint(tmp_path / "other", "llama", seed=1, **TINY_LLAMA3)
        for f in hf_dir.glob("*.safetensors"):
            f.unlink()
        for f in (tmp_path / "other").glob("*.safetensors"):
            shutil.copy(f, hf_dir / f.name)
        assert weights_digest(hf_dir) != meta.lora.base.sha256
        # Resume.
        cfg = _cfg(tmp, hf_dir, "train.max_steps=3", "train.allow_schedule_change=true")
        with pytest.raises(TrainingInputError, match="holds other weights than the adapters were trained on"):
            train(cfg)
        # Load (what generate, serve and eval go through).
        with pytest.raises(ValueError, match="holds other weights than the adapters were trained on"):
            load_model(tmp / "run")
        # export --merge-lora (and the PEFT adapter export): one line, exit 2, nothing written.
        for flags in (["--merge-lora"], []):
            out = tmp_path / f"export{len(flags)}"
            proc = subprocess.run(
                [sys.executable, "-m", "agentrefine_jax.export", "to-hf", "--checkpoint", str(tmp / "run")]
                + ["--out", str(out), *flags],
                cwd=REPO,
                env=_env(out),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 2, proc.stderr
            errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
            assert len(errors) == 1 and errors[0].startswith("[export] error: "), proc.stderr
            assert "holds other weights than the adapters" in errors[0] and "Traceback" not in proc.stderr
            assert not out.exists()
    finally:  # the module's run dir stays usable for the other test
        for f in hf_dir.glob("*.safetensors"):
            f.unlink()
        for f in original.glob("*.safetensors"):
            shutil.copy(f, hf_dir / f.name)
    load_model(tmp / "run")  # the original base loads again


def test_random_base_identity_is_its_seed_and_shapes(tmp_path):
    from agentrefine_jax.checkpoint import check_lora_base
    from agentrefine_jax.models import preset

    cfg = _cfg(tmp_path, None)
    from agentrefine_jax.checkpoint import lora_reference

    ref = lora_reference(cfg).base
    assert ref == LoraBase(seed=cfg.train.seed, shapes=shapes_digest(cfg.model))
    wider = dataclasses.replace(cfg.model, intermediate_size=cfg.model.intermediate_size * 2)
    with pytest.raises(ValueError, match="other parameter shapes"):
        check_lora_base(ref, LoraBase(shapes=shapes_digest(wider)), what="x")
    check_lora_base(ref, LoraBase(shapes=shapes_digest(preset("tiny"))), what="x")  # the demo's own model


def test_a_run_from_before_the_auto_default_is_told_how_to_resume(tmp_path):
    """A run whose config.json says base_dtype=bfloat16 (the old default) resumed under the new
    default "auto" (float32 here) is refused, and the message says how to resume it as trained."""
    from agentrefine_jax.config import load_config
    from agentrefine_jax.train.run_dir import RunPaths, TrainingInputError, check_resume_config

    paths = RunPaths(tmp_path / "run")
    paths.write_config(load_config("tiny", ["train.lora.rank=4", "train.lora.base_dtype=bfloat16"]))
    now = load_config("tiny", ["train.lora.rank=4"])
    with pytest.raises(
        TrainingInputError, match=r"train\.lora changed.*--set train\.lora\.base_dtype=bfloat16"
    ):
        check_resume_config(paths, now)
    check_resume_config(paths, load_config("tiny", ["train.lora.rank=4", "train.lora.base_dtype=bfloat16"]))
