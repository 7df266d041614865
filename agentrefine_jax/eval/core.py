"""What every episode source shares: the step result environments return, and the one episode loop.

The loop is protocol-agnostic: a protocol (our chat layout in `loop.py`, AgentBoard's in
`agentboard/protocol.py`) says how an episode starts and how a round of replies is obtained and applied
(prompt assembly, the actor call, parsing, stepping, logging); the loop keeps up to `width` episodes in
flight so one batched model call answers all of them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from agentrefine_jax.eval import progress

if TYPE_CHECKING:
    from agentrefine_jax.eval.journal import Resume


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    done: bool = False  # the episode is over (success or the game ended)
    # best-so-far progress rate in [0, 1] (monotone); a built-in env's `_step` gives its new state's
    progress: float = 0.0
    valid: bool = True  # grounding: the action was valid (each task's rule)
    # Built-in environments report success here; AgentBoard's expose `env.success`.
    success: bool = False
    # False when the command never reached the simulator ("check valid actions", a rejected command).
    executed: bool = True
    # The action as the environment parsed it, when it rewrites replies (AgentBoard's ALFWorld `parseAction`,
    # Jericho's cut): AgentBoard records this form, not the raw reply, in the history a model reads next.
    action: str | None = None


class Running(Protocol):
    finished: bool


E = TypeVar("E", bound=Running)


def run_loop(
    jobs: Sequence[Any],
    start: Callable[[Any], E],
    respond: Callable[[list[E]], None],
    *,
    width: int,
    on_done: Callable[[E], None] | None = None,
    resume: Resume[E] | None = None,
) -> list[E]:
    """Run every job to its end; the finished episodes come back in job order.

    `start(job)` makes a running episode (it may be finished already, e.g. failed to start); each round
    `respond(active)` answers every active episode together and applies the replies; an episode whose
    `finished` is then set leaves (`on_done`) and the next job takes its place. With `resume` (the run's
    journal), a job the journal holds is not run again (its record comes back, without `on_done`: it was
    reported when it ran) and every episode that ends is journaled before `on_done`. Inside `eval`'s
    `progress.Progress` block, the loop reports its jobs, rounds and ended episodes to the heartbeat.
    """
    queue = collections.deque(enumerate(jobs))
    active: list[tuple[int, E]] = []
    done: dict[int, E] = {}
    beat = progress.active()  # eval's heartbeat (None outside the CLI): counts only, never blocks
    if beat is not None:
        beat.add_jobs(len(jobs))

    def finish(i: int, ep: E) -> None:
        done[i] = ep
        if beat is not None:
            beat.episode_done()
        if resume is not None:
            resume.record(jobs[i], ep)
        if on_done is not None:
            on_done(ep)

    while queue or active:
        while queue and len(active) < max(1, width):
            i, job = queue.popleft()
            restored = resume.restored(job) if resume is not None else None
            if restored is not None:
                done[i] = restored
                if beat is not None:
                    beat.episode_done(was_running=False)
                continue
            ep = start(job)
            if ep.finished:
                finish(i, ep)
            else:
                active.append((i, ep))
        if active:
            if beat is not None:
                beat.round_started(len(active))
            try:
                respond([ep for _, ep in active])
            finally:
                if beat is not None:
                    beat.round_ended()
        still = []
        for i, ep in active:
            if ep.finished:
                finish(i, ep)
            else:
                still.append((i, ep))
        active = still
    return [done[i] for i in range(len(jobs))]
