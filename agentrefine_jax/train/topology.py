"""Cloud TPU chips and slices: the one table the planner, the AOT compile check and MFU read.

Cloud TPU names count TensorCores on v4 and v5p (2 per chip, run by JAX as one "megacore"
device) and chips on v5e (`v5litepod-N`) and v6e. So `v5p-64` is 32 chips / 32 JAX devices
and `v5e-256` is 256. Topology shapes and host sizes follow Google's published slice tables.
"""

from __future__ import annotations

import dataclasses
import math
import re

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    # Peak dense bf16 FLOP/s per chip (vendor specs).
    peak_flops: float
    cores_per_chip: int
    # libtpu's name for how the cores are exposed: "megacore" = one device per chip.
    chip_config_name: str
    # jax `device_kind` strings (lower case) of this chip; v5p reports plain "TPU v5".
    device_kinds: tuple[str, ...]
    # The number in a Cloud TPU name counts cores (v4, v5p) or chips (v5e, v6e).
    name_counts_cores: bool


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", 32 * GiB, 275e12, 2, "megacore", ("tpu v4",), True),
        Chip("v5p", 95 * GiB, 459e12, 2, "megacore", ("tpu v5", "tpu v5p"), True),
        Chip("v5e", 16 * GiB, 197e12, 1, "default", ("tpu v5 lite", "tpu v5e"), False),
        Chip("v6e", 32 * GiB, 918e12, 1, "default", ("tpu v6 lite", "tpu v6e"), False),
    )
}

# Chip count -> physical topology (3-D torus for v4/v5p, 2-D for v5e/v6e).
_SHAPES_3D = {
    4: (2, 2, 1),
    8: (2, 2, 2),
    16: (2, 2, 4),
    32: (2, 4, 4),
    64: (4, 4, 4),
    128: (4, 4, 8),
    256: (4, 8, 8),
    512: (8, 8, 8),
    1024: (8, 8, 16),
    2048: (8, 16, 16),
}
_SHAPES_2D = {
    1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)
}  # fmt: skip
_SIZES = {
    "v4": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    "v5p": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    "v5e": (1, 4, 8, 16, 32, 64, 128, 256),
    "v6e": (1, 4, 8, 16, 32, 64, 128, 256),
}
_ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True)
class Slice:
    """One Cloud TPU slice type, e.g. v5p-64."""

    name: str
    chip: Chip
    chips: int
    shape: tuple[int, ...]
    chips_per_host_bounds: tuple[int, int, int]

    @property
    def topology(self) -> str:
        """The name `jax.experimental.topologies.get_topology_desc` takes, e.g. "v5p:2x4x4"."""
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def cores(self) -> int:
        return self.chips * self.chip.cores_per_chip

    @property
    def hosts(self) -> int:
        return self.chips // math.prod(self.chips_per_host_bounds)


def _make(chip: Chip, n: int) -> Slice:
    chips = n // chip.cores_per_chip if chip.name_counts_cores else n
    if chip.name_counts_cores:
        shape: tuple[int, ...] = _SHAPES_3D[chips]
        hosts = (2, 2, 1)  # 4 chips per host
    else:
        shape = _SHAPES_2D[chips]
        # Up to 8 chips fit one host; larger slices are made of 4-chip hosts.
        hosts = (shape[0], shape[1], 1) if chips <= 8 else (2, 2, 1)
    return Slice(f"{chip.name}-{n}", chip, chips, shape, hosts)


SLICES: dict[str, Slice] = {f"{c}-{n}": _make(CHIPS[c], n) for c, sizes in _SIZES.items() for n in sizes}


class UnknownTopology(ValueError):
    """A slice or chip name that is not in the table."""


def get_slice(name: str) -> Slice:
    """`v5p-64`, `v5e-256`, `v5litepod-16`, `v6e-64`, `v4-32` -> its Slice (case-insensitive)."""
    key = name.strip().lower()
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", key)
    if m:
        key = f"{_ALIASES.get(m.group(1), m.group(1))}-{int(m.group(2))}"
    if key not in SLICES:
        raise UnknownTopology(f"unknown TPU slice {name!r}; known: {', '.join(SLICES)}")
    return SLICES[key]


def get_chip(name: str) -> Chip:
    if name not in CHIPS:
        raise UnknownTopology(f"unknown TPU chip {name!r}; known: {', '.join(CHIPS)}")
    return CHIPS[name]


def chip_of_device_kind(kind: str) -> Chip | None:
    kind = kind.lower().strip()
    return next((c for c in CHIPS.values() if kind in c.device_kinds), None)


HBM_BYTES = {c.name: c.hbm_bytes for c in CHIPS.values()}
PEAK_FLOPS = {c.name: c.peak_flops for c in CHIPS.values()}
