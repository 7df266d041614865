"""Ahead-of-time compile of the real train step for a TPU slice, on any machine.

With the `libtpu` wheel installed, `jax.experimental.topologies` describes the devices of a
slice that need not exist here; the trainer's own jitted step (`loop.build_train_step`: same
shardings, optimizer, accumulation, remat, attention) is lowered over a mesh of them with
abstract inputs (nothing is allocated) and compiled by the real XLA TPU compiler, whose
`memory_analysis()` says per device what the TPU would allocate.

    python -m agentrefine_jax.plan --config llama3_8b --topology v5p-64 --compile [--json]
    python -m agentrefine_jax.train --config llama3_8b --compile-only --topology v5p-64
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from agentrefine_jax.startup import prepare_tpu_env  # re-exported: the TPU compile check sets it up
from agentrefine_jax.train.topology import GiB, Slice


class CompileError(ValueError):
    """Bad input for the compile check (mesh vs slice, libtpu missing): one line for the user."""


def topology_devices(sl: Slice, num_slices: int = 1) -> list[Any]:
    """The JAX devices of `num_slices` slices of type `sl` (abstract: compile only)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise CompileError(
            "the TPU compile check needs libtpu: pip install -e '.[tpu]' (no TPU needed)"
        ) from None
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=sl.topology,
        chip_config_name=sl.chip.chip_config_name,
        chips_per_host_bounds=sl.chips_per_host_bounds,
        num_slices=num_slices,
    )
    return list(desc.devices)


def resolve_mesh(mesh_cfg: Any, chips: int, num_slices: int = 1) -> dict[str, int]:
    """The config's (data, fsdp, tensor) sizes on `chips` chips per slice; the data axis
    additionally spans the slices (data-parallel over DCN)."""
    sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
    free = [k for k, v in sizes.items() if v == -1]
    known = math.prod(v for v in sizes.values() if v != -1)
    if len(free) > 1 or any(v == 0 or v < -1 for v in sizes.values()):
        raise CompileError(f"mesh {sizes}: sizes must be positive, with at most one -1")
    if free:
        if chips % known:
            raise CompileError(
                f"mesh {sizes} does not fit {chips} chips: {known} does not divide {chips}; "
                "set mesh.data/fsdp/tensor so their product is the slice's chip count"
            )
        sizes[free[0]] = chips // known
    if math.prod(sizes.values()) != chips:
        raise CompileError(
            f"mesh {sizes} has {math.prod(sizes.values())} devices but the slice has {chips} chips; "
            "set mesh.data/fsdp/tensor so their product is the chip count (or one of them to -1)"
        )
    sizes["data"] *= num_slices
    return sizes


