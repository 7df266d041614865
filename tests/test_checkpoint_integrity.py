"""Checkpoint manifests (sha256 per file, written after Orbax finalises), URL-safe run paths,
resume-aware metrics and the one architecture rule — with real Orbax on disk, no mocks."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest

from agentrefine_jax import checkpoint as ckpt
from agentrefine_jax import paths as url_paths
from agentrefine_jax.models import ModelConfig, RopeScaling, llama, preset
from agentrefine_jax.models.config import Architecture, Execution, Interface

CFG = preset("tiny", vocab_size=256, tie_embeddings=False)


@pytest.fixture(scope="module")
def model() -> llama.Transformer:
    return llama.create(CFG, seed=0)


def _largest_file(step_dir: pathlib.Path, under: str = "params") -> pathlib.Path:
    files = [p for p in (step_dir / under).rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def flip_bit(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _three_steps(tmp_path: pathlib.Path, model: llama.Transformer) -> pathlib.Path:
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        ckpt.save_model(root, model, CFG, step=step)
    return root


def test_every_saved_step_carries_a_manifest_that_verifies(tmp_path, model) -> None:
    step_dir = ckpt.save_model(tmp_path / "ck", model, CFG, step=5)
    manifest = json.loads((step_dir / ckpt.MANIFEST).read_text())["files"]
    assert any(name.startswith("params/") for name in manifest)
    assert all(len(rec["sha256"]) == 64 and rec["size"] > 0 for rec in manifest.values())
    ckpt.verify_step(step_dir)  # no error
    assert ckpt.newest_intact_step(tmp_path / "ck") == (5, [])


@pytest.mark.parametrize(
    ("damage", "word"),
    [(flip_bit, "corrupt"), (truncate, "truncated"), (lambda p: p.unlink(), "incomplete")],
)
def test_damaged_latest_step_is_named_and_skipped(tmp_path, model, damage, word) -> None:
    root = _three_steps(tmp_path, model)
    damage(_largest_file(pathlib.Path(root / "3")))
    with pytest.raises(ckpt.CheckpointIntegrityError, match=f"{root / '3'} is {word}"):
        ckpt.verify_step(root / "3")
    step, skipped = ckpt.newest_intact_step(root)
    assert step == 2 and [s for s, _ in skipped] == [3] and word in skipped[0][1]
    # Loaders refuse it too (export / generate / serve read through load_model).
    with pytest.raises(ckpt.CheckpointIntegrityError, match=word):
        ckpt.load_model(root / "3")


def test_step_without_manifest_counts_as_an_interrupted_save(tmp_path, model) -> None:
    root = _three_steps(tmp_path, model)
    (root / "3" / ckpt.MANIFEST).unlink()
    assert ckpt.newest_intact_step(root)[0] == 2


def test_step_killed_before_its_manifest_is_rehashed_when_orbax_committed_it(tmp_path, model) -> None:
    root = _three_steps(tmp_path, model)
    (root / "3" / ckpt.MANIFEST).unlink()  # killed between Orbax's commit and the manifest
    assert ckpt.orbax_commit_problem(root / "3") is None
    assert ckpt.newest_intact_step(root, repair=True) == (3, [])
    ckpt.verify_step(root / "3")  # its manifest was written: now an ordinary intact step
    # Without Orbax's commit marker (or with an item never committed) it stays an interrupted save.
    for missing in (root / "3" / ckpt.ORBAX_COMMIT_FILE, root / "2" / "params" / ckpt.ORBAX_COMMIT_FILE):
        step_dir = missing.parent if missing.parent.name.isdigit() else missing.parent.parent
        (step_dir / ckpt.MANIFEST).unlink()
        missing.unlink()
        why = "(it has no Orbax commit marker|its item .params. was not committed)"
        with pytest.raises(ckpt.CheckpointIntegrityError, match=f"is incomplete: it has no .* and {why}"):
            ckpt.verify_step(step_dir, repair=True)
    assert ckpt.newest_intact_step(root, repair=True)[0] == 1


def test_no_intact_step_is_one_error_naming_every_step(tmp_path, model) -> None:
    root = _three_steps(tmp_path, model)
    for step in (1, 2, 3):
        flip_bit(_largest_file(root / str(step)))
    with pytest.raises(ckpt.CheckpointIntegrityError) as e:
        ckpt.newest_intact_step(root)
    msg = str(e.value)
    assert "\n" not in msg and "no intact checkpoint" in msg and "[1, 2, 3]" in msg


# ------------------------------------------------------------------------------------- paths


def test_gs_urls_survive_config_and_path_handling_untouched(tmp_path, monkeypatch) -> None:
    from agentrefine_jax.config import load_config
    from agentrefine_jax.train.run_dir import RunPaths

    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ["train.run_dir=gs://bucket/runs/x", "train.export_hf_at_end=gs://b2/hf"])
    assert cfg.train.run_dir == "gs://bucket/runs/x"
    paths = RunPaths(cfg.train.run_dir)  # touches no file system
    assert str(paths.checkpoints) == "gs://bucket/runs/x/checkpoints"
    assert str(paths.metrics) == "gs://bucket/runs/x/metrics.jsonl"
    assert str(url_paths.as_path("gs://bucket/runs/x")) == "gs://bucket/runs/x"
    assert str(url_paths.join(cfg.train.run_dir, "hf")) == "gs://bucket/runs/x/hf"
    assert str(url_paths.join(cfg.train.run_dir, cfg.train.export_hf_at_end)) == "gs://b2/hf"
    assert (
        url_paths.is_url("gs://bucket/x")
        and not url_paths.is_url("file:///tmp/x")
        and not url_paths.is_url("a/b")
    )
    assert not list(tmp_path.iterdir())  # no local ./gs: directory


def test_file_urls_are_local_paths() -> None:
    assert str(url_paths.as_path("file:///tmp/some/run")) == "/tmp/some/run"
    with pytest.raises(ValueError, match="absolute"):
        url_paths.as_path("file://relative/run")


# ----------------------------------------------------------------------------------- metrics


def test_metrics_rows_are_strict_json_and_replayed_steps_appear_once(tmp_path) -> None:
    from agentrefine_jax.train.metrics import MetricsWriter
    from agentrefine_jax.train.run_dir import RunPaths

    paths = RunPaths(str(tmp_path / "run"))
    w = MetricsWriter(paths, 0)
    for step in range(1, 6):
        w.write({"step": step, "loss": float("nan") if step == 5 else 1.0 / step, "gnorm": float("inf")})
    w.close()
    with open(paths.metrics, "a") as f:
        f.write('{"step": 6, "loss": 0.')  # a row cut short by a kill

    def strict(line: str) -> dict:
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    rows = [strict(x) for x in pathlib.Path(paths.metrics).read_text().splitlines()[:5]]
    assert rows[4]["loss"] is None and rows[0]["gnorm"] is None
    # Resume from the checkpoint at step 3: steps 4, 5 are trained again, and the torn line goes.
    w = MetricsWriter(paths, 3)
    for step in (4, 5):
        w.write({"step": step, "loss": 0.5})
    w.close()
    rows = [strict(x) for x in pathlib.Path(paths.metrics).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["loss"] == 0.5


# ------------------------------------------------------------------------------ architecture


def test_architecture_diff_covers_every_field_that_changes_the_function() -> None:
    base = preset("llama3_8b")
    # Llama-3 vs 3.1: only RoPE scaling counts (max_position_embeddings changes no output).
    assert base.architecture_diff(preset("llama3.1_8b")) == ["rope_scaling"]
    changes = {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "family": "mistral",
        "tie_embeddings": True,
        "head_dim": 64,
        "vocab_size": 32000,
        "rope_scaling": RopeScaling(factor=4.0),
    }
    for field, value in changes.items():
        assert [
            d.split(":")[0] for d in base.architecture_diff(dataclasses.replace(base, **{field: value}))
        ] == [field]
    same = dataclasses.replace(base, param_dtype="bfloat16", dtype="float32", remat_policy="full")
    assert base.architecture_diff(same) == []
    # Every field belongs to exactly one part (a new field is compared unless it is put in
    # Interface or Execution on purpose).
    parts = [{f.name for f in dataclasses.fields(c)} for c in (Architecture, Interface, Execution)]
    assert sum(map(len, parts)) == len(set().union(*parts)) == len(dataclasses.fields(ModelConfig))


def test_init_from_hf_refuses_llama31_weights_under_a_llama3_config(tmp_path) -> None:
    from hf_fixtures import TINY_LLAMA3, make_checkpoint

    from agentrefine_jax.config import load_config
    from agentrefine_jax.hf.io import read_hf_config
    from agentrefine_jax.train.loop import TrainingError, train

    hf_dir = make_checkpoint(tmp_path / "hf", "llama", **TINY_LLAMA3)  # llama3 rope scaling, as 3.1 ships
    hf_cfg = read_hf_config(hf_dir)
    assert hf_cfg.rope_scaling is not None
    cfg = load_config(
        "tiny",
        [
            "data.max_length=256",
            "train.global_batch_size=2",
            "mesh.fsdp=2",
            "mesh.tensor=4",
            "train.max_steps=1",
            f"train.run_dir={tmp_path / 'run'}",
            f"train.init_from_hf={hf_dir}",
            "train.export_hf_at_end=none",
            "train.model_source=config",  # the demo's "auto" would take the model from hf_dir
        ],
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(hf_cfg, rope_scaling=None, dtype="float32"))
    with pytest.raises(TrainingError, match="rope_scaling: config None vs checkpoint RopeScaling"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


def test_export_dtype_auto_prefers_the_imported_dtype() -> None:
    from agentrefine_jax.hf.io import resolve_export_dtype

    assert resolve_export_dtype("auto", source_dtype="bfloat16", param_dtype="float32") == "bfloat16"
    assert resolve_export_dtype("auto", source_dtype=None, param_dtype="float32") == "float32"
    assert resolve_export_dtype("float16", source_dtype="float32", param_dtype="float32") == "float16"
    with pytest.raises(ValueError, match="float8"):
        resolve_export_dtype("float8", source_dtype=None, param_dtype="float32")


@pytest.mark.parametrize("keep_epochs", [False, True])
def test_epoch_checkpoints_survive_the_keep_policy(tmp_path, keep_epochs) -> None:
    import jax.numpy as jnp

    from agentrefine_jax.config import Config, TrainConfig
    from agentrefine_jax.train.hooks import Checkpointing, RunState
    from agentrefine_jax.train.run_dir import RunPaths

    cfg = Config(model=CFG, train=TrainConfig(keep_checkpoints=1, keep_epoch_checkpoints=keep_epochs))
    paths = RunPaths(str(tmp_path / "run"))
    ckpts = ckpt.TrainCheckpoints(paths.checkpoints, keep=1, keep_every=2 if keep_epochs else 0)
    meta = ckpt.make_meta(CFG, step=0, config=cfg, steps_per_epoch=2)
    hook = Checkpointing(ckpts, cfg, meta, every=1, steps_per_epoch=2, start_step=0)
    state = RunState(0, 5, 0, None, None)
    for step in range(1, 6):
        state.step, state.params, state.opt_state = step, {"w": jnp.full(3, step)}, {"mu": jnp.zeros(3)}
        hook.after_step(state)
    hook.at_end(state)
    kept = ckpt.checkpoint_steps(paths.checkpoints)
    assert kept == ([2, 4, 5] if keep_epochs else [5])
    for step in kept:
        ckpt.verify_step(paths.checkpoints / str(step))  # each one got its manifest
    epochs = {s: ckpt.read_meta(paths.checkpoints, s).epoch for s in kept}
    assert epochs == ({2: 1, 4: 2, 5: None} if keep_epochs else {5: None})
