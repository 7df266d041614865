"""The trainer's re-exec with glibc's huge-page tunable (AGENTREFINE_HUGE_PAGES=1): same process,
real kernel page faults.

The probe mallocs and touches 256 MiB through glibc (as XLA's CPU runtime does); with the
tunable glibc asks for transparent huge pages and the kernel faults it in 2 MiB pages."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from agentrefine_jax import host_memory

PAGES = (256 << 20) // 4096
PROBE = textwrap.dedent(
    f"""
    import ctypes, os, resource
    print("start", os.getpid(), flush=True)
    from agentrefine_jax import host_memory
    host_memory.relaunch_with_huge_pages()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc({PAGES * 4096})
    ctypes.memset(p, 1, {PAGES * 4096})
    print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print("tunables", os.environ.get("GLIBC_TUNABLES"))
    """
)


def _probe(**env: str) -> tuple[list[str], int, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.ENV)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split("\n")  # fmt: skip
    starts = [line for line in out if line.startswith("start ")]
    faults = int(next(line for line in out if line.startswith("faults ")).split()[1])
    tunables = next(line for line in out if line.startswith("tunables ")).split(" ", 1)[1]
    return starts, faults, tunables


def _wanted_here() -> bool:
    """Whether the tunable can apply on this host (asked for, on CPU, nothing set)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(host_memory.ENV, "1")
        mp.setenv("JAX_PLATFORMS", "cpu")
        mp.delenv("GLIBC_TUNABLES", raising=False)
        return host_memory.wanted()


def test_asked_for_a_cpu_run_reexecutes_once_in_place_and_faults_in_huge_pages():
    if not _wanted_here():
        pytest.skip("this host has no glibc >= 2.35 with transparent huge pages in madvise mode")
    starts, faults, tunables = _probe(**{host_memory.ENV: "1"})
    assert len(starts) == 2 and starts[0] == starts[1], starts  # ran twice, as the same pid
    assert tunables == host_memory.TUNABLE
    assert faults < PAGES // 10, faults  # 2 MiB pages: 128 faults for 256 MiB, plus a few
    # The user's own tunables are kept.
    _, _, kept = _probe(**{host_memory.ENV: "1", "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
    assert kept == f"glibc.malloc.arena_max=4:{host_memory.TUNABLE}"


def test_by_default_on_an_accelerator_or_with_a_set_tunable_the_process_stays_as_started():
    off = "glibc.malloc.hugetlb=0"
    on = {host_memory.ENV: "1"}
    for env in ({}, {host_memory.ENV: "0"}, {**on, "JAX_PLATFORMS": "tpu"}, {**on, "GLIBC_TUNABLES": off}):
        starts, faults, tunables = _probe(**env)
        assert len(starts) == 1, (env, starts)
        assert tunables == env.get("GLIBC_TUNABLES", "None"), env
        if "JAX_PLATFORMS" not in env:
            assert faults >= PAGES * 9 // 10, (env, faults)  # 4 KiB pages: one fault each


def test_a_bad_value_is_one_line_and_exit_2_before_anything_runs(tmp_path):
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", "tiny"]
    cmd += ["--set", f"train.run_dir={run_dir}"]
    out = subprocess.run(
        cmd,
        env={**base, host_memory.ENV: "yes"}, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert out.stdout == "" and out.stderr.splitlines() == [
        f"[train] error: {host_memory.ENV} must be 0 or 1, got 'yes'"
    ], out
    assert not run_dir.exists()  # refused before anything ran


HEAP_PROBE = textwrap.dedent(
    """
    import ctypes, sys, threading
    from agentrefine_jax import host_memory
    if sys.argv[1] == "bound":
        assert host_memory.bound_heap()
    elif sys.argv[1] != "default":  # a tool's entry point (its --help), then the same work
        import contextlib, importlib, io
        sys.argv = [sys.argv[1], "--help"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            importlib.import_module(sys.argv[0]).entry()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024

    pins = []

    def work():  # a request's worth of 512 KiB buffers, then a small object that outlives them
        for _ in range(3):
            big = [libc.malloc(512 * 1024) for _ in range(64)]
            for p in big:
                ctypes.memset(p, 1, 512 * 1024)
            pins.append(libc.malloc(64))
            for p in big:
                libc.free(p)

    before = rss()
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(rss() - before)
    """
)


def test_bound_heap_gives_freed_buffers_back_whatever_thread_freed_them():
    """The server's heap policy (host_memory.bound_heap): 8 threads each free 3 x 32 MiB of buffers
    under a live small object. With glibc's defaults the first free raises the mmap threshold, the
    later buffers come from each thread's own arena and stay there (~256 MB kept); bounded, every
    such buffer is mmapped and goes back to the kernel when freed."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's allocator only")

    def kept_mb(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, timeout=120, check=True
        )
        return int(out.stdout)

    assert kept_mb("default") >= 100
    assert kept_mb("bound") <= 16


@pytest.mark.parametrize("tool", ["agentrefine_jax.eval.__main__", "agentrefine_jax.inference.__main__"])
def test_long_running_tools_bound_their_heap_first(tool):
    """Eval and the server run for hours replacing large arrays (an episode's KV cache takes a new
    length every few turns; SmolLM2, 4 conversations growing to 3.5k tokens: peak RSS 3.9 GB for a
    0.75 GB cache with glibc's defaults, 2.7 GB bounded): their entry points bound the heap first."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's allocator only")
    out = subprocess.run(
        [sys.executable, "-c", HEAP_PROBE, tool], capture_output=True, text=True, timeout=240, check=True
    )
    assert int(out.stdout) <= 16, out.stdout
