"""Process start-up for every CLI: no noise on a normal run (one place, called by `cli_errors.run_main`).

A successful CPU run prints only the tool's own lines. Three libraries would otherwise add theirs:
libtpu (installed with the `tpu`/`test` extras) loads on a host without TPU chips when JAX probes
its plugins and prints "could not determine TPU accelerator type" and E0000 "unexpected worker
hostname" lines; transformers without PyTorch prints "PyTorch was not found" (an advisory: this
project uses transformers for tokenizers and configs only); Orbax warns "Waiting for previous save
to complete took ... s" through absl when a checkpoint save waits for the previous one (by design
in a short CPU run that checkpoints often, not a problem to report).

Nothing here hides errors, and the env defaults are only filled where unset.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from agentrefine_jax import compile_cache


def prepare_tpu_env(accelerator: str = "v5p-8") -> None:
    """Let libtpu initialise quietly on a host without TPU chips.

    Without these, loading libtpu on a non-TPU machine prints "could not determine TPU
    accelerator type" and an E0000 TPU_WORKER_HOSTNAMES error. Must run before JAX creates a
    backend. Only fills what is unset, and does nothing on a machine that has TPU chips (the
    real runtime there finds its pod through the metadata server).
    """
    if importlib.util.find_spec("libtpu") is None:
        return  # nothing would load libtpu (and synth/data need not import jax to learn that)
    try:
        from jax._src import hardware_utils

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return
    except Exception:  # private helper moved: setting defaults below is harmless on CPU
        pass
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # No chips to guard here, and several compile checks (tests, other users) may run at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


class _DropOrbaxSaveWait(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Waiting for previous save to complete")


def quiet_start() -> None:
    """Environment and log filters for a quiet run; call before jax, transformers or Orbax start."""
    compile_cache.enable()  # first: prepare_tpu_env imports jax where libtpu is installed
    prepare_tpu_env()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's C++ INFO/WARNING chatter
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from absl import logging as absl_logging  # Orbax logs through absl's logger
    except ImportError:
        return
    absl_logging.get_absl_logger().addFilter(_DropOrbaxSaveWait())
