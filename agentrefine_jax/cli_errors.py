"""The house convention for command-line errors: one line on stderr, `[tool] error: ...`, exit 2.

`OneLineParser` makes argparse's own usage errors (unknown flag, bad choice, missing argument)
follow it too: argparse prints the usage block and the message on separate lines by default.
`run_main` is what every `python -m agentrefine_jax.<tool>` runs: a quiet start-up
(agentrefine_jax.startup), Ctrl-C as one line with exit 130, SIGTERM as one line with exit 75
(EX_TEMPFAIL, as the trainer: "stopped; run the same command again"), and an output that could
not be written after the work (disk full, file too large) as one line with exit 1.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from typing import NoReturn

from agentrefine_jax import outputs

USAGE_ERROR = 2
WRITE_FAILED = 1
TERMINATED = 75  # EX_TEMPFAIL: stopped by SIGTERM, run the same command again (the trainer's code too)
INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
# A full disk (or quota, or file-size limit) met anywhere: one line, exit 1, never a traceback.
DISK_FULL = outputs.DISK_FULL


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, like KeyboardInterrupt: no `except Exception` hides it).
    Long-running loops that keep finished work (synth) catch it to save, then report 75."""


def raise_terminated(signum: int, frame: object) -> None:
    """The SIGTERM handler of a tool that stops by unwinding (run_main's, eval's)."""
    raise Terminated


# Python runs a signal's handler at the next bytecode of the main thread, wherever that is. When it is
# inside a garbage-collector callback (jax registers one that frees XLA buffers on every collection),
# a `__del__` or a weakref callback, the exception the handler raises cannot propagate: Python hands
# it to sys.unraisablehook and goes on, and the Ctrl-C is lost (CI saw a training run ignore it).
_SIGNAL_OF = ((KeyboardInterrupt, signal.SIGINT), (Terminated, signal.SIGTERM))
_REDELIVER_AFTER_S = 0.05  # long enough for the hook and the collection to return first


