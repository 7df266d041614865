"""What every episode source shares: the environment interface, its step result, and the one episode engine.

Both sources' episodes are one job type (`EpisodeJob`) and end as one record type (`EpisodeResult`).
The engine is protocol-agnostic: a protocol object (our chat layout, `loop.ChatProtocol`; AgentBoard's,
`agentboard/protocol.AgentBoardProtocol`) says how an episode starts, how a round of replies is obtained
(prompt assembly, the actor call) and how a reply or a failure is applied (parsing, stepping, logging);
the engine keeps up to `width` episodes in flight so one batched model call answers all of them, frees
an actor's per-episode state when an episode ends, and journals every finished episode.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from agentrefine_jax import cli_errors
from agentrefine_jax.eval import progress
from agentrefine_jax.eval.journal import Resume
from agentrefine_jax.eval.policies import Reply, SamplingParams, forget

if TYPE_CHECKING:
    from agentrefine_jax.eval.journal import Journal

log = logging.getLogger(__name__)


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


class Task:
    """What every task of either source is to the runner and the policies: its registered `name`, the
    reference solver of an episode (`oracle(env)`: a `policies.Solver`, None where it has none) and `close`
    (its simulators, files, processes). Each source's base adds what its source reads: the built-in
    `envs.base.EvalTask` (episodes from a run seed, action vocabularies, `make_env(spec, perturbation)`),
    AgentBoard's `agentboard.tasks.base.Task` (a checkout's episodes and prompt files, `make_env(checkout,
    spec)`)."""

    name: str

    def oracle(self, env: Any) -> Any | None:
        return None

    def close(self) -> None:
        """Release what the task holds (simulators, generated files, processes)."""


class Env(Protocol):
    """One running episode of any task, from either source, as every protocol drives it: `reset` starts the
    episode and returns the first observation (and sets `goal`); `step` applies one action; `valid_actions`
    is what "check valid actions" lists now. An env whose task tells success apart from the episode ending
    (BabyAI's cleared goal, a built-in env's `success`) exposes `success` too."""

    goal: str

    def reset(self) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def valid_actions(self) -> list[str]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class EpisodeJob:
    """One episode-sample to run, from either source: which task and episode, under which perturbation
    variant (0: the original) and Best-of-N sample, with its step limit and seed. `spec` is what the task
    builds the episode from (a built-in task's dict; AgentBoard's `EpisodeSpec`)."""

    # Registered task name (reported in results; plug-ins may reuse a built-in EvalTask class).
    name: str
    task: Any
    spec: Any
    episode: int
    perturbation: int
    sample: int
    max_steps: int
    seed: int
    # agentrefine_jax.layout style of the prompts: "chat" (multi-turn) or "agentboard" (one user message);
    # the chat protocol's (AgentBoard's episodes are always in AgentBoard's own prompt).
    prompt_style: str = "chat"
    # None: the actor's own sampling settings (the greedy run beside Best-of-N overrides them).
    sampling: SamplingParams | None = None


def job_key(job: EpisodeJob) -> tuple[str, int, int, int]:
    """The conversation an episode-sample is to a model actor and its journal key (distinct among a
    run's jobs of one phase): task, perturbation variant, episode, sample."""
    return (job.name, job.perturbation, job.episode, job.sample)


def variant_name(perturbation: int) -> str:
    """A perturbation variant's name in results ("original": variant 0, the task's own wording)."""
    return "original" if perturbation == 0 else f"perturbation_{perturbation}"


def job_seed(seed: int, task: str, perturbation: int, episode: int, sample: int) -> int:
    digest = hashlib.sha256(f"{seed}|{task}|{perturbation}|{episode}|{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# An AgentBoard end reason (its log's `end`) of each termination that is not an error's own text.
_AGENTBOARD_END = {"success": "done", "env_done": "done", "max_steps": "max_steps"}


@dataclasses.dataclass
class EpisodeResult:
    """One finished episode-sample, from either source: the one record every protocol returns, metrics
    read and the writers turn into the results file (`to_json`) and AgentBoard's logs
    (`agentboard.runner.agentboard_log`). `trace` has one entry per step (action, validity, progress; the
    chat protocol adds whether it ran and success, AgentBoard's the observation and the raw reply)."""

    task: str  # the registered task name that ran it
    variant: str  # "original" or "perturbation_<k>"
    episode: int
    sample: int
    spec: Any
    success: bool
    progress: float  # best-so-far
    steps: int
    # "success" | "env_done" (terminal failure) | "max_steps" | "context_overflow" | "error"
    termination: str
    error: str | None
    invalid_actions: int
    format_errors: int
    seconds: float
    messages: list[dict[str, str]]
    trace: list[dict[str, Any]]
    # What AgentBoard's log keeps beside these: the goal, the first observation, the most history items
    # dropped for one prompt (truncation) and the last prompt sent. Not in the results record (`to_json`).
    goal: str = ""
    initial_observation: str = ""
    dropped_history: int = 0
    last_prompt: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The results file's episode record (schema /2)."""
        out = dataclasses.asdict(self)
        for k in ("goal", "initial_observation", "dropped_history", "last_prompt"):
            del out[k]
        return out

    # AgentBoard's vocabulary for the same record, read by its log writer and its metrics.
    @property
    def turns(self) -> list[dict[str, Any]]:
        """The trace, under AgentBoard's name for it (what readers of its episodes ask for)."""
        return self.trace

    @property
    def valid_steps(self) -> int:
        return sum(bool(t.get("valid")) for t in self.trace)

    @property
    def grounding(self) -> float:
        return self.valid_steps / self.steps if self.steps else 0.0

    @property
    def score_change_record(self) -> list[tuple[int, float]]:
        """(step, progress) at every step that raised the best-so-far progress."""
        out, best = [], 0.0
        for step, t in enumerate(self.trace):
            if t["progress"] > best:
                out.append((step, t["progress"]))
                best = t["progress"]
        return out

    @property
    def end(self) -> str:
        """AgentBoard's end reason: "done", "max_steps", or the error ("model_error: ...", ...)."""
        return _AGENTBOARD_END.get(self.termination) or str(self.error)


class Episode:
    """One episode in flight, from either source and under any protocol: its job, its env (None when it
    failed to start), its record (the one `EpisodeResult`, filled in as the episode runs), the
    Observation/Action history a prompt or a solver reads, a privileged policy's solver, and every reply
    the actor gave (with token ids and log-probabilities when it has them; the record keeps the text).
    A protocol keeps what only it needs beside these (AgentBoard's prompt set, a rollout's token ids)."""

    def __init__(self, job: EpisodeJob, env: Env | None = None):
        self.job, self.env = job, env
        variant = variant_name(job.perturbation)
        self.record = EpisodeResult(
            job.name, variant, job.episode, job.sample, job.spec, False, 0.0, 0, "", None, 0, 0, 0.0, [], []
        )
        self.history: list[tuple[str, str]] = []
        self.solver: Any = None  # a privileged policy's solver for this episode (`for_episode`)
        self.prompt: Any = None  # what every prompt is built from, if fixed (AgentBoard's prompt set)
        self.replies: list[Reply] = []
        self.finished = False
        self.t0 = time.perf_counter()

    def finish(self, termination: str, error: str | None = None) -> None:
        """End the episode: its record's end and time; the env is closed (a failing close is logged: it
        must not lose the episode's record)."""
        self.finished = True
        r = self.record
        r.termination, r.error = termination, error
        r.seconds = round(time.perf_counter() - self.t0, 3) if self.env is not None else 0.0
        if self.env is not None:
            try:
                self.env.close()
            except Exception as e:  # noqa: BLE001
                log.warning(f"warning: closing {self.job.name} env failed: {e}")


class Running(Protocol):
    finished: bool


E = TypeVar("E", bound=Running)
J = TypeVar("J")
R = TypeVar("R")


class EpisodeProtocol(Protocol[J, E, R]):
    """How one source's episodes run (`run_episodes` does the rest). `J` is a job, `E` a running
    episode (with `job` and `finished`), `R` a finished episode's record. `key(job)` is the
    conversation a job is to the actor and its journal key; `start` may return an episode finished
    already (it failed to start); `answer` runs one round and returns the replies (or the actor's
    error) of the episodes it asked; one it ended while preparing the prompt is not among them. A reply
    is the actor's `Reply` (its text, and token ids and log-probabilities when the actor has them)."""

    source: str  # the journal's namespace: one source's records never answer another's jobs
    width: int  # episodes in flight
    actor: Any  # told to `forget` an episode's conversation when it ends

    def key(self, job: J) -> tuple[Hashable, ...]: ...
    def start(self, job: J) -> E: ...
    def answer(self, active: list[E]) -> list[tuple[E, Reply | Exception]]: ...
    def apply(self, ep: E, reply: Reply) -> None: ...
    def failed(self, ep: E, error: Exception) -> None: ...
    def result(self, ep: E) -> R: ...
    def dump(self, result: R) -> Any: ...
    def load(self, job: J, record: Any) -> R: ...


@dataclasses.dataclass
class Restored(Generic[R]):
    """An episode read back from the journal (it finished in an earlier, interrupted run)."""

    result: R
    finished: bool = True


def run_episodes(
    jobs: Sequence[J],
    protocol: EpisodeProtocol[J, Any, R],
    *,
    on_done: Callable[[R], None] | None = None,
    journal: Journal | None = None,
    phase: Sequence[Hashable] = (),
) -> list[R]:
    """Run every job to its end under `protocol`; records come back in job order. With a `journal`,
    episodes it holds (under `phase`) are not run again and every finished one is appended."""

    def respond(active: list[Any]) -> None:
        for ep, reply in protocol.answer(active):
            if isinstance(reply, Exception):
                protocol.failed(ep, reply)
            else:
                protocol.apply(ep, reply)

    def report(ep: Any) -> None:
        forget(protocol.actor, protocol.key(ep.job))  # its cache row goes to the next episode
        if on_done is not None:
            on_done(protocol.result(ep))

    resume = None
    if journal is not None:
        resume = Resume(
            journal,
            [protocol.source, *phase],
            protocol.key,
            lambda ep: protocol.dump(protocol.result(ep)),
            lambda job, record: Restored(protocol.load(job, record)),
        )
    done = run_loop(jobs, protocol.start, respond, width=protocol.width, on_done=report, resume=resume)
    return [ep.result if isinstance(ep, Restored) else protocol.result(ep) for ep in done]


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
        cli_errors.raise_if_interrupted()  # a Ctrl-C that a library's bare `except:` dropped
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
