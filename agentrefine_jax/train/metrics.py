"""What a run records: metrics.jsonl (+ TensorBoard), written once per step even across resumes."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import jax

from agentrefine_jax.checkpoint import is_url
from agentrefine_jax.train.run_dir import RunPaths

log = logging.getLogger(__name__)


def json_row(row: dict[str, Any]) -> str:
    """One JSON line; NaN/inf become null (bare NaN is not JSON)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard). On resume from step k, rows past k are dropped first: those
    steps are trained again, and a step must appear once. Remote run dirs (object stores cannot
    append) get the whole file rewritten, at most every `remote_flush_s` and on close."""

    remote_flush_s = 30.0

    def __init__(self, paths: RunPaths, resume_step: int = 0) -> None:
        self.enabled = jax.process_index() == 0
        self._tb = None
        self._file: Any = None
        if not self.enabled:
            return
        paths.root.mkdir(parents=True, exist_ok=True)
        self._path = paths.metrics
        self._remote = is_url(paths.root)
        self._lines = self._kept_lines(resume_step)
        self._last_flush = 0.0
        if not self._remote:
            self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(paths.tensorboard))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is the record.
            self._tb = None
        except Exception as e:  # noqa: BLE001 - e.g. a URL scheme tensorboardX cannot write
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
        if self._remote:
            self._lines.append(line)
            if time.monotonic() - self._last_flush > self.remote_flush_s:
                self._flush_remote()
        else:
            self._file.write(line + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(k, v, row["step"])

    def _flush_remote(self) -> None:
        self._path.write_text("".join(x + "\n" for x in self._lines))
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._remote:
            self._flush_remote()
        elif self._file is not None and not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
