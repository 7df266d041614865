"""The project checkpoint format (agentrefine_jax.checkpoint) with real Orbax on disk."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from agentrefine_jax import checkpoint as ckpt
from agentrefine_jax.config import Config, from_dict
from agentrefine_jax.models import RopeScaling, llama, preset
from agentrefine_jax.sharding import make_mesh

CFG = preset(
    "tiny",
    vocab_size=300,
    tie_embeddings=False,
    rope_scaling=RopeScaling(original_max_position_embeddings=64),
    eos_token_ids=(5, 7),
)


@pytest.fixture(scope="module")
def model() -> llama.Transformer:
    return llama.create(CFG, seed=3)


def _params(m: llama.Transformer) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.Param)))


def _assert_same_params(a: llama.Transformer, b: llama.Transformer) -> None:
    pa, pb = _params(a), _params(b)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(x, y)


def test_save_load_round_trip_with_meta(tmp_path, model) -> None:
    full = dataclasses.replace(Config(), model=CFG)
    step_dir = ckpt.save_model(
        tmp_path / "ck", model, CFG, step=7, tokenizer="llama3", template="llama3", config=full
    )
    assert step_dir.name == "7"
    cfg, loaded, meta = ckpt.load_model(tmp_path / "ck")
    assert cfg == CFG
    assert meta.model == CFG
    assert meta.tokenizer == "llama3" and meta.template == "llama3" and meta.step == 7
    assert from_dict(meta.config).model == CFG
    _assert_same_params(model, loaded)
    x = jnp.arange(12, dtype=jnp.int32)[None]
    forward = nnx.jit(lambda m, ids: m(ids))
    np.testing.assert_array_equal(np.asarray(forward(model, x)), np.asarray(forward(loaded, x)))

    with pytest.raises(FileExistsError, match="step 7"):
        ckpt.save_model(tmp_path / "ck", model, CFG, step=7)


def test_resolve_checkpoint_forms(tmp_path, model) -> None:
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (3, 12):
        ckpt.save_model(root, model, CFG, step=step)
    assert ckpt.resolve_checkpoint(run) == (root, 12)
    assert ckpt.resolve_checkpoint(root) == (root, 12)
    assert ckpt.resolve_checkpoint(root / "3") == (root, 3)
    _, _, meta = ckpt.load_model(run)
    assert meta.step == 12

    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "empty")
    (tmp_path / "emptyrun" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "emptyrun")


def test_trainer_items_in_the_same_manager_are_ignored(tmp_path, model) -> None:
    """The trainer's opt_state (and older runs' data_iter) items live next to ours; loading must not choke."""
    reg = ckpt.handler_registry()  # params, meta and the trainer's opt_state
    reg.add("data_iter", ocp.args.JsonSave)
    reg.add("data_iter", ocp.args.JsonRestore)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with ocp.CheckpointManager(tmp_path / "ck", handler_registry=reg) as mngr:
        mngr.save(
            4,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                meta=ocp.args.JsonSave(ckpt.make_meta(CFG, step=4).to_json()),
                opt_state=ocp.args.StandardSave({"mu": jnp.ones(3), "count": jnp.array(4)}),
                data_iter=ocp.args.JsonSave({"position": 17}),
            ),
        )
        mngr.wait_until_finished()
    cfg, loaded, meta = ckpt.load_model(tmp_path / "ck")
    assert meta.step == 4
    _assert_same_params(model, loaded)


def _raw_save(path, params: dict, cfg=CFG) -> None:
    """Bypass save_model's own validation, as a buggy or foreign writer would."""
    with ocp.CheckpointManager(path, handler_registry=ckpt.handler_registry()) as mngr:
        mngr.save(
            0,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                meta=ocp.args.JsonSave(ckpt.make_meta(cfg, step=0).to_json()),
            ),
        )
        mngr.wait_until_finished()


def test_missing_extra_or_misshaped_leaf_fails_clearly(tmp_path, model) -> None:
    good = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    missing = jax.tree.map(lambda x: x, good)
    del missing["layers"]["wq"]
    _raw_save(tmp_path / "missing", missing)
    with pytest.raises(ValueError, match="missing parameter layers/wq"):
        ckpt.load_model(tmp_path / "missing")

    misshaped = jax.tree.map(lambda x: x, good)
    misshaped["layers"]["w_up"] = misshaped["layers"]["w_up"][:, :, :-1]
    _raw_save(tmp_path / "misshaped", misshaped)
    with pytest.raises(ValueError, match=r"layers/w_up has shape \(2, 64, 191\), expected \(2, 64, 192\)"):
        ckpt.load_model(tmp_path / "misshaped")

    extra = jax.tree.map(lambda x: x, good)
    extra["layers"]["bias"] = jnp.zeros(3)
    _raw_save(tmp_path / "extra", extra)
    with pytest.raises(ValueError, match="unexpected parameter layers/bias"):
        ckpt.load_model(tmp_path / "extra")

    with pytest.raises(ValueError, match="missing parameter layers/wq"):
        ckpt.save_model(tmp_path / "never", missing, CFG)


def test_load_onto_sharded_mesh_and_cast(tmp_path, model) -> None:
    ckpt.save_model(tmp_path / "ck", model, CFG)
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    _, sharded, _ = ckpt.load_model(tmp_path / "ck", mesh=mesh)
    wq = sharded.layers.wq[...]
    assert len(wq.sharding.device_set) == 8
    assert wq.addressable_shards[0].data.shape == (2, 64 // 4, 4 // 2, 16)
    _assert_same_params(model, sharded)

    cfg16, cast, _ = ckpt.load_model(tmp_path / "ck", param_dtype="bfloat16")
    assert cfg16.param_dtype == "bfloat16" and cast.embed[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(cast.embed[...]), np.asarray(model.embed[...].astype(jnp.bfloat16))
    )
