"""The QLoRA-style int8 base (train.lora.base_dtype=int8, models/quant.py): per-output-channel
symmetric int8 projections, a forward close to the float base's, int8 leaves that stay int8 and
untouched through training, a run that learns, a base that resume and `load_lora` rebuild
bit for bit, and fewer argument bytes in the step the TPU compiler builds."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_lora import SPEC, VOCAB, _batch, check_learned_with_adapters_only, train_demo

from agentrefine_jax import sharding as shd
from agentrefine_jax.config import MeshConfig, OptimConfig
from agentrefine_jax.models import create, preset, quant
from agentrefine_jax.models import params as P
from agentrefine_jax.train.optimizer import make_optimizer
from agentrefine_jax.train.step import build_steps

CFG = preset("tiny", vocab_size=VOCAB, param_dtype="float32", dtype="float32")
INT8 = [
    "--set",
    "train.lora.rank=8",
    "--set",
    "train.lora.base_dtype=int8",
    "--set",
    "optim.learning_rate=0.01",
]


def _steps(cfg, base_dtype: str, mesh=None):
    mesh = mesh or shd.make_mesh(1, -1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(OptimConfig(learning_rate=1e-2, schedule="constant"), 10)
    return build_steps(
        cfg,
        optimizer,
        mesh,
        MeshConfig().rules,
        global_batch=4,
        micro_batch=2,
        loss_chunk=16,
        lora_spec=SPEC,
        lora_base_dtype=base_dtype,
    )


def test_int8_base_is_accepted_when_the_config_loads():
    from agentrefine_jax.config import load_config

    cfg = load_config("tiny", ["train.lora.rank=8", "train.lora.base_dtype=int8"])
    assert cfg.train.lora.base_dtype == "int8"


def test_quantisation_is_per_output_channel_symmetric_int8():
    """Against a numpy oracle: scale = max|W| over the input axes / 127.5 per layer and output
    channel, q = clip(rint(W / scale), -128, 127); so |W - q * scale| <= scale / 2 everywhere.
    XLA's float32 division may differ from IEEE's by an ulp, so exact .5 ties (a channel's most
    negative weight is one: -127.5) may round either way."""
    base = nnx.to_pure_dict(nnx.state(create(CFG, seed=0), nnx.Param))
    q = jax.jit(quant.quantize_base)(base)
    others = [v for k, v in q.items() if k != "layers"] + [q["layers"][k] for k in ("attn_norm", "mlp_norm")]
    for kept in others:
        assert not quant.is_quantized(kept) and kept.dtype == jnp.float32  # only projections
    for name in quant.QUANTIZED:
        w, qa = np.asarray(base["layers"][name], np.float64), q["layers"][name]
        n_in = P.BY_PATH[("layers", name)].n_in
        in_axes = tuple(range(1, 1 + n_in))
        assert qa.qvalue.dtype == jnp.int8 and qa.qvalue.shape == w.shape
        scale = np.max(np.abs(w), axis=in_axes, keepdims=True) / 127.5
        assert qa.scale.shape == scale.shape and qa.scale.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(qa.scale), scale, rtol=1e-6)
        r = w / np.asarray(qa.scale, np.float64)
        want = np.clip(np.rint(r), -128, 127)
        off = np.asarray(qa.qvalue) != want
        assert np.all(np.abs(np.abs(r[off]) % 1 - 0.5) < 1e-4), r[off]  # ties only
        assert np.all(np.abs(np.asarray(qa.qvalue)[off] - want[off]) == 1)
        deq = np.asarray(quant.dequantize(qa, jnp.float32), np.float64)
        assert np.all(np.abs(deq - w) <= np.asarray(qa.scale) * (0.5 + 1e-4))
        assert np.abs(deq - w).max() > 0  # it is quantised, not a copy


def test_int8_base_forward_is_close_to_the_float_base():
    """Logits with the int8 base (dequantised per layer) vs the float32 base. Each weight is off
    by up to scale / 2, i.e. uniform noise of ~0.5% of a weight's typical size (a channel's max is
    ~2.4 sigma of 64-192 Gaussian draws, split into 255 steps); through 14 projections that gives
    ~1% relative RMS logit error on this random tiny model (measured 0.68%; rounding the same
    weights to bfloat16 instead: 0.27%). Bound: 2%."""
    model = create(CFG, seed=0)
    graphdef, state = nnx.split(model, nnx.Param)
    base = nnx.to_pure_dict(state)
    ids = _batch()["input_ids"]
    want = np.asarray(model(ids))
    got = np.asarray(nnx.merge(graphdef, jax.jit(quant.quantize_base)(base))(ids))
    rel = np.linalg.norm(got - want) / np.linalg.norm(want - want.mean())
    assert 0 < rel < 0.02, rel


def test_int8_step_trains_adapters_only_and_keeps_the_int8_base_bit_identical():
    mesh = shd.make_mesh(1, 2, 2, devices=jax.devices()[:4]) if len(jax.devices()) >= 4 else None
    fns = _steps(CFG, "int8", mesh)
    params = fns.init_params(0)
    opt_state = fns.init_opt(params)
    layers = params["base"]["layers"]
    for name in quant.QUANTIZED:  # real int8 buffers in the step's state
        qa, n_in = layers[name], P.BY_PATH[("layers", name)].n_in
        assert qa.qvalue.dtype == jnp.int8 and qa.scale.dtype == jnp.float32
        # int8 values sharded like W; scales along W's output axes only (input axes have size 1)
        q_spec = tuple(qa.qvalue.sharding.spec) + (None,) * (qa.ndim - len(qa.qvalue.sharding.spec))
        s_spec = tuple(qa.scale.sharding.spec) + (None,) * (qa.ndim - len(qa.scale.sharding.spec))
        assert s_spec == (None, *[None] * n_in, *q_spec[1 + n_in :]), (name, q_spec, s_spec)
    if mesh is not None:
        assert "fsdp" in tuple(layers["wq"].qvalue.sharding.spec) and "tensor" in tuple(
            layers["wq"].scale.sharding.spec
        )
    assert params["base"]["embed"].dtype == jnp.bfloat16  # the rest of the base stays bfloat16
    assert jax.tree.structure(optax.tree_utils.tree_get(opt_state, "mu")) == jax.tree.structure(
        params["lora"]
    )
    before = jax.tree.map(np.asarray, params)
    losses = []
    for _ in range(2):
        params, opt_state, metrics = fns.train(params, opt_state, _batch())
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    after = jax.tree.map(np.asarray, params["base"])
    assert jax.tree.structure(after) == jax.tree.structure(before["base"])
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before["base"]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    for name in SPEC.names:
        assert not np.array_equal(np.asarray(params["lora"][name]["b"]), before["lora"][name]["b"])


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory) -> pathlib.Path:
    return train_demo(tmp_path_factory.mktemp("lora_int8") / "run", *INT8)


def test_int8_demo_learns_and_a_resume_or_load_rebuilds_its_base_bit_for_bit(int8_run):
    meta = check_learned_with_adapters_only(int8_run)
    step = int8_run / "checkpoints" / "8"
    assert meta["lora"]["base_dtype"] == "int8"

    # Resume: the adapters and AdamW state come from the checkpoint (exact, test_lora's resume
    # test); the int8 base is rebuilt by re-quantising, checked bit for bit below against the
    # trainer's own init path (the one a resumed run takes).
    # load_lora (generate / serve / eval / export) re-quantises the base exactly as training did.
    from agentrefine_jax.checkpoint import load_lora, model_config_from_meta

    base_cfg, base, _, _ = load_lora(step)
    assert base_cfg.param_dtype == "float32"
    fns = _steps(model_config_from_meta(meta), "int8")  # the trainer's step, as the run built it
    trained_base = quant.dequantize_base(fns.init_params(meta["lora"]["base"]["seed"])["base"])
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), trained_base)


# ------------------------------------------------------------------------------ TPU compiler


def test_int8_base_step_holds_fewer_argument_bytes_on_tpu():
    """The XLA TPU compiler (libtpu, v5p:2x2x1) on a LoRA step whose base is mostly projections:
    int8 values (+ float32 per-channel scales) instead of bfloat16 roughly halve the base."""
    pytest.importorskip("libtpu", reason="the TPU compile check needs the tpu extra (libtpu)")
    from agentrefine_jax.train import aot
    from agentrefine_jax.train.topology import get_slice

    aot.prepare_tpu_env()
    devices = aot.topology_devices(get_slice("v5p-8"))
    mesh = shd.make_mesh(1, -1, 1, devices=devices)
    cfg = preset(
        "tiny", vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2
    )
    args = {}
    for dtype in ("bfloat16", "int8"):
        fns = _steps(cfg, dtype, mesh)
        ab = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            fns.abstract_params,
            fns.param_shardings,
        )
        opt = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            fns.abstract_opt,
            fns.opt_shardings,
        )
        batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=fns.batch_sharding)
            for k, v in _batch().items()
        }
        mem = fns.train.lower(ab, opt, batch).compile().memory_analysis()
        args[dtype] = mem.argument_size_in_bytes
    proj = sum(
        int(np.prod(P.shape(P.BY_PATH[("layers", n)], cfg))) for n in quant.QUANTIZED
    )  # projection weights, all layers
    # bfloat16 -> int8 saves 1 byte per projection weight per device (fsdp over 4 chips), less
    # the float32 per-channel scales (measured: 1484288 -> 1068544 bytes, 99.5% of proj / 4).
    saved = args["bfloat16"] - args["int8"]
    assert 0.95 * proj / 4 < saved <= proj / 4, (args, proj)
