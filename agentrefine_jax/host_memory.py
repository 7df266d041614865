"""glibc's heap for long-lived processes, and huge pages for XLA's CPU buffers on request.

`bound_heap()` (the server calls it first thing): a process that runs for days must give memory
back. With glibc's defaults it did not: the thread-pool server's RSS went 801 -> 1,559 MB over four
10 MB requests and kept rising over mixed ones. Two causes, each measured on that server (RSS after
four 10 MB prompts, then 60 mixed ones): every thread that mallocs under contention gets an arena
of its own (up to 8 per core) and each arena keeps the peak its thread once reached (its 8 workers,
the tokenizer's threads: 874 -> 1,500 -> 1,606 MB; with 2 arenas: 1,084 flat, then 1,023); and
glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so later
large buffers come from those arenas instead of mmap and stay (a fixed 1 MiB threshold: 1,076
flat). `bound_heap` caps the arenas and fixes the threshold (mallopt), before any thread starts:
the new server, fed 300 prompts just under its size bound (tokenized, then refused), 775 -> 790 MB
from the 50th on (glibc's defaults: 858 -> 961 and rising). A setting the user made
(MALLOC_ARENA_MAX / MALLOC_MMAP_THRESHOLD_, or the same in GLIBC_TUNABLES) is left as it is.

Huge pages for XLA's CPU buffers, on request: with `AGENTREFINE_HUGE_PAGES=1` the trainer on a
CPU host re-executes itself once, at start-up, with glibc's `glibc.malloc.hugetlb=1` tunable.

Why it exists: XLA's CPU runtime takes each step's temporaries as one fresh `malloc` far above
glibc's mmap threshold, so every step maps, zero-fills page by page and unmaps them again. With
the ~200M-parameter model of `benchmarks/checkpoint_hashing.py` on the 2-core box: 2.1 GB of
4 KiB page faults per step, ~1/3 of the step's CPU in the kernel; with the tunable (glibc then
asks for transparent huge pages) 0.01 GB, the step 1.50 -> 1.13-1.21 s.
Why it is not the default: on the small model of `benchmarks/train_step.py` (4 layers, hidden
256) the same tunable made the step slower and far noisier (alternating runs: 0.99x / 1.00x torch
fp32 without it, 0.86x / 0.77x with it), most likely the kernel compacting memory for huge pages
on fault (THP defrag `madvise`). Whether it pays depends on the model's size and the host.

glibc reads tunables only when a process starts, hence the re-exec (same pid, same arguments,
interpreter flags included). It happens only where it can apply: Linux with glibc >= 2.35,
transparent huge pages in `madvise` mode (with `always` the kernel already uses them; with
`never` nothing would), a host-only run (JAX_PLATFORMS=cpu, or no TPU/GPU device files), and the
tunable not already set.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
ARENA_MAX = 4  # malloc arenas (glibc's default: 8 per core, each keeping its own peak)
MMAP_THRESHOLD = 256 * 1024  # blocks from this size on are mmapped, and unmapped when freed
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt's parameter numbers (malloc.h)
ENV = "AGENTREFINE_HUGE_PAGES"  # "1": ask for the re-exec
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def bound_heap() -> bool:
    """Cap glibc's malloc arenas at ARENA_MAX and fix its mmap threshold at MMAP_THRESHOLD (see the
    module doc); True when applied. Call before the process starts threads: an arena limit counts
    from the arenas that exist (glibc fixes the limit when it first needs one beyond its 8th).
    Not glibc (or no mallopt): nothing to do."""
    if platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    ok = True
    for param, value, env, tunable in (
        (_M_ARENA_MAX, ARENA_MAX, "MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    ):
        if env not in os.environ and tunable not in tunables:
            ok = bool(mallopt(param, value)) and ok
    return ok


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
    """Whether this process should re-execute itself with the tunable (see the module doc).
    Raises ValueError when the variable holds anything but 0 or 1 (not silently ignored)."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    if not sys.platform.startswith("linux") or value != "1":
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


@dataclasses.dataclass(frozen=True)
class MemoryNow:
    """Bytes: this process's resident set and its high-water mark, the host's available and total memory."""

    rss: int
    peak: int
    available: int
    total: int


def memory_now() -> MemoryNow | None:
    """This process's and the host's memory now, from /proc (Linux); None where /proc does not say.

    Why: a long evaluation's KV cache grows with its episodes' histories; the miniature's base model on
    PDDL (16 episodes in flight, ~30 turns in) reached 18 GB and the kernel killed it without a word in
    its log. Eval's progress line shows these figures, and warns while the host runs low."""
    try:
        mine = _proc_fields("/proc/self/status", ("VmRSS", "VmHWM"))
        host = _proc_fields("/proc/meminfo", ("MemAvailable", "MemTotal"))
    except (OSError, ValueError):
        return None
    if len(mine) < 2 or len(host) < 2:
        return None
    return MemoryNow(mine["VmRSS"], mine["VmHWM"], host["MemAvailable"], host["MemTotal"])


def _proc_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """`name: <n> kB` lines of a /proc file, in bytes."""
    out: dict[str, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in names:
                out[name] = int(rest.split()[0]) * 1024
    return out
