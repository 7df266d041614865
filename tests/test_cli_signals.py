"""A Ctrl-C or SIGTERM that lands where Python cannot raise it is not lost.

Python runs a signal handler at the next bytecode of the main thread; inside a garbage-collector
callback (jax registers one that runs on every collection), a `__del__` or a weakref callback, the
handler's exception is swallowed (printed as "Exception ignored") and the program goes on. CI saw a
training run ignore its Ctrl-C this way. Here a real signal is delivered inside a real collector
callback, in a real `run_main` process, and the tool must still stop with its one line and exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import gc, os, signal, sys, time, types

    from agentrefine_jax import cli_errors

    def main():
        {extra}
        fired = []

        def callback(phase, info):
            if phase == "start" and not fired:
                fired.append(1)
                try:
                    os.kill(os.getpid(), signal.{sig})
                    for _ in range(10_000):  # bytecode, so the handler runs here, inside the callback
                        pass
                except BaseException:
                    # Printed before Python swallows the exception, so before any re-delivery.
                    print("probe: raised inside the callback", file=sys.stderr, flush=True)
                    raise

        gc.callbacks.append(callback)
        gc.collect()
        gc.callbacks.remove(callback)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("probe: never stopped", file=sys.stderr, flush=True)
        return 0

    probe = types.ModuleType("probe_main")
    probe.main = main
    sys.modules["probe_main"] = probe
    sys.exit(cli_errors.run_main("probe", "probe_main"))
    """
)

OTHER_UNRAISABLE = """
        class Broken:
            def __del__(self):
                raise ValueError("a broken finalizer")
        Broken()
"""


def _probe(sig: str, extra: str = "") -> subprocess.CompletedProcess[str]:
    code = PROBE.format(sig=sig, extra=textwrap.indent(textwrap.dedent(extra), " " * 4).strip())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        ("SIGINT", 130, "[probe] interrupted (Ctrl-C)"),
        ("SIGTERM", 75, "[probe] terminated (SIGTERM); run the same command again"),
    ],
)
def test_a_signal_swallowed_by_a_collector_callback_still_stops_the_tool(sig, code, line):
    res = _probe(sig)
    # The signal's exception was raised inside the callback, where Python swallows it ...
    assert "probe: raised inside the callback\n" in res.stderr, res.stderr
    # ... and was delivered again: the tool's one line and exit code, no "Exception ignored" wall.
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert "never stopped" not in res.stderr
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr
    assert [x for x in res.stderr.splitlines() if x.startswith("[probe]")] == [line], res.stderr


def test_other_unraisable_exceptions_are_still_reported_as_before():
    res = _probe("SIGINT", OTHER_UNRAISABLE)
    assert res.returncode == 130, (res.returncode, res.stderr[-2000:])
    assert "Exception ignored" in res.stderr and "ValueError: a broken finalizer" in res.stderr