def redeliver_swallowed_signals() -> None:
    """Make a Ctrl-C or SIGTERM whose exception was swallowed arrive again, at the next safe point.

    The signal is sent again from a helper thread (not from the hook, whose own Python code would take
    it), so whatever handler is installed then (the default's KeyboardInterrupt, a trainer's
    checkpoint-then-stop) sees it once more, outside the callback. Any other unraisable exception goes
    to the hook that was there before. Idempotent."""
    previous = sys.unraisablehook
    if getattr(previous, "_redelivers_signals", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        for exc_type, signum in _SIGNAL_OF:
            if unraisable.exc_type is not None and issubclass(unraisable.exc_type, exc_type):
                timer = threading.Timer(_REDELIVER_AFTER_S, os.kill, (os.getpid(), signum))
                timer.daemon = True
                timer.start()
                return
        previous(unraisable)

    hook._redelivers_signals = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


# A Ctrl-C can also be lost in plain Python code: a library's bare `except:` catches its
# KeyboardInterrupt and goes on. jax 0.10's jax/_src/interpreters/pxla.py has several right after a
# compile (a signal that arrives during XLA's compile raises at the next bytecode, often inside one),
# and CI saw a trainer run on for minutes after Ctrl-C. So the handler also remembers the Ctrl-C, and
# the long loops (training steps, evaluation rounds) raise it again at their next boundary.
_interrupted = threading.Event()


def _on_ctrl_c(signum: int, frame: object) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def remember_ctrl_c() -> None:
    """Make Ctrl-C raise KeyboardInterrupt as usual and also be remembered for
    raise_if_interrupted; only where Ctrl-C has Python's default handler (not where it is ignored,
    nor where a tool handles it itself)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_ctrl_c)


def raise_if_interrupted() -> None:
    """At a long loop's boundary: raise the KeyboardInterrupt of a Ctrl-C that arrived earlier (if
    this process is a tool's, run_main) and that was caught and dropped on its way out."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def run_main(tool: str, module: str) -> int:
    """Import `module` and run its `main()`; returns its exit code.

    Importing inside the guard means a Ctrl-C during the (seconds-long) imports of jax and
    transformers is handled too. On Ctrl-C: one line, worker processes stopped, exit 130 at once
    (an interrupted Orbax save leaves non-daemon threads that would otherwise hold the exit).
    SIGTERM: the same with exit 75 (a tool with its own SIGTERM handling — the trainer's
    checkpoint-then-75, the server's shutdown — installs it over this one). Either signal is delivered
    again if it first landed where its exception could not propagate (redeliver_swallowed_signals),
    and a Ctrl-C whose exception a library caught is raised again by the next loop boundary
    (raise_if_interrupted).
    """
    from agentrefine_jax import startup

    signal.signal(signal.SIGTERM, raise_terminated)
    remember_ctrl_c()
    redeliver_swallowed_signals()
    try:
        startup.quiet_start()
        return int(importlib.import_module(module).main() or 0)
    except KeyboardInterrupt:
        interrupted(tool)
    except Terminated:
        terminated(tool)
    except outputs.OutputWriteError as e:
        return write_failed(tool, e)
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        return write_failed(tool, f"{e.strerror}{f': {e.filename}' if e.filename else ''}")


def exit_with(code: int) -> NoReturn:
    """A training tool's exit: a failed run leaves at once. After a failed asynchronous checkpoint
    save Orbax leaves non-daemon threads waiting out their timeout (minutes); the error is already
    reported, so do not wait for them. A run that finished leaves as every tool does (`leave`)."""
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    leave(code)


def leave(code: int) -> NoReturn:
    """Every tool's exit with the code its `main` returned.

    0: what the interpreter's own exit does that can matter -- wait for non-daemon threads (a
    pending checkpoint save, a writer's flush), run the atexit handlers (jax's distributed shutdown,
    multiprocessing's worker cleanup), flush the log handlers and stdio -- then leave without
    finalizing every module and object: XLA's client and thread pools alone took ~0.8 s of each
    short run's 6 s (a 2-step tiny training run on 2 cores), paid by every CLI process the
    miniature and the test suite start. Nothing of ours relies on a finalizer to write: outputs are
    closed (and renamed into place) before `main` returns.

    75 (stopped by SIGTERM, its work kept, its last line printed): leave without the teardown. A tool
    that ran XLA in its own process (eval, the miniature) was seen to die in that teardown after a
    clean SIGTERM stop -- SIGSEGV on an XLA:CPU worker thread (in the slinky simplifier its fused
    kernels use), twice in the miniature's run -- so the exit code a scheduler reads to mean "run the
    same command again" became a crash. The journal and outputs are written and fsync'd before the
    stop line.

    Anything else, or a tool a host process runs in itself (pytest's `runpy`, a notebook): the
    interpreter's ordinary exit, SystemExit and all; the host decides when its process ends."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize runs first
    if code == 0 and shutdown_threads is not None and _tool_is_the_program():
        shutdown_threads()
        atexit._run_exitfuncs()
    elif code != TERMINATED:
        sys.exit(code)
    logging.shutdown()  # flush every log handler, as teardown would
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`| head`), a closed stream
            pass
    os._exit(code)


def _tool_is_the_program() -> bool:
    """Whether this process runs one of our tools as its program: `python -m agentrefine_jax.<tool>`
    (its `__main__` is ours) or a console script (`agentrefine-<tool>`), not a host that called one."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name.startswith("agentrefine_jax.")
    return os.path.basename(getattr(main, "__file__", None) or "").startswith("agentrefine-")


def write_failed(tool: str, message: object) -> int:
    """An output could not be written after the work: one line (what, why, where it was kept), exit 1."""
    text = " ".join(str(message).split())
    print(f"[{tool}] error: {text}", file=sys.stderr, flush=True)
    return WRITE_FAILED


def _stop(tool: str, line: str, code: int) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not interrupt the exit
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"[{tool}] {line}", file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():  # data loader workers, not left orphaned
        child.terminate()
    sys.stdout.flush()
    os._exit(code)


def interrupted(tool: str) -> NoReturn:
    """Ctrl-C: `[tool] interrupted` on stderr and exit 130, with no traceback from anything."""
    _stop(tool, "interrupted (Ctrl-C)", INTERRUPTED)


def terminated(tool: str) -> NoReturn:
    """SIGTERM: `[tool] terminated` on stderr and exit 75, with no traceback from anything."""
    _stop(tool, "terminated (SIGTERM); run the same command again", TERMINATED)


def tool_name(prog: str) -> str:
    """`python -m agentrefine_jax.data stats` -> `data`; anything else is returned as is."""
    for word in prog.split():
        if word.startswith("agentrefine_jax."):
            return word.split(".")[-1]
    return prog


def fail(tool: str, message: object) -> int:
    """Print the one-line error and return the exit code (for `return fail(...)` in a main)."""
    text = " ".join(str(message).split())  # one line, whatever the exception text held
    print(f"[{tool}] error: {text}", file=sys.stderr, flush=True)
    return USAGE_ERROR


# `--config`'s help, the same for every tool (the rule: agentrefine_jax.config.resolve_config_path).
CONFIG_HELP = (
    "a shipped config in configs/, by name with or without .py (llama3_8b or llama3_8b.py), or a "
    "path to your own (./mine.py, dir/mine.py; it is Python and runs with your privileges: change a "
    "shared config with --set instead)"
)


def add_config_flags(p: argparse.ArgumentParser, set_example: str) -> None:
    """`--config` and the repeatable `--set KEY=VALUE`, as every config-driven command spells them."""
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config field, e.g. --set {set_example} (repeatable)",
    )


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one stderr line and exit 2 (subparsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        fail(tool_name(self.prog), f"{message} (see {self.prog} --help)")
        raise SystemExit(USAGE_ERROR)


def int_in(lo: int, hi: int | None = None):
    """argparse `type=` for an integer flag with a range, checked before any work starts."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"must be {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}"
            )
        return value

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False):
    """argparse `type=` for a float flag in [lo, hi] (or (lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < value <= hi if lo_open else lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}]")
        return value

    return parse
