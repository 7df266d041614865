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

Without `STORAGE_EMULATOR_HOST` nothing changes: each library finds real credentials its own way.
"""

from __future__ import annotations

import os

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_configured = False


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
    global _configured
    if _configured:
        return
    _configured = True
    url = emulator_url()
    if url is None:
        return
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec.config  # read at import from FSSPEC_* variables; set here in case it already ran

    fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")
