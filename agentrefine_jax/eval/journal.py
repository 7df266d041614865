"""The episode journal: every finished episode appended durably, so a killed evaluation resumes.

A paper-sized run is hours of episodes; `--out` is written once, at the end, atomically. Beside it the journal
(`journal_path(out)`) receives one JSON line per finished episode as it ends (flushed and fsync'd): its key
(which phase, task, variant, episode, sample) and its record. Re-running the same command reads the journal
back, skips the episodes it holds and appends the rest; the results equal an uninterrupted run's. The first
line is a header naming the command's settings: a journal written by another command is refused with one
line rather than mixed in. The header also names the model the episodes came from (`model_identity`: the
checkpoint step and its parameters' fingerprint, or the endpoint and model name): a rerun whose `--checkpoint`
now resolves to another step (a run that saved a newer one meanwhile) is refused in one line, never resumed
into a result of two models. A write failure (a full disk) warns once and the evaluation goes on without it.

A kill can cut the last line short; the reader drops a line that does not end in a newline (truncating the
file there before appending), never a complete one.

Each line also says which *sitting* (invocation) wrote it and how long that sitting had run when the episode
ended, so a result resumed over several sittings reports the evaluation time of all of them (each earlier
sitting counted up to its last journaled episode: what it ran after that, episodes in flight when it was
killed, produced nothing kept), not only the last sitting's — an evaluation's episodes per hour stay true.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from agentrefine_jax import faults, outputs
from agentrefine_jax.eval.model_identity import describe, resumable
from agentrefine_jax.outputs import json_dumps as dumps

FORMAT = "agentrefine_jax.eval/journal/1"
SUFFIX = ".journal.jsonl"
NAME_BYTES = 200  # names longer than this (of NAME_MAX's 255) are cut and told apart by a hash

log = logging.getLogger("agentrefine_jax.eval")


class JournalMismatch(ValueError):
    """The journal beside --out was written by a different command or configuration."""


def journal_path(out: str) -> str:
    """`OUT.journal.jsonl` in --out's directory; a long name is cut, then told apart by a hash."""
    head, base = os.path.split(out)
    raw = base.encode()
    if len(raw) > NAME_BYTES:
        digest = hashlib.sha256(raw).hexdigest()[:16]
        base = raw[:100].decode("utf-8", "ignore") + "-" + digest
    return os.path.join(head, base + SUFFIX)


