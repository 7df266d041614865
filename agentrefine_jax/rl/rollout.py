"""Token-level rollouts: a phase's groups of sampled episodes, each one token sequence.

`collect(model, cfg, phase)` plays `cfg.rl.worlds_per_phase` training worlds of the built-in task
`cfg.rl.task` (`eval/onpolicy.plan`: the task's training split, every world checked against its eval
split and an eval world refused) x `cfg.rl.group_size` sampled episodes per world (the same world
seed; each episode its own cache row and sampling key), up to `max_in_flight` together on the one
episode engine (`eval/core.run_episodes`) under our chat protocol (`eval/loop.ChatProtocol`: the
same prompts, parser, step counting and terminations as an eval run), answered by the KV-cache
engine with the model's current parameters (`inference/chat.ChatGenerator.complete_ids`, one
batched call a round).

An episode is built by appending token ids, never by re-rendering its text (rl/scaffold.py):

    render(system, first observation) + generation prompt      (not trained)
    per turn:  the ids the engine sampled                       (trained; their log-probabilities)
               [the template's end-of-turn token(s)]            (not trained; only when the turn was cut
                                                                 by a stop string or max_new_tokens)
               the tokens up to the next generation prompt,
               the environment's observation among them         (not trained; not after the last turn)

and each next turn is generated from exactly these ids (the conversation's KV cache holds them), so
the log-probabilities recorded while sampling are those of the trained sequence. Every sampled id is
kept, the model's own end-of-turn token included (trained: the model chose to stop) and any it
sampled past a stop string (the environment acts on the text cut there, but the policy did sample
them and the cache holds them). The log-probabilities are the engine's: log-softmax of the raw logits
(temperature 1, full vocabulary) of each sampled id, whatever temperature/top_p sampled it.

Rewards per episode: `success`, the task's final `progress` rate, and `turn_rewards[k]` the progress
rate gained by action k (they sum to the final progress). Deterministic for (cfg.rl.seed, phase) and
the model's parameters: a phase's worlds are the training split from seed `cfg.rl.seed + phase *
worlds_per_phase` on (consecutive phases play disjoint worlds), and sampling keys come from the
episodes' seeds and cache rows, the same in every run of the phase (the batch is the same). An
interrupted phase is regenerated whole (an episode's samples depend on which others share its
batch, so a journal of part of a phase would not resume to the uninterrupted result).
"""

from __future__ import annotations

import dataclasses
import tempfile
import types
from collections.abc import Callable, Sequence
from typing import Any

from agentrefine_jax.config import Config
from agentrefine_jax.eval import core
from agentrefine_jax.eval.core import Episode, EpisodeJob, job_key, job_seed
from agentrefine_jax.eval.loop import ChatProtocol, start
from agentrefine_jax.eval.onpolicy import plan
from agentrefine_jax.eval.policies import DEFAULT_STOP, ContextOverflow, Reply
from agentrefine_jax.rl.batch import Rollout
from agentrefine_jax.rl.scaffold import Scaffold

SOURCE = "rl"  # the episode engine's namespace for these episodes
# The environments need nothing privileged: the model is the actor.
_MODEL_ACTOR = types.SimpleNamespace(needs_oracle=False)


@dataclasses.dataclass(frozen=True)
class Played:
    """One rollout and what it was made from (the tests' oracles read these): the conversation as
    text (the replies as decoded and cut at a stop string, each observation) and, per turn, the span
    of the sequence that holds the engine's sampled ids."""

    rollout: Rollout
    messages: tuple[dict[str, str], ...]
    spans: tuple[tuple[int, int], ...]
    termination: str


