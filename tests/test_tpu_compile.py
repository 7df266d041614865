"""The compile-only check against the real XLA TPU compiler (libtpu, no TPU needed): the
trainer's own step compiled for small v5p slices, the CLI's report and errors, the slice table
against the devices libtpu itself describes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

pytest.importorskip("libtpu", reason="the TPU compile check needs the tpu extra (libtpu)")

from agentrefine_jax.train import aot  # noqa: E402
from agentrefine_jax.train import topology as T  # noqa: E402

# A tiny Llama (the demo's preset, one layer, short sequences): compiles in seconds.
TINY = ["--set", "model.num_layers=1", "--set", "data.max_length=128", "--set", "train.loss_chunk_size=64"]


def run(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def test_slice_table_matches_libtpu() -> None:
    """Chips per slice, chip kind and cores per chip as libtpu's own topology reports them."""
    from jax.experimental import topologies

    aot.prepare_tpu_env()
    for name in T.SLICES:
        sl = T.get_slice(name)
        devices = topologies.get_topology_desc(
            platform="tpu",
            topology_name=sl.topology,
            chip_config_name=sl.chip.chip_config_name,
            chips_per_host_bounds=sl.chips_per_host_bounds,
            num_slices=1,
        ).devices
        assert len(devices) == sl.chips, name
        assert T.chip_of_device_kind(devices[0].device_kind) is sl.chip, (name, devices[0].device_kind)
        assert devices[0].num_cores == sl.chip.cores_per_chip, name
    # Cloud TPU names count cores on v4/v5p, chips on v5e/v6e.
    assert [T.get_slice(n).chips for n in ("v5p-64", "v5p-256", "v4-32", "v6e-64")] == [32, 128, 16, 64]
    assert T.get_slice("v5litepod-256") is T.get_slice("v5e-256")
    assert T.get_slice("v5p-64").hosts == 8
    # The planner and MFU read the same table.
    assert T.PEAK_FLOPS["v5p"] == T.CHIPS["v5p"].peak_flops == 459e12
    with pytest.raises(T.UnknownTopology, match="known: v4-8"):
        T.get_slice("v5p-63")


def test_plan_compile_json_tiny_on_v5p8(tmp_path) -> None:
    # The compile is the measurement: with a persistent compilation cache configured (compile_cache.py),
    # nothing is read from it or written to it (every program cached, however quick to compile).
    cache = tmp_path / "xla-cache"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    r = run(
        "agentrefine_jax.plan",
        "--config",
        "tiny",
        "--topology",
        "v5p-8",
        "--compile",
        "--json",
        *TINY,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not cache.exists() or not any(cache.iterdir()), sorted(p.name for p in cache.iterdir())
    out = json.loads(r.stdout)
    b = out["compiled"]["bytes_per_device"]
    assert b["total"] == b["arguments"] + b["outputs"] - b["aliased"] + b["temp"]
    # Every figure names the compiler that produced it (memory moves 30-40% between libtpus).
    assert out["versions"] == {d: metadata.version(d) for d in ("jax", "jaxlib", "libtpu")}
    assert out["topology"] == {**out["topology"], "name": "v5p-8", "chips": 4}
    assert out["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert out["compiled"]["fits"] is True and out["compiled"]["hbm_bytes"] == 95 * T.GiB
    assert out["compiled"]["compile_seconds"] > 0
    planned = out["planned"]["bytes_per_device"]
    # The step's inputs are the fsdp-sharded params + AdamW state + this device's batch rows;
    # the planner derives params/optimizer from the same sharding rules (TPU layouts pad small
    # arrays to whole tiles, ~1% on this tiny model).
    state = planned["params"] + planned["optimizer"]
    assert state <= b["arguments"] <= 1.03 * state + 64 * 1024
    # Params and optimizer state are donated: the update is written in place.
    assert b["aliased"] >= state
    assert planned["total"] > 0 and out["planned_to_compiled"] == pytest.approx(planned["total"] / b["total"])


def test_train_compile_only_two_slices() -> None:
    r = run(
        "agentrefine_jax.train", "--config", "tiny", "--compile-only", "--topology", "v5p-8",
        "--num-slices", "2", *TINY, "--set", "train.global_batch_size=8",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tiny train step on v5p-8 x 2 slices (8 chips" in r.stdout
    assert "mesh data=2,fsdp=4,tensor=1" in r.stdout
    assert "-> FITS" in r.stdout and "planner estimate" in r.stdout
    assert f"(libtpu {metadata.version('libtpu')}, jax {metadata.version('jax')}" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "v9z-8"], "unknown TPU slice 'v9z-8'; known: v4-8"),
        (["--topology", "v5p-8", "--set", "mesh.fsdp=3"], "has 3 devices but the slice has 4 chips"),
        ([], "--topology is required"),
    ],
)
def test_compile_errors_are_one_line(args: list[str], message: str) -> None:
    r = run("agentrefine_jax.plan", "--config", "tiny", "--compile", *args)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cpu_start_is_quiet_with_libtpu_installed() -> None:
    """libtpu without a TPU complains at backend start-up unless the trainer's CLIs set its env."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS"))}
    # libtpu stays silent while another process holds its lock file; make the probe deterministic.
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    probe = "import jax; print(jax.devices()[0].platform)"
    loud = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    if "TPU_WORKER_HOSTNAMES" not in loud.stderr:
        pytest.skip("this libtpu starts quietly on its own")
    quiet = subprocess.run(
        [sys.executable, "-c", f"from agentrefine_jax.train import aot; aot.prepare_tpu_env(); {probe}"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert quiet.returncode == 0 and quiet.stdout.strip() == "cpu"
    assert "TPU" not in quiet.stderr and "E0000" not in quiet.stderr, quiet.stderr


def test_cpu_layout_auto_follows_the_step_devices_not_the_host() -> None:
    """model.cpu_layout="auto": the CPU layout on this host's CPUs, the TPU layout when the step is
    traced for a TPU slice (an ahead-of-time compile on this same CPU host)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from agentrefine_jax import sharding as shd
    from agentrefine_jax.models import execution, preset

    cfg = preset("tiny")
    assert cfg.cpu_layout == "auto"
    aot.prepare_tpu_env()
    axes = ("data", "fsdp", "tensor")
    tpu = np.asarray(aot.topology_devices(T.get_slice("v5p-8"))).reshape(1, 4, 1)
    cpu = Mesh(np.asarray(jax.devices("cpu")[:1]).reshape(1, 1, 1), axes)
    assert execution.for_devices(cfg, Mesh(tpu, axes)).cpu_layout is False
    assert execution.for_devices(cfg, cpu).cpu_layout is True
    # Without a mesh argument: the active mesh's devices (sharding.use_sharding).
    with shd.use_sharding(Mesh(tpu, axes), ()):
        assert execution.for_devices(cfg).cpu_layout is False