class Journal:
    """Finished episodes of one evaluation, read back on resume and appended as they end."""

    def __init__(self, path: str, settings: dict[str, Any], model: dict[str, Any] | None = None):
        self.path = path
        self.header = {"journal": FORMAT, "settings": json.loads(dumps(settings))}
        if model is not None:  # a policy's journal keeps the header it always had
            self.header["model"] = json.loads(dumps(model))
        self.records: dict[str, Any] = {}
        self.failed = False
        self.appended = 0  # lines this process wrote
        self._file: Any = None
        # Earlier sittings' evaluation seconds (None: a line of an older version has no timing) and count.
        self.prior_seconds: float | None = 0.0
        self.prior_sittings = 0
        self.sitting = 1
        self._t0 = time.perf_counter()
        outputs.check_file(path, flag="journal")
        if os.path.exists(path):
            self._read()
        self.resumed = len(self.records)

    def begin(self) -> None:
        """This sitting's evaluation starts now (after model loading): lines record their time from here."""
        self._t0 = time.perf_counter()

    def _read(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line cut by a kill is dropped
        lines = complete.split(b"\n")[:-1]
        if not lines:
            return
        try:
            header = json.loads(lines[0].decode("utf-8"))
        except ValueError:  # not JSON, or not UTF-8
            header = None
        if not isinstance(header, dict) or {k: v for k, v in header.items() if k != "model"} != {
            k: v for k, v in self.header.items() if k != "model"
        }:
            raise JournalMismatch(
                f"{self.path} was written by a different command or configuration; rerun that command to "
                "resume it, or remove the journal to start over"
            )
        if header.get("model") != self.header.get("model"):
            was = header.get("model")
            again = f"rerun with --checkpoint {was['checkpoint']} to resume it, " if resumable(was) else ""
            raise JournalMismatch(
                f"{self.path} holds episodes of {describe(was)}, but this run evaluates "
                f"{describe(self.header.get('model'))}; resuming would mix two models in one result: "
                f"{again}or remove the journal to start over"
            )
        spans: dict[int, float] = {}  # sitting -> its time at its last journaled episode
        untimed = 0
        for n, line in enumerate(lines[1:], 2):
            try:
                entry = json.loads(line.decode("utf-8"))
                self.records[entry["key"]] = entry["record"]
            except (ValueError, KeyError, TypeError):  # not JSON, not UTF-8, not a record
                raise JournalMismatch(
                    f"{self.path}:{n}: not a journal record; remove the journal to start over"
                ) from None
            sitting, elapsed = entry.get("sitting"), entry.get("elapsed")
            if isinstance(sitting, int) and isinstance(elapsed, int | float):
                spans[sitting] = max(spans.get(sitting, 0.0), float(elapsed))
            else:
                untimed += 1
        self.prior_sittings = len(spans) + (1 if untimed else 0)
        self.prior_seconds = None if untimed else round(sum(spans.values()), 1)
        self.sitting = max(spans, default=0) + 1
        if len(complete) < len(data):
            with open(self.path, "r+b") as f:  # the next append starts on a line of its own
                f.truncate(len(complete))

    @staticmethod
    def key(parts: Sequence[Any]) -> str:
        return dumps(list(parts))

    def get(self, parts: Sequence[Any]) -> Any | None:
        return self.records.get(self.key(parts))

    def append(self, parts: Sequence[Any], record: Any) -> None:
        """One durable line (write, flush, fsync); a failure warns once and the run goes on without it."""
        key = self.key(parts)
        self.records[key] = record
        if self.failed:
            return
        try:
            if self._file is None:
                new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
                self._file = open(self.path, "a", encoding="utf-8")
                if new:
                    self._file.write(dumps(self.header) + "\n")
                    outputs.fsync_dir(os.path.dirname(os.path.abspath(self.path)))
            elapsed = round(time.perf_counter() - self._t0, 1)
            line = {"key": key, "record": record, "sitting": self.sitting, "elapsed": elapsed}
            self._file.write(dumps(line) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
            self.appended += 1
        except (OSError, ValueError, TypeError) as e:  # a full disk; a record JSON cannot hold
            self.failed = True
            log.warning(
                f"cannot write the journal {self.path} ({e}); the evaluation goes on, but a kill now loses "
                "the episodes since"
            )
            return
        faults.point("after_episode", self.appended)

    def total_seconds(self, this_sitting: float) -> float | None:
        """The evaluation's seconds over every sitting, this one's `this_sitting` included (None: unknown)."""
        return None if self.prior_seconds is None else round(self.prior_seconds + this_sitting, 1)

    def remove(self) -> None:
        """The results are written: the journal has served (a rerun starts afresh)."""
        self.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


E = TypeVar("E")


class Resume(Generic[E]):
    """How one protocol's episodes go into and come back out of a journal (`core.run_loop` uses it)."""

    def __init__(
        self,
        journal: Journal,
        phase: Sequence[Hashable],
        key: Callable[[Any], Sequence[Any]],
        dump: Callable[[E], Any],
        load: Callable[[Any, Any], E],
    ):
        self.journal, self.phase, self._key, self._dump, self._load = journal, list(phase), key, dump, load

    def restored(self, job: Any) -> E | None:
        record = self.journal.get(self.phase + list(self._key(job)))
        return None if record is None else self._load(job, record)

    def record(self, job: Any, episode: E) -> None:
        self.journal.append(self.phase + list(self._key(job)), self._dump(episode))