@dataclasses.dataclass
class _Sequence:
    """An episode's tokens so far."""

    ids: list[int] = dataclasses.field(default_factory=list)
    trainable: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def scaffolding(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.trainable += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def sampled(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.spans.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.trainable += [True] * len(ids)
        self.logprobs += [float(x) for x in logprobs]


class RolloutProtocol(ChatProtocol):
    """The chat protocol with each episode kept as appended token ids (module docstring); the actor is
    the engine itself, asked with ids."""

    source = SOURCE

    def __init__(
        self, generator: Any, scaffold: Scaffold, width: int, *, max_new_tokens: int, temperature: float,
        top_p: float,
    ):  # fmt: skip
        super().__init__(generator, width)
        self.generator, self.scaffold = generator, scaffold
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.stop_ids = frozenset(generator.stop_token_ids)
        self.context = generator.model.cfg.max_position_embeddings

    def start(self, job: EpisodeJob) -> Episode:
        run = start(job, _MODEL_ACTOR)  # type: ignore[arg-type]
        run.seq = _Sequence()
        if not run.finished:
            run.seq.scaffolding(self.scaffold.first_prompt(run.record.messages))
        return run

    def answer(self, runs: list[Episode]) -> list[tuple[Episode, Reply | Exception]]:
        out: list[tuple[Episode, Reply | Exception]] = []
        ask = []
        for run in runs:
            if len(run.seq.ids) >= self.context:  # not even one new token fits: AgentBoard ends it here
                out.append((run, ContextOverflow(f"{len(run.seq.ids)} tokens fill the context")))
            else:
                ask.append(run)
        if ask:
            room = self.context - max(len(r.seq.ids) for r in ask)
            done = self.generator.complete_ids(
                [r.seq.ids for r in ask],
                max_new_tokens=min(self.max_new_tokens, room),
                temperature=self.temperature,
                top_p=self.top_p,
                stop=list(DEFAULT_STOP),
                # One call's key (as the checkpoint actor's); each cache row samples its own stream.
                seed=(sum(r.job.seed for r in ask) + max(r.record.steps for r in ask)) % 2**31,
                keys=[job_key(r.job) for r in ask],
            )
            out += [(r, Reply(c.text, c.token_ids, c.logprobs)) for r, c in zip(ask, done, strict=True)]
        return out

    def apply(self, run: Episode, reply: Reply) -> None:
        ids, logprobs = reply.token_ids or (), reply.logprobs or ()
        if not ids or len(ids) != len(logprobs):
            raise RuntimeError("the engine returned a reply without its sampled ids and log-probabilities")
        run.seq.sampled(ids, logprobs)
        super().apply(run, reply)  # parse, step the environment, append the observation, maybe finish
        if ids[-1] not in self.stop_ids:  # cut by a stop string or max_new_tokens: close the turn
            run.seq.scaffolding(self.scaffold.end_ids)
        if not run.finished:
            run.seq.scaffolding(self.scaffold.observation(run.record.messages[-1]))

    def result(self, run: Episode) -> Played:  # type: ignore[override]
        r = ChatProtocol.result(run)
        if r.termination == "error" and not r.trace:
            raise RuntimeError(f"{r.task} world {r.spec}: {r.error}")
        progress = [float(e["progress"]) for e in r.trace]
        gains = [b - a for a, b in zip([0.0, *progress], progress, strict=False)]
        seq: _Sequence = run.seq
        rollout = Rollout(
            # the world's seed; a task whose worlds have none (pddl): its index in the phase
            world=int(r.spec["seed"]) if "seed" in r.spec else r.episode,
            sample=r.sample,
            token_ids=tuple(seq.ids),
            trainable=tuple(seq.trainable),
            logprobs=tuple(seq.logprobs),
            turn_rewards=tuple(gains),
            success=bool(r.success),
            progress=float(r.progress),
            turns=r.steps,
        )
        return Played(rollout, tuple(dict(m) for m in r.messages), tuple(seq.spans), r.termination)

    @staticmethod
    def dump(result: Played) -> Any:  # type: ignore[override]
        raise NotImplementedError("no per-episode journal: a phase is journalled whole (rl/journal.py)")

    @staticmethod
    def load(job: EpisodeJob, record: Any) -> Played:  # type: ignore[override]
        raise NotImplementedError("no per-episode journal: a phase is journalled whole (rl/journal.py)")


def build_template(cfg: Config) -> Any:
    """The run's chat template, resolved as the trainer resolves it (`train.model_source`: an HF or
    GGUF directory's tokenizer and template, else `data.tokenizer` / `data.template`)."""
    from agentrefine_jax.data.pipeline import build_template as from_data
    from agentrefine_jax.hf import model_source

    return from_data(model_source.resolve(cfg).data)


def phase_jobs(cfg: Config, phase: int, workdir: str) -> tuple[Any, list[EpisodeJob]]:
    """The phase's plan (its tasks, to close) and jobs: world-major, `group_size` samples per world,
    each sample its own seed; at most `rl.max_turns` actions (fewer where the task's limit is)."""
    rl = cfg.rl
    if phase < 0:
        raise ValueError(f"phase must be >= 0, got {phase}")
    first = rl.seed + phase * rl.worlds_per_phase
    try:
        worlds = plan([rl.task], rl.worlds_per_phase, seed=first, workdir=workdir)
    except ValueError as e:
        raise ValueError(f"rl.task={rl.task} phase {phase} (worlds from seed {first}): {e}") from None
    jobs = [
        dataclasses.replace(
            w,
            sample=g,
            max_steps=min(w.max_steps, rl.max_turns),
            seed=job_seed(first, w.name, 0, w.episode, g),
        )
        for w in worlds.jobs
        for g in range(rl.group_size)
    ]
    return worlds, jobs


def play(
    model: Any,
    cfg: Config,
    phase: int,
    *,
    progress: Callable[[str], None] | None = None,
    template: Any = None,
    workdir: str | None = None,
    max_in_flight: int = 64,
) -> list[Played]:
    """`collect`, with what each rollout was made from (`Played`)."""
    from agentrefine_jax.inference.chat import ChatGenerator

    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    template = template if template is not None else build_template(cfg)
    if len(template.tokenizer) > model.cfg.vocab_size:
        raise ValueError(
            f"the run's tokenizer has {len(template.tokenizer)} tokens but the model's vocabulary is "
            f"{model.cfg.vocab_size}: they do not belong together"
        )
    scaffold = Scaffold(template)
    # A fresh generator each phase: its cache holds this phase's parameters (nnx.split of `model`).
    generator = ChatGenerator(model, template, name="policy")
    with tempfile.TemporaryDirectory(prefix="rl-rollout-") as scratch:
        worlds, jobs = phase_jobs(cfg, phase, workdir or scratch)
        try:
            protocol = RolloutProtocol(
                generator, scaffold, min(len(jobs), max_in_flight), max_new_tokens=cfg.rl.max_new_tokens,
                temperature=cfg.rl.temperature, top_p=cfg.rl.top_p,
            )  # fmt: skip
            count = [0]

            def report(p: Played) -> None:
                count[0] += 1
                if progress is not None:
                    r = p.rollout
                    progress(
                        f"rollout phase {phase}: {count[0]}/{len(jobs)} episodes (world {r.world} sample "
                        f"{r.sample}: {r.turns} turns, {sum(r.trainable)} sampled tokens, {p.termination})"
                    )

            return core.run_episodes(jobs, protocol, on_done=report)
        finally:
            worlds.close()


def collect(
    model: Any,
    cfg: Config,
    phase: int,
    *,
    progress: Callable[[str], None] | None = None,
    template: Any = None,
    workdir: str | None = None,
    max_in_flight: int = 64,
) -> list[Rollout]:
    """The phase's rollouts, world-major (world i's G samples together, sample 0 first).

    `model`: the policy's current nnx Transformer; `template`: the run's chat template (default: as
    the trainer resolves it from `cfg`); `workdir`: scratch for tasks that write files (default: a
    temporary directory); `max_in_flight`: episodes decoded together (one KV-cache row each; the
    phase's rollouts depend on it, so a run keeps it fixed); `progress(line)` after each finished
    episode. A world whose environment fails to start raises RuntimeError; an episode that fills the
    model's context ends there (termination context_overflow), its turns so far kept."""
    played = play(
        model, cfg, phase, progress=progress, template=template, workdir=workdir, max_in_flight=max_in_flight
    )
    return [p.rollout for p in played]
