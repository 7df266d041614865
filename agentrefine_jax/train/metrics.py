"""What a run records: metrics.jsonl (+ TensorBoard), written once per step even across resumes."""

from __future__ import annotations

import json
import logging
import math
import pathlib
import tempfile
import time
from typing import Any

import jax

from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import is_url
from agentrefine_jax.train.run_dir import RunPaths

log = logging.getLogger(__name__)


def json_row(row: dict[str, Any]) -> str:
    """One JSON line; NaN/inf become null (bare NaN is not JSON)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json_dumps(clean)


# Imported by tensorboardX at module level but never needed by this writer, which is handed Python
# floats only and always writes its event files to a local directory (a gs:// run dir's events go
# to a local temporary directory and are copied beside metrics.jsonl). torch would let it accept
# torch tensors (~2 s where installed: 1.6-2.4 s on this project's 2-core AMD box); boto3 and
# google-cloud-storage back its own s3:// and gs:// event writers (google-cloud-storage is installed
# with gcsfs, our gs:// support, and pulls in requests, google-auth and grpc: ~0.2 s idle, ~0.4 s on
# a busy 2-core box, paid by every trainer, eval and server process).
_UNNEEDED_BY_TENSORBOARDX = ("torch", "boto3", "google.cloud.storage")


def _summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported without the modules it would load but not need here.

    Hiding a module for that one import (`sys.modules[name] = None` makes `import name` raise
    ImportError) makes tensorboardX take its branch without it; a module some other code has already
    loaded is left alone, and every hidden one stays importable afterwards.
    """
    import sys

    hidden = [name for name in _UNNEEDED_BY_TENSORBOARDX if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]
    return SummaryWriter


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard). On resume from step k, rows past k are dropped first: those
    steps are trained again, and a step must appear once.

    Object stores (gs://) cannot append: there the rows are kept in memory and the whole file is
    rewritten, with TensorBoard's event files (written to a local temporary directory) copied
    beside it — at most every `remote_flush_s`, before every checkpoint (`sync`: the rows of every
    step a resume would not train again are stored before its checkpoint exists) and on close.
    A failed periodic copy is retried at the next one; a failed `sync` stops the run."""

    remote_flush_s = 30.0

    def __init__(self, paths: RunPaths, resume_step: int = 0) -> None:
        self.enabled = jax.process_index() == 0
        self._tb = None
        self._file: Any = None
        self._tb_local: tempfile.TemporaryDirectory[str] | None = None
        self._unreachable = False
        if not self.enabled:
            return
        paths.root.mkdir(parents=True, exist_ok=True)
        self._path = paths.metrics
        self._tb_dir = paths.tensorboard
        self._remote = is_url(paths.root)
        self._lines = self._kept_lines(resume_step)
        self._last_flush = time.monotonic()
        if not self._remote:
            self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        try:
            SummaryWriter = _summary_writer_class()
            if self._remote:
                self._tb_local = tempfile.TemporaryDirectory(prefix="agentrefine-tensorboard-")
            self._tb = SummaryWriter(self._tb_local.name if self._tb_local else str(self._tb_dir))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is the record.
            self._tb = None
        except Exception as e:  # noqa: BLE001 - an unwritable directory must not stop training
            log.warning(f"WARNING: TensorBoard disabled ({type(e).__name__}: {e}); metrics.jsonl is written")
            self._tb = None

    def _kept_lines(self, resume_step: int) -> list[str]:
        if not self._path.exists():
            return []
        kept, dropped, broken = [], 0, 0
        for line in self._path.read_text().splitlines():
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                broken += 1  # e.g. a line cut short by a kill
                continue
            if step > resume_step:
                dropped += 1
            else:
                kept.append(line)
        if dropped or broken:
            log.info(
                f"metrics.jsonl: dropped {dropped} row(s) past step {resume_step} (trained again now)"
                + (f" and {broken} unreadable line(s)" if broken else "")
            )
            self._path.write_text("".join(x + "\n" for x in kept))
        return kept

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json_row(row)
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(k, v, row["step"])
        if not self._remote:
            self._file.write(line + "\n")
            return
        self._lines.append(line)
        if time.monotonic() - self._last_flush > self.remote_flush_s:
            try:
                self._flush_remote()
            except Exception as e:  # noqa: BLE001 - kept in memory; `sync` or close stores it
                log.debug(f"metrics: periodic copy to {self._path} failed ({type(e).__name__}: {e})")

    def sync(self) -> None:
        """Store every row written so far (before a checkpoint). Raises when storage fails."""
        if self.enabled and self._remote:
            try:
                self._flush_remote()
            except Exception:
                self._unreachable = True
                raise

    def _flush_remote(self) -> None:
        self._last_flush = time.monotonic()  # a failing store is not retried at every row
        self._path.write_text("".join(x + "\n" for x in self._lines))
        if self._tb is not None and self._tb_local is not None:
            self._tb.flush()
            local = pathlib.Path(self._tb_local.name)
            for f in sorted(local.iterdir()):  # one events file per run; rewritten whole
                (self._tb_dir / f.name).write_bytes(f.read_bytes())

    def close(self, *, failing: bool = False, storage_failed: bool = False) -> None:
        """Close the files. `failing`: the run is already stopping on an error, so a failed final
        copy to object storage is not reported again (every row up to the last checkpoint was
        stored by `sync`, and a resume trains the later steps again). `storage_failed`: a save to
        the same storage just failed, so the copy is not tried (its retries take a minute)."""
        if not self.enabled:
            return
        if self._remote and (storage_failed or self._unreachable):
            log.debug(f"metrics: storage failed; rows after the last checkpoint not copied to {self._path}")
        elif self._remote:
            try:
                self._flush_remote()
            except Exception as e:  # noqa: BLE001
                note = f"metrics: final copy to {self._path} failed ({type(e).__name__}: {e})"
                (log.debug if failing else log.warning)(note if failing else f"WARNING: {note}")
        elif self._file is not None and not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._tb_local is not None:
            self._tb_local.cleanup()
            self._tb_local = None


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
