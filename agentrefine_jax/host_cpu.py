"""The host's CPU as the kernel names it (/proc/cpuinfo): the one reader for what depends on the CPU kind —
the compiled-program cache's directory (compile_cache.py), the measured matmul peak's key (train/cpu_peak.py)
and the machine every benchmark's JSON records (benchmarks/_machine.py). The same code runs at different
speeds, and XLA:CPU compiles different programs, on an Intel Xeon with AMX and an AMD EPYC without it."""

from __future__ import annotations

import dataclasses
import platform

CPUINFO = "/proc/cpuinfo"


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    model: str  # the first processor's "model name" ("" where the file names none)
    flags: frozenset[str]  # its feature flags (x86 "flags", arm64 "Features")


def parse(text: str) -> CpuInfo:
    """The first processor's model name and feature flags (the others repeat them on the hosts we run)."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        if model and flags is not None:
            break
    return CpuInfo(model, flags or frozenset())


def read(path: str = CPUINFO) -> CpuInfo | None:
    """This host's CPU; None where the file cannot be read (not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse(f.read())
    except OSError:
        return None


def model_name(info: CpuInfo | None) -> str:
    """`info`'s model name (`read()`'s: None where there is no cpuinfo), or what `platform` says where the
    kernel names none."""
    return (info.model if info is not None else "") or platform.processor() or platform.machine()
