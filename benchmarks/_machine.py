"""What a benchmark figure was measured on: the CPU model, its vector ISA, the XLA flags in effect.

The same benchmark gives different ratios on an Intel Xeon with AVX-512-BF16 and AMX (where PyTorch's
oneDNN uses them) and on an AMD EPYC without AMX, so every benchmark's JSON carries `machine()` and
its header prints `header()`: a figure without its CPU kind cannot be compared with another.

ISA flags are read from /proc/cpuinfo's `flags` line (agentrefine_jax/host_cpu.py; the kernel's names, as
`lscpu` shows them):
the AVX-512 subsets that matter for float32/bfloat16 matmuls, AMX (tile + bf16) and AVX2.
XLA flags: the `XLA_FLAGS` environment variable as this process sees it (the benchmarks that start
workers record the child's, which they set). The execution plan (models/execution.py) sets no XLA
flags today; when it does, `PLAN_XLA_FLAGS` is where they are recorded.
"""

from __future__ import annotations

import os
from typing import Any

from agentrefine_jax import host_cpu

# Kernel flag names (arch/x86/include/asm/cpufeatures.h) worth naming beside a CPU figure.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

# XLA flags the execution plan itself sets (none today): recorded with the environment's.
PLAN_XLA_FLAGS: tuple[str, ...] = ()


def _described(cpu: host_cpu.CpuInfo) -> dict[str, Any]:
    return {"cpu_model": cpu.model, "isa": {f: f in cpu.flags for f in ISA_FLAGS}}


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The first processor's model name and the ISA flags above that it has (True/False each)."""
    return _described(host_cpu.parse(text))


def machine(xla_flags: str | None = None) -> dict[str, Any]:
    """This host's CPU, ISA, cores and the XLA flags in effect (`xla_flags`: a child process's, when a
    benchmark sets them for its workers rather than for itself)."""
    cpu = host_cpu.read()
    # Not Linux: the model from `platform`, the ISA unknown.
    info = {"cpu_model": "", "isa": {}} if cpu is None else _described(cpu)
    info["cpu_model"] = host_cpu.model_name(cpu)
    env = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {
        **info,
        "cores": cores,
        "load": os.getloadavg()[0],
        "xla_flags": {"env": env, "plan": list(PLAN_XLA_FLAGS)},
    }


def header(info: dict[str, Any] | None = None) -> str:
    """One line for a benchmark's header: `cpu: <model>; isa: ...; XLA_FLAGS: ...; load ...`."""
    info = info or machine()
    isa = " ".join(f for f, on in info["isa"].items() if on) or "-"
    flags = " ".join([info["xla_flags"]["env"], *info["xla_flags"]["plan"]]).strip() or "(none)"
    cpu = f"{info['cpu_model']} ({info['cores']} cores)"
    return f"cpu: {cpu}; isa: {isa}; XLA flags: {flags}; load {info['load']:.2f}"