def make_mesh(devices: list[Any], sizes: dict[str, int], num_slices: int) -> Any:
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    from agentrefine_jax.sharding import MESH_AXES

    shape = tuple(sizes[a] for a in MESH_AXES)
    if num_slices > 1:
        ici = (shape[0] // num_slices, *shape[1:])
        arr = mesh_utils.create_hybrid_device_mesh(ici, (num_slices, 1, 1), devices=devices)
    else:
        try:
            arr = mesh_utils.create_device_mesh(shape, devices=devices)
        except NotImplementedError:  # e.g. tensor=4 on a 16x16 torus: split a physical axis
            arr = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    return Mesh(arr, MESH_AXES)


def lower_train_step(cfg: Any, sl: Slice, num_slices: int = 1) -> tuple[Any, dict[str, int]]:
    """The trainer's step lowered for the slice over abstract inputs (nothing allocated), and
    the mesh sizes it was lowered for; `.compile()` runs the XLA TPU compiler."""
    import jax

    from agentrefine_jax.train.loop import TrainingError, build_train_step

    if num_slices < 1:
        raise CompileError(f"--num-slices must be >= 1, got {num_slices}")
    sizes = resolve_mesh(cfg.mesh, sl.chips, num_slices)
    mesh = make_mesh(topology_devices(sl, num_slices), sizes, num_slices)
    try:
        # The LR schedule's length does not change the program's memory.
        fns, _ = build_train_step(cfg, mesh, total_steps=1000)
    except (TrainingError, ValueError) as e:
        raise CompileError(str(e)) from None

    def abstract(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    # The objective's batch: the packed arrays, and any its loss reads beside them (GRPO's rollouts').
    batch_shape = (cfg.train.global_batch_size, cfg.data.max_length)
    batch = {
        k: jax.ShapeDtypeStruct(batch_shape, dtype, sharding=fns.batch_sharding)
        for k, dtype in fns.batch_dtypes.items()
    }
    params = abstract(fns.abstract_params, fns.param_shardings)
    opt_state = abstract(fns.abstract_opt, fns.opt_shardings)
    return fns.train.lower(params, opt_state, batch), sizes


def compile_train_step(cfg: Any, sl: Slice, num_slices: int = 1) -> dict[str, Any]:
    """Compile the trainer's step for the slice; per-device bytes from the XLA TPU compiler."""
    t0 = time.perf_counter()
    lowered, sizes = lower_train_step(cfg, sl, num_slices)
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses a program that cannot fit HBM
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg and "Ran out of memory" not in msg:
            raise
        return _result(sl, num_slices, sizes, None, time.perf_counter() - t0, msg.strip().splitlines()[0])
    seconds = time.perf_counter() - t0
    return _result(sl, num_slices, sizes, compiled.memory_analysis(), seconds, None)


def compiler_versions() -> dict[str, str | None]:
    """The jax, jaxlib and libtpu that produced a figure: the TPU compiler's version moves a
    step's memory by 30-40% (docs/scale.md), so every reported number carries these."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"jax": version("jax"), "jaxlib": version("jaxlib"), "libtpu": version("libtpu")}


def _result(
    sl: Slice, num_slices: int, sizes: dict[str, int], mem: Any, seconds: float, error: str | None
) -> dict[str, Any]:
    hbm = sl.chip.hbm_bytes
    if mem is None:
        per_device = dict.fromkeys(("arguments", "outputs", "aliased", "temp", "total"))
        fits = False
    else:
        per_device = {
            "arguments": int(mem.argument_size_in_bytes),
            "outputs": int(mem.output_size_in_bytes),
            "aliased": int(mem.alias_size_in_bytes),
            "temp": int(mem.temp_size_in_bytes),
        }
        # What the device holds at peak: donated outputs reuse their inputs' buffers.
        per_device["total"] = (
            per_device["arguments"] + per_device["outputs"] - per_device["aliased"] + per_device["temp"]
        )
        fits = per_device["total"] <= hbm
    out: dict[str, Any] = {
        "versions": compiler_versions(),
        "topology": {
            "name": sl.name,
            "chips": sl.chips * num_slices,
            "num_slices": num_slices,
            "shape": sl.topology,
            "chips_per_host_bounds": list(sl.chips_per_host_bounds),
        },
        "mesh": sizes,
        "compiled": {
            "bytes_per_device": per_device,
            "fits": fits,
            "hbm_bytes": hbm,
            "compile_seconds": round(seconds, 2),
        },
    }
    if error:
        out["compiled"]["error"] = error
    return out


def check(cfg: Any, slice_name: str, num_slices: int = 1, name: str = "") -> dict[str, Any]:
    """Compile for the slice and put the planner's estimate for the same mesh beside it."""
    from agentrefine_jax.train import planner
    from agentrefine_jax.train.topology import get_slice

    sl = get_slice(slice_name)
    result = compile_train_step(cfg, sl, num_slices)
    planned = planner.plan(cfg, result["mesh"], sl.chip.name, name=name)
    compiled_total = result["compiled"]["bytes_per_device"]["total"]
    result["config"] = name
    result["planned"] = {
        "bytes_per_device": planned["bytes_per_device"],
        "fits": planned["fits"],
        "max_micro_batch_per_device": planned["max_micro_batch_per_device"],
    }
    result["planned_to_compiled"] = (
        planned["bytes_per_device"]["total"] / compiled_total if compiled_total else None
    )
    return result


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:,.2f} GiB"


def format_check(r: dict[str, Any]) -> str:
    t, c, b, v = r["topology"], r["compiled"], r["compiled"]["bytes_per_device"], r["versions"]
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    slices = f" x {t['num_slices']} slices" if t["num_slices"] > 1 else ""
    verdict = "FITS" if c["fits"] else "DOES NOT FIT"
    lines = [
        f"compile: {r['config']} train step on {t['name']}{slices} ({t['chips']} chips, {t['shape']}, "
        f"mesh {mesh})",
        f"  XLA TPU compiler    {c['compile_seconds']:.1f} s (libtpu {v['libtpu']}, jax {v['jax']}, "
        f"jaxlib {v['jaxlib']})",
        "  bytes per device (compiler)",
        f"    arguments         {_gib(b['arguments'])}",
        f"    outputs           {_gib(b['outputs'])}",
        f"    aliased           {_gib(b['aliased'])}",
        f"    temp              {_gib(b['temp'])}",
        f"    total             {_gib(b['total'])} of {_gib(c['hbm_bytes'])} HBM -> {verdict}",
        f"  planner estimate    {_gib(r['planned']['bytes_per_device']['total'])}"
        + (f" ({r['planned_to_compiled']:.2f}x the compiler)" if r["planned_to_compiled"] else ""),
    ]
    if c.get("error"):
        lines.append(f"  compiler: {c['error']}")
    return "\n".join(lines)


def compile_check(config: str, overrides: list[str], topology: str | None, num_slices: int) -> dict[str, Any]:
    """`plan --compile` / `train --compile-only` for config `config` on slice `topology`.

    Raises CompileError (or the config loader's errors) for bad input; the CLIs print the report.
    """
    from agentrefine_jax.train.topology import get_slice

    if not topology:
        raise CompileError("--topology is required for the compile check (e.g. --topology v5p-64)")
    sl = get_slice(topology)
    # Compile on this host's CPU backend; libtpu only provides the slice's compiler.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    prepare_tpu_env(sl.name)
    from agentrefine_jax.config import load_config

    return check(load_config(config, overrides), sl.name, num_slices, name=config)