def test_qwen3_moe_step_compiles_for_tpu_with_grouped_matmuls_per_batch_shard() -> None:
    """The Qwen3-MoE step (one small layer, 8 experts, top 2) compiled by the XLA TPU compiler for
    v5p-8: the expert projections are the TPU's own grouped matmul (`ragged-dot` instructions, not
    jax's dense one-hot expansion), and each device sorts and multiplies only its own batch rows'
    (token, expert) assignments -- 2 rows x 128 tokens x top 2 = 512, not the global batch's 2048,
    which GSPMD would gather to every device if the flattened global batch were sorted."""
    import re

    from agentrefine_jax.config import load_config

    aot.prepare_tpu_env()
    sets = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
            "model.head_dim=16", "model.num_experts=8", "model.num_experts_per_tok=2",
            "model.moe_intermediate_size=32", "data.max_length=128", "train.global_batch_size=8",
            "train.loss_chunk_size=64"]  # fmt: skip
    lowered, sizes = aot.lower_train_step(load_config("qwen3_30b_a3b", sets), T.get_slice("v5p-8"))
    assert sizes == {"data": 1, "fsdp": 4, "tensor": 1}
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes > 0 and mem.temp_size_in_bytes > 0
    hlo = compiled.as_text()
    # Forward gate, up, down and their transposes: at least 3 + 6 grouped matmuls.
    rows = [int(m) for m in re.findall(r"%ragged-dot\S* = bf16\[(\d+),\d+\]", hlo)]
    assert len(rows) >= 9, rows
    assert set(rows) == {512}, rows
    # The routing sort (expert ids of this device's assignments) is per device too.
    sorts = [int(m) for m in re.findall(r"= \(s32\[(\d+)\]\{[^}]*\}, [^=]*\) sort\(", hlo)]
    assert sorts and set(sorts) == {512}, sorts


def test_qwen3_moe_step_with_a_tensor_axis_is_expert_parallel_for_tpu() -> None:
    """The same small MoE step on v5p-8 as fsdp=2 x tensor=2: the plan runs the experts
    expert-parallel over tensor (models/moe.py), so every grouped matmul of the compiled step takes
    one tensor rank's 4 of the 8 experts (weights [4, 64, 32], gathered over fsdp from the 2 each
    device stores) and the 8-expert stack appears nowhere; the rows are the batch shard's
    (4 rows x 128 tokens x top 2 = 1024), the same on both tensor ranks (tokens are replicated
    over tensor, none is sent anywhere). Without expert parallelism the same step holds all 8."""
    import re

    from agentrefine_jax.config import load_config

    aot.prepare_tpu_env()
    sets = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
            "model.head_dim=16", "model.num_experts=8", "model.num_experts_per_tok=2",
            "model.moe_intermediate_size=32", "data.max_length=128", "train.global_batch_size=8",
            "train.loss_chunk_size=64", "mesh.fsdp=2", "mesh.tensor=2"]  # fmt: skip
    lowered, sizes = aot.lower_train_step(load_config("qwen3_30b_a3b", sets), T.get_slice("v5p-8"))
    assert sizes == {"data": 1, "fsdp": 2, "tensor": 2}
    hlo = lowered.compile().as_text()
    calls = re.findall(r"%ragged-dot\S* = bf16\[(\d+),\d+\][^\n]*", hlo)
    assert len(calls) >= 9 and set(calls) == {"1024"}, calls
    experts = set(re.findall(r"bf16\[(?:1,)?(\d+),(?:64,32|32,64)\]", hlo))
    assert experts == {"2", "4"}, experts  # stored 2 per device (tensor x fsdp), computed with 4
