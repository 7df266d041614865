"""Where the suite's wall time went: three lines at the end of every run, CI's included.

CI once reported 4,193 s of pytest wall time for a suite that had taken ~1,400 s on an idle 2-core
machine. `--durations` lists only the slowest tests, so time spread thinly over many tests could not
be told from time spent between tests (a worker waiting on the controller, a slow start,
collection). These lines say which: the summed
test phases per worker against the wall time, each worker's longest time between two reports that
no test phase accounts for, and the files that cost the most.

The hooks run in the process that prints the summary (xdist's controller: every worker's reports
reach it with the worker attached as `report.node`); conftest.py imports them so pytest finds them.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

_START = time.monotonic()
_busy: dict[str, float] = defaultdict(float)  # worker -> summed setup/call/teardown durations
_tests: dict[str, int] = defaultdict(int)
_last: dict[str, float] = {}  # worker -> when its previous report arrived
_silence: dict[str, tuple[float, str]] = {}  # worker -> (longest unaccounted gap, the test after it)
_files: dict[str, float] = defaultdict(float)


def _worker(report: pytest.TestReport) -> str:
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    return getattr(gateway, "id", "main")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker, now = _worker(report), time.monotonic()
    _busy[worker] += report.duration
    _tests[worker] += report.when == "call"
    _files[report.nodeid.split("::")[0]] += report.duration
    # The first gap of a worker starts at the controller's start: it holds start-up and collection.
    gap = now - _last.get(worker, _START) - report.duration
    if gap > _silence.get(worker, (0.0, ""))[0]:
        _silence[worker] = (gap, report.nodeid)
    _last[worker] = now


def pytest_terminal_summary(terminalreporter) -> None:
    if not _busy:
        return
    wall = time.monotonic() - _START
    workers = sorted(_busy)
    busy = ", ".join(f"{w} {_busy[w]:,.0f} s ({_tests[w]} tests)" for w in workers)
    quiet = ", ".join(f"{w} {_silence[w][0]:,.0f} s before {_silence[w][1]}" for w in _silence)
    costly = sorted(_files.items(), key=lambda kv: -kv[1])[:6]
    write = terminalreporter.write_line
    write(f"[suite clock] wall {wall:,.0f} s; test phases summed per worker: {busy}")
    write(f"[suite clock] longest time between reports outside any test phase: {quiet}")
    write("[suite clock] costliest files: " + ", ".join(f"{f.split('/')[-1]} {s:,.0f} s" for f, s in costly))
