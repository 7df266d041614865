"""Huge pages for XLA's CPU buffers: the trainer on a CPU host re-executes itself once, at
start-up, with glibc's `glibc.malloc.hugetlb=1` tunable.

Why: XLA's CPU runtime takes each step's temporaries (gradients, activations) as one fresh
`malloc` far above glibc's mmap threshold, so every step maps, zero-fills page by page and unmaps
them again. Measured on the 2-core box with the ~200M-parameter model of
`benchmarks/checkpoint_hashing.py`: 2.1 GB of page faults per step, ~1/3 of the step's CPU time
in the kernel; with the tunable (glibc then asks for transparent huge pages, `madvise`) 0.01 GB,
the step 1.50 -> 1.17 s, and the copy a checkpoint save makes 0.93 -> 0.34 s, as the faults and
the save's writes no longer contend in the kernel. The numbers are the same: only where memory
comes from changes.

glibc reads tunables only when a process starts, hence the re-exec (same pid, same arguments,
interpreter flags included). It happens only where it can help and changes nothing else: Linux
with glibc >= 2.35, transparent huge pages in `madvise` mode (with `always` the kernel already
uses them; with `never` nothing would), a host-only run (JAX_PLATFORMS=cpu, or no TPU/GPU device
files), and not already set. `AGENTREFINE_HUGE_PAGES=0` keeps the process as started.
"""

from __future__ import annotations

import glob
import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "AGENTREFINE_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_at_least(major: int, minor: int) -> bool:
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        got = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return got >= (major, minor)


def _host_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms == "cpu"
    accelerators = glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*") + glob.glob("/dev/nvidia[0-9]*")
    return not accelerators


def wanted() -> bool:
    """Whether this process should re-execute itself with the tunable (see the module doc)."""
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT, "1") == "0":
        return False
    if "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # already set: by us before the re-exec, or by the user
    try:
        with open(_THP_MODE) as f:
            if "[madvise]" not in f.read():
                return False
    except OSError:
        return False
    return _glibc_at_least(2, 35) and _host_only()


def relaunch_with_huge_pages() -> None:
    """Re-execute the current command with the tunable when `wanted()`; otherwise return.
    Call first thing in a CLI entry point (nothing started or printed yet)."""
    if not wanted():
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES"), TUNABLE) if x)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:  # cannot exec (a sandbox, a vanished interpreter): run as started
        return
