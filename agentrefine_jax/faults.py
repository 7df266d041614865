"""Named kill points for the fault tests: a real signal to this very process at a chosen moment.

`AGENTREFINE_FAULT="<point>@<step>:<KILL|TERM|INT>"` (tests only; unset, every call is a no-op)
sends SIGKILL, SIGTERM or SIGINT (Ctrl-C) to the process itself when the save of step `<step>` reaches
`<point>` — the same signal a scheduler or the OOM killer would send, at a moment that a
test could otherwise hit only by chance. The points, in the order a save passes them:

  before_save      the step is about to be handed to Orbax
  before_commit    Orbax has written every item, not yet its commit marker (tmp dir)
  after_commit     Orbax has committed (and may have deleted older steps), no manifest yet
  during_manifest  the manifest is hashed and in MANIFEST.tmp, not yet renamed into place
  during_export    the end-of-run export (train.export_hf_at_end) has started writing

and, for an evaluation (`<step>` = episodes this process has journaled):

  after_episode    an episode's journal line is written and fsync'd (eval/journal.py)

and, for a GRPO run (`<step>` = the rollout phase):

  after_rollouts   the phase's rollouts are journaled (rl/journal.py), its first update not yet run

and, for a training run (`<step>` = the step just dispatched), a signal that a library drops:

  dropped_in_library  the signal's exception is raised inside a bare `except:` that swallows it,
                      as jax's pxla.py does around its post-compile calls (`swallowed`)
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "AGENTREFINE_FAULT"
POINTS = (
    "before_save",
    "before_commit",
    "after_commit",
    "during_manifest",
    "during_export",
    "after_episode",
    "after_rollouts",
    "dropped_in_library",
)


def spec() -> tuple[str, int | None, signal.Signals] | None:
    """(point, step or None for any, signal) from the environment, or None."""
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    where, _, sig = text.partition(":")
    point, _, at = where.partition("@")
    if point not in POINTS or sig not in ("KILL", "TERM", "INT"):
        raise ValueError(f"{FAULT_ENV}={text!r}: expected <{'|'.join(POINTS)}>[@<step>]:<KILL|TERM|INT>")
    return point, int(at) if at else None, signal.Signals[f"SIG{sig}"]


_fired: set[tuple[str, int]] = set()


def _due(name: str, step: int) -> signal.Signals | None:
    """The signal to send now, if the environment names this point (and step); once per point."""
    s = spec()
    if s is None or s[0] != name or (s[1] is not None and s[1] != step) or (name, step) in _fired:
        return None
    _fired.add((name, step))
    return s[2]


def point(name: str, step: int) -> None:
    """Signal this process if the environment names this point (and step); once per point."""
    if (sig := _due(name, step)) is None:
        return
    os.kill(os.getpid(), sig)
    if sig == signal.SIGKILL:
        time.sleep(60)  # not reached: the kernel ends the process


def swallowed(name: str, step: int) -> None:
    """Like `point`, but the signal's exception (a KeyboardInterrupt for INT) is raised and dropped
    here, in a bare `except:`, as a library can drop it: what then stops the process is ours."""
    if (sig := _due(name, step)) is None:
        return
    try:
        os.kill(os.getpid(), sig)
        time.sleep(1)  # the handler runs at the next bytecode of this thread: in here
    except:  # noqa: E722 -- deliberately what jax/_src/interpreters/pxla.py does
        pass
