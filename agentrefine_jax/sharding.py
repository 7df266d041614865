"""Logical-axis sharding: names on parameters/activations, mapped to mesh axes by rules.

Models only ever say *what* a dimension is ("embed", "heads", "batch"); which mesh axis
shards it is decided here from the config's rules. A dimension that a mesh axis does not
divide evenly is replicated rather than failing, so tiny test models run on any mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

MESH_AXES = ("data", "fsdp", "tensor")
Rules = Sequence[tuple[str, Any]]

# Logical axis name -> mesh axis (or tuple of mesh axes, or None for replicated): the default of
# `mesh.rules` in the config, and what a loader uses when it is given no rules.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("activation_seq", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # Routed experts (MoE families): the expert axis of the stacked expert weights is split over
    # tensor x fsdp, tensor-major: rank t of `tensor` holds experts [t*E/tp, (t+1)*E/tp) (split
    # again over fsdp), the slice it computes with under expert parallelism (models/moe.py; the
    # execution plan chooses it when tensor > 1 divides E): the step gathers only that slice, over
    # fsdp. With tensor = 1 this is E over fsdp, gathered whole as FSDP gathers a dense weight. An
    # expert's MLP width goes to tensor only when E does not divide (each mesh axis is used once).
    # The router's expert axis stays replicated.
    ("experts", ("tensor", "fsdp")),
    ("moe_mlp", "tensor"),
    ("router_experts", None),
)


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]


_CONTEXT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar(
    "agentrefine_sharding", default=None
)


def parse_mesh_sizes(text: str) -> dict[str, int]:
    """`fsdp=64,tensor=4` -> {"fsdp": 64, "tensor": 4}; the one parser behind every `--mesh` flag.

    Sizes must be positive or -1 ("the remaining devices"); ValueError names the bad part.
    """
    sizes: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"--mesh expects axis=size pairs like fsdp=64,tensor=4; got {part!r}")
        name, value = (x.strip() for x in part.split("=", 1))
        if name not in MESH_AXES:
            raise ValueError(f"--mesh: unknown axis {name!r}; choose from {MESH_AXES}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh: {name}={value!r} is not an integer") from None
        if sizes[name] == 0 or sizes[name] < -1:
            raise ValueError(f"--mesh: {name}={sizes[name]}: sizes must be positive (or -1 for 'the rest')")
    return sizes


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one axis may be -1 to take the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    unknown = [k for k, v in sizes.items() if v == -1]
    if len(unknown) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    known = math.prod(v for v in sizes.values() if v != -1)
    if unknown:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh {sizes}")
        sizes[unknown[0]] = len(devices) // known
    total = math.prod(sizes.values())
    if total != len(devices):
        raise ValueError(f"mesh {sizes} needs {total} devices, {len(devices)} available")
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        arr = jax.experimental.mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # CPU / odd topologies: plain row-major placement is fine
        arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES)


def logical_to_spec(
    names: Sequence[str | None], rules: Rules, shape: Sequence[int] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """Map logical names to a PartitionSpec; each mesh axis is used at most once."""
    table = dict(rules)
    used: set[str] = set()
    out: list[Any] = []
    for i, name in enumerate(names):
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if shape is not None and axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def spec_size(entry: Any, mesh: Mesh | Any) -> int:
    """How many devices one PartitionSpec entry (None, an axis name or a tuple of them) splits over."""
    if entry is None:
        return 1
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[a] for a in axes)


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: Rules) -> Iterator[ShardingContext]:
    """Activate mesh + rules so `constrain` annotates activations while tracing."""
    ctx = ShardingContext(mesh, tuple(rules))
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def current() -> ShardingContext | None:
    return _CONTEXT.get()


def mesh_platform() -> str:
    """Platform of the devices the current trace targets: the active mesh's, else the default's
    (an ahead-of-time compile for a TPU slice on a CPU host targets "tpu")."""
    ctx = current()
    devices = getattr(ctx.mesh, "devices", None) if ctx is not None else None
    if devices is not None and getattr(devices, "size", 0):
        return devices.flat[0].platform
    return jax.devices()[0].platform


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding hint for an activation; a no-op outside `use_sharding`."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    spec = logical_to_spec(names, ctx.rules, x.shape, ctx.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedSharding for every leaf of an nnx State (or a tree of ShapeDtypeStructs under Variables).

    Variables without `axes` metadata (e.g. RNG counters) are replicated.
    """

    def one(v: Any) -> Any:
        if isinstance(v, nnx.Variable):
            value = v.get_value()
            names = v.get_metadata().get("axes")
            shape = getattr(value, "shape", ())
            spec = logical_to_spec(names, rules, shape, mesh) if names else PartitionSpec()
            return v.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=_is_var)


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
    """Sharding for a [batch, seq, ...] input array."""
    names = ("batch",) + (None,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(names, rules, None, mesh))


def param_shardings(params: nnx.State, mesh: Mesh | None, rules: Rules | None = None) -> Any:
    """Per-leaf shardings of a parameter state as a pure dict: from the logical axes on `mesh`
    (`DEFAULT_RULES` unless given), or the first device when `mesh` is None."""
    if mesh is None:
        single = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: single, nnx.to_pure_dict(params))
    return nnx.to_pure_dict(state_shardings(params, mesh, DEFAULT_RULES if rules is None else rules))
