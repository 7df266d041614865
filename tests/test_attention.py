"""Attention implementations: splash (Pallas, interpreted on CPU) and the cuDNN call's plumbing
against the blocked XLA path; the splash train step through the real XLA TPU compiler."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrefine_jax import sharding as shd
from agentrefine_jax.config import MeshConfig, OptimConfig
from agentrefine_jax.models import ModelConfig, execution, preset
from agentrefine_jax.models import attention as attn

# GQA: 4 query heads per kv head. S = 200 is not a multiple of 128, so the splash path's
# lane padding is exercised as well.
B, S, H, KVH, D = 2, 200, 8, 2, 16
# The TPU layout explicitly: on CPU, model.cpu_layout="auto" would take the flat path instead.
CFG = preset("tiny", num_heads=H, num_kv_heads=KVH, head_dim=D, attention_block_size=64, cpu_layout=False)


def _packed() -> tuple[np.ndarray, np.ndarray]:
    """Row 0: three documents and padding; row 1: two documents filling the row."""
    lens = [[70, 50, 40], [120, 80]]
    seg = np.zeros((B, S), np.int32)
    pos = np.zeros((B, S), np.int32)
    for b, row in enumerate(lens):
        start = 0
        for i, n in enumerate(row):
            seg[b, start : start + n] = i + 1
            pos[b, start : start + n] = np.arange(n)
            start += n
    return seg, pos


def _qkv(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(k1, (B, S, H, D), jnp.float32),
        jax.random.normal(k2, (B, S, KVH, D), jnp.float32),
        jax.random.normal(k3, (B, S, KVH, D), jnp.float32),
    )


def _compare(cfg: ModelConfig, impl) -> None:
    """`impl` equals the XLA path on real tokens, forward (1e-5) and input gradients."""
    seg_np, pos_np = _packed()
    seg, pos = jnp.asarray(seg_np), jnp.asarray(pos_np)
    real = jnp.asarray(seg_np > 0)[:, :, None, None]
    q, k, v = _qkv()
    # Padding rows are never read by real tokens and carry no loss: the cotangent skips them.
    cot = jax.random.normal(jax.random.key(7), q.shape, jnp.float32) * real

    def fwd_bwd(fn):
        def run(q, k, v):
            out, vjp = jax.vjp(lambda q, k, v: fn(cfg, q, k, v, seg, pos), q, k, v)
            return out * real, vjp(cot)

        return jax.jit(run)(q, k, v)

    want, g_want = fwd_bwd(
        lambda cfg, q, k, v, seg, pos: attn.xla_attention(
            cfg, q, k, v, attn.Segments(seg, pos, seg, pos), block=cfg.attention_block_size
        )
    )
    got, g_got = fwd_bwd(impl)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b_ in zip(g_got, g_want, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-4, rtol=1e-4)


def _splash(cfg, q, k, v, seg, pos):
    return attn.splash_attention(cfg, execution.resolve(cfg, "cpu"), q, k, v, seg)


@pytest.mark.parametrize("window", [None, 24])
def test_splash_interpreted_equals_xla_on_packed_gqa(window):
    # 128-token tiles over a 256-padded sequence: several q and kv blocks, some fully masked.
    cfg = dataclasses.replace(
        CFG, sliding_window=window, splash_block_q=128, splash_block_kv=128, splash_block_kv_compute=128
    )
    _compare(cfg, _splash)


def test_splash_sharded_over_batch_and_heads_equals_xla():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = shd.make_mesh(data=1, fsdp=2, tensor=2, devices=devices[:4])
    rules = MeshConfig().rules

    def sharded(cfg, q, k, v, seg, pos):
        with shd.use_sharding(mesh, rules):
            return attn.splash_attention(cfg, execution.resolve(cfg, "cpu"), q, k, v, seg)

    _compare(CFG, sharded)


def test_cudnn_call_plumbing_equals_xla():
    # No GPU here: jax's own XLA implementation behind the same call checks the masks and
    # GQA layout handed to cuDNN; the kernel itself is unverified on GPU.
    _compare(
        dataclasses.replace(CFG, sliding_window=24),
        lambda cfg, q, k, v, s, p: attn.cudnn_attention(cfg, q, k, v, attn.Segments(s, p, s, p), None),
    )


def test_auto_follows_the_compile_target_devices():
    assert execution.attention_kernel(CFG, "tpu") == "splash"
    assert execution.attention_kernel(CFG, "cpu") == "xla"
    assert execution.attention_kernel(dataclasses.replace(CFG, dtype="bfloat16"), "gpu") == "cudnn"
    assert execution.attention_kernel(CFG, "gpu") == "xla"  # float32: cuDNN has no path
    assert execution.attention_kernel(dataclasses.replace(CFG, attention="xla"), "tpu") == "xla"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention": "flash"}, "attention must be one of"),
        ({"attention": "cudnn", "dtype": "float32"}, "needs dtype bfloat16"),
        ({"splash_block_q": 100}, "multiple of 128"),
        ({"splash_block_kv": 256, "splash_block_kv_compute": 384}, "multiple of splash_block_kv_compute"),
    ],
)
def test_attention_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CFG, **change)


def test_model_forward_with_splash_equals_xla():
    from agentrefine_jax.models import create

    seg, pos = _packed()
    ids = np.random.RandomState(0).randint(0, 1000, (B, S)).astype(np.int32)
    cfg = dataclasses.replace(CFG, vocab_size=1000)
    out = {}
    for impl in ("xla", "splash"):
        model = create(dataclasses.replace(cfg, attention=impl), seed=3)
        out[impl] = np.asarray(jax.jit(lambda m: m.forward(ids, pos, seg)[0])(model))
    real = seg > 0
    np.testing.assert_allclose(out["splash"][real], out["xla"][real], atol=1e-5, rtol=1e-5)


def test_splash_train_step_compiles_for_tpu():
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    from agentrefine_jax.train.optimizer import make_optimizer
    from agentrefine_jax.train.step import build_steps

    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Other processes on this host may hold libtpu too; compiling needs no exclusive chip access.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5p:2x2x1",
        chip_config_name="megacore",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    ).devices
    cfg = preset("tiny", vocab_size=1024, head_dim=128, dtype="bfloat16", remat_policy="full")
    mesh = shd.make_mesh(data=1, fsdp=2, tensor=2, devices=devices)
    rules = MeshConfig().rules
    opt, _ = make_optimizer(OptimConfig(), 10)
    seq, batch = 512, 4
    texts = {}
    for impl in ("auto", "xla"):
        fns = build_steps(
            dataclasses.replace(cfg, attention=impl),
            opt,
            mesh,
            rules,
            global_batch=batch,
            micro_batch=None,
            loss_chunk=256,
        )
        abstract = lambda tree, shard: jax.tree.map(  # noqa: E731
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shard
        )
        params = abstract(fns.abstract_params, fns.param_shardings)
        opt_state = abstract(fns.abstract_opt, fns.opt_shardings)
        data = {
            k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=fns.batch_sharding)
            for k in ("input_ids", "loss_mask", "segment_ids", "positions")
        }
        compiled = fns.train.lower(params, opt_state, data).compile()
        assert compiled.memory_analysis().temp_size_in_bytes > 0
        texts[impl] = compiled.as_text()
    # auto on TPU devices (from a CPU host) is splash: the Mosaic kernel is in the program.
    assert "tpu_custom_call" in texts["auto"]
    assert "tpu_custom_call" not in texts["xla"]
