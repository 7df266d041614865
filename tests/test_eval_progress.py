"""Eval's heartbeat (`eval/progress.py`): a progress line every --progress-every seconds while
episodes run, also while one slow model call is under way and no episode ends; and the counts the
episode loop reports into it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from openai_fixture import chat_completion, send_json

from agentrefine_jax import cli_errors
from agentrefine_jax.eval import progress
from agentrefine_jax.eval.core import run_loop

REPLY_S = 1.5  # one "model call": far longer than the heartbeat interval below


class SlowAgent(BaseHTTPRequestHandler):
    """A model that takes REPLY_S seconds per reply and always asks for the valid actions."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(REPLY_S)
        reply = "Thought: I need the options.\nAction: check valid actions"
        send_json(self, 200, chat_completion(body["model"], reply))


@pytest.fixture
def slow_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), SlowAgent)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


@pytest.mark.timeout(300)
def test_eval_prints_progress_while_a_slow_model_call_runs(slow_server, tmp_path):
    args = ["--base-url", slow_server, "--model", "slow", "--tasks", "babyai", "--episodes", "1"]
    args += ["--max-steps", "2", "--progress-every", "0.25", "--workdir", str(tmp_path / "w")]
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), "OPENAI_API_KEY": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    beats = [line for line in proc.stderr.splitlines() if line.startswith("[eval] progress: ")]
    # Two replies of 1.5 s each with a 0.25 s heartbeat: lines while no episode had ended yet, each
    # saying how long the current policy call has been waiting.
    waiting = [b for b in beats if "0/1 episodes done, 1 in flight" in b and "on the policy" in b]
    assert len(waiting) >= 2, proc.stderr
    assert all(re.search(r"elapsed \d+s$", b) for b in beats), beats
    # The step count moves as the rounds end (the first reply is step 1).
    assert any(" 1 steps (" in b for b in beats), beats
    # The episode's own line still comes; a non-positive interval is one line and exit 2.
    assert "babyai original episode 0" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "agentrefine_jax.eval", *args[:-4], "--progress-every", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    errors = [line for line in bad.stderr.splitlines() if "error:" in line]
    assert bad.returncode == 2 and len(errors) == 1 and "--progress-every" in errors[0], bad.stderr


class _Episode:
    def __init__(self, steps: int) -> None:
        self.left, self.finished = steps, steps == 0


def test_the_loop_reports_jobs_rounds_and_ended_episodes():
    lines: list[str] = []
    jobs = [2, 1, 3, 0]  # steps each episode takes; the last one "fails to start" (finished at once)

    def respond(active: list[_Episode]) -> None:
        for ep in active:
            ep.left -= 1
            ep.finished = ep.left == 0

    with progress.Progress(3600, lines.append) as p:
        eps = run_loop(jobs, _Episode, respond, width=2)
        assert p.line().startswith("progress: 4/4 episodes done, 0 in flight, 6 steps (")
    assert [e.finished for e in eps] == [True] * 4
    assert progress.active() is None and lines == []  # no beat in an hour-long interval
    # Outside a Progress block the loop runs without one.
    assert all(e.finished for e in run_loop([1, 2], _Episode, respond, width=2))


def test_a_ctrl_c_that_a_library_drops_stops_the_loop_at_the_next_round():
    """A Ctrl-C whose KeyboardInterrupt is caught and dropped inside a round (a bare `except:`, as
    jax's pxla.py has after a compile) is raised again before the next round starts."""
    rounds: list[int] = []

    def respond(active: list[_Episode]) -> None:
        rounds.append(len(active))
        if len(rounds) == 1:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler runs here
            except:  # noqa: E722 -- the library's
                pass
        for ep in active:
            ep.left -= 1
            ep.finished = ep.left == 0

    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cli_errors.remember_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            run_loop([5, 5], _Episode, respond, width=2)
    finally:
        signal.signal(signal.SIGINT, previous)
        cli_errors._interrupted.clear()
    assert rounds == [2]


def test_the_heartbeat_beats_without_any_event():
    lines: list[str] = []
    with progress.Progress(0.05, lines.append) as p:
        p.add_jobs(3)
        p.round_started(2)
        deadline = time.monotonic() + 60
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(lines) >= 2 and lines[0].startswith("progress: 0/3 episodes done, 2 in flight, 0 steps")
    assert "on the policy" in lines[0]
    with pytest.raises(ValueError, match="> 0"):
        progress.Progress(0)


def test_the_heartbeat_shows_this_process_s_memory_and_the_host_s():
    import resource

    import numpy as np

    block = np.ones(300_000_000 // 8)  # 300 MB, touched
    p = progress.Progress(3600, lambda _m: None)
    m = re.search(
        r"memory ([\d.]+) GB \(peak ([\d.]+)\), host ([\d.]+) of ([\d.]+) GB free, elapsed", p.line()
    )
    assert m, p.line()
    rss, peak, free, total = map(float, m.groups())
    # The kernel's own count of the peak, read another way (getrusage: kB on Linux).
    assert abs(peak - resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9) <= 0.1
    assert 0.3 <= rss <= peak and 0 < free <= total
    assert os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 == pytest.approx(total, abs=0.1)
    del block


def test_a_low_memory_warning_once_per_spell():
    from agentrefine_jax.host_memory import MemoryNow

    free_gb = iter([12.0, 1.8, 1.5, 3.0, 6.0, 1.0])  # of 20: fine, low, still low, not yet back, back, low
    lines: list[str] = []
    p = progress.Progress(
        3600, lines.append, memory=lambda: MemoryNow(int(9e9), int(10e9), int(next(free_gb) * 1e9), int(20e9))
    )
    warnings = [p.memory_warning() for _ in range(6)]
    assert [w is not None for w in warnings] == [False, True, False, False, False, True]
    assert warnings[1].startswith(
        "warning: memory low: 1.8 of 20.0 GB free on this host, this process 9.0 GB"
    )
    assert "--batch-size" in warnings[1]
    assert progress.Progress(3600, lines.append, memory=lambda: None).memory_warning() is None
