"""gs:// access settings: one place that points every library the project uses for URLs at the
same endpoint, a real bucket or a GCS emulator.

Two clients touch a gs:// run dir: Orbax writes arrays through TensorStore's own HTTP client,
and everything else (manifests, metrics, TensorBoard events, exports) goes through
`etils.epath` -> fsspec/gcsfs. Only gcsfs (like google-cloud-storage) reads the standard
`STORAGE_EMULATOR_HOST`; TensorStore would keep talking to storage.googleapis.com, splitting
one run between the emulator and a real bucket. So when `STORAGE_EMULATOR_HOST` is set,
`configure()` fills in (never overriding what the environment already says):

  TENSORSTORE_GCS_HTTP_URL           TensorStore's endpoint: the emulator
  GOOGLE_AUTH_TOKEN_FOR_TESTING      TensorStore: a fixed bearer token instead of credential
                                     discovery (which would probe the GCE metadata server)
  fsspec config gcs token "anon"     gcsfs: anonymous, as google-cloud-storage does for an emulator
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT  "false": no gRPC bucket-layout probe per bucket (an
                                     emulator has no gRPC control plane; each probe waits 60 s)
  Orbax's TensorStore context        at most 3 retries per request: an emulator on this machine
                                     has no transient failures, a refused connection means it is
                                     gone, and TensorStore's default (32 retries up to 32 s apart)
                                     would hold a failed save for ~15 minutes

Without `STORAGE_EMULATOR_HOST` nothing changes: each library finds real credentials its own way.
"""

from __future__ import annotations

import logging
import os

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_configured_for: tuple[str | None] | None = None  # the STORAGE_EMULATOR_HOST last configured


def emulator_url() -> str | None:
    """The emulator's base URL from `STORAGE_EMULATOR_HOST` (scheme added as gcsfs does), or None."""
    host = os.environ.get(EMULATOR_ENV, "").strip()
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def configure() -> None:
    """Point TensorStore and gcsfs at `STORAGE_EMULATOR_HOST` if it is set (idempotent).

    Must run before gcsfs is imported (it reads its feature switch at import) and before
    TensorStore opens its first gs:// store; `checkpoint.as_path` calls it for every gs:// path.
    """
    global _configured_for
    url = emulator_url()
    if _configured_for == (url,):
        return
    _configured_for = (url,)
    _one_line_gcsfs_errors()
    if url is None:
        return
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec.config  # read at import from FSSPEC_* variables; set here in case it already ran

    fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")
    _bound_tensorstore_retries()


EMULATOR_RETRIES = {"max_retries": 3, "initial_delay": "0.2s", "max_delay": "1s"}


def _bound_tensorstore_retries() -> None:
    # Orbax builds every TensorStore context from these two dicts (no public option for it); if a
    # future Orbax renames them, TensorStore's default retries apply: slower to fail, still correct.
    from orbax.checkpoint._src.serialization import tensorstore_utils

    for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
        base = getattr(tensorstore_utils, name, None)
        if isinstance(base, dict):
            base.setdefault("gcs_request_retries", dict(EMULATOR_RETRIES))


class _DropRaisedErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info)


def _one_line_gcsfs_errors() -> None:
    """gcsfs logs every request that ran out of retries with a full traceback, then raises the
    same error to its caller; the project reports that error itself, in one line."""
    gcsfs_logger = logging.getLogger("gcsfs")
    if not any(isinstance(f, _DropRaisedErrors) for f in gcsfs_logger.filters):
        gcsfs_logger.addFilter(_DropRaisedErrors())
