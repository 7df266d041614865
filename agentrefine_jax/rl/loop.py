"""The GRPO loop (docs/rl.md): rollout -> update -> rollout, in one process, with the current
parameters (no export, no server).

A run is `rl.phases` phases (train.max_steps / rl.updates_per_phase). Phase p plays
rl.worlds_per_phase training worlds x rl.group_size sampled episodes with the model as the
parameters stand (rl/rollout.py, deterministic for (rl.seed, p)), journals them (rl/journal.py),
turns them into rewards, group advantages and one token row each (rl/batch.py), shuffles the rows
(seeded by (rl.seed, p)) and cuts them into rl.updates_per_phase equal mini-batches, one optimizer
step each — the trainer's own step, optimizer, mesh, checkpoints, metrics and hooks
(train/loop.py's `start_run`). train.global_batch_size is derived: the episodes of one step.

Re-running the same command resumes from the newest intact checkpoint: at a phase's start the
phase is played (or read back from its journal, when it was journaled before the kill), inside a
phase its journal is read and the remaining mini-batches are stepped; the run then equals the
uninterrupted one step for step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from agentrefine_jax import faults, objective_table
from agentrefine_jax.config import Config, to_dict
from agentrefine_jax.config_checks import ConfigError
from agentrefine_jax.hf import model_source
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.rl.batch import ARRAY_KEYS, Rollout, group_advantages, to_arrays
from agentrefine_jax.rl.journal import Phase, RolloutJournal, keep_phases
from agentrefine_jax.train.hooks import Hook, Preempted, RunState
from agentrefine_jax.train.loop import Run, check_model, run_mesh, run_steps, start_run, to_global
from agentrefine_jax.train.metrics import MetricsWriter
from agentrefine_jax.train.run_dir import RunPaths, TrainingError, TrainingInputError, check_resume_config
from agentrefine_jax.train.run_lock import RunLock

__all__ = ["Phases", "Preempted", "TrainingError", "TrainingInputError", "phases_of", "prepare", "train"]

log = logging.getLogger("agentrefine_jax.rl")

PROGRESS_EVERY_S = 30.0  # the rollouts' heartbeat (eval/progress.py); each update logs its own line


@dataclasses.dataclass(frozen=True)
class Phases:
    """The shape of a GRPO run, from its config."""

    phases: int  # rollout phases
    updates: int  # optimizer steps per phase
    episodes: int  # per phase: worlds x group size
    rows: int  # episodes per optimizer step: the step's global batch
    seq_len: int  # an episode's token row (longer episodes are cut, and counted)

    @property
    def total_steps(self) -> int:
        return self.phases * self.updates


def phases_of(cfg: Config) -> Phases:
    """The run's phases; TrainingInputError (one line, exit 2) for settings that do not divide."""
    rl, tc = cfg.rl, cfg.train
    spec = objective_table.get(tc.objective)
    if not spec.rollouts:
        raise TrainingInputError(
            f"train.objective={spec.name} trains on data, not on rollouts: the rl command runs an "
            "objective that learns from the model's own episodes (docs/rl.md); "
            "use python -m agentrefine_jax.train for this one"
        )
    u = rl.updates_per_phase
    if tc.max_steps is None:
        raise TrainingInputError(
            f"train.max_steps must be set: it counts optimizer steps, rl.updates_per_phase={u} per phase"
        )
    if tc.max_steps % u:
        raise TrainingInputError(
            f"train.max_steps={tc.max_steps} is not a whole number of phases of rl.updates_per_phase={u} "
            f"optimizer steps; use a multiple of {u}"
        )
    episodes = rl.worlds_per_phase * rl.group_size
    if episodes % u:
        raise TrainingInputError(
            f"a phase's {episodes} episodes (rl.worlds_per_phase={rl.worlds_per_phase} x "
            f"rl.group_size={rl.group_size}) do not split into rl.updates_per_phase={u} equal mini-batches"
        )
    rows = episodes // u
    micro = tc.micro_batch_size
    if micro and rows % micro:
        raise TrainingInputError(
            f"train.micro_batch_size={micro} does not divide an optimizer step's {rows} episodes "
            f"(rl.worlds_per_phase x rl.group_size / rl.updates_per_phase)"
        )
    seq_len = min(cfg.data.max_length, cfg.model.max_position_embeddings)
    return Phases(tc.max_steps // u, u, episodes, rows, seq_len)


def prepare(cfg: Config) -> Config:
    """`cfg` as the run uses it: train.global_batch_size set to the episodes of one optimizer step
    (checked by `phases_of`); the CLI prints and runs this config."""
    ph = phases_of(cfg)
    check_worlds(cfg, ph)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=ph.rows))


def check_worlds(cfg: Config, ph: Phases) -> None:
    """The first and the last phase's worlds exist (rl.task is a built-in task with a training
    split, and rl.seed's range stays inside it): one line, exit 2, before any model work."""
    from agentrefine_jax.rl.rollout import phase_jobs

    with tempfile.TemporaryDirectory(prefix="rl-worlds-") as scratch:
        for phase in sorted({0, ph.phases - 1}):
            try:
                worlds, _ = phase_jobs(cfg, phase, scratch)
            except ValueError as e:
                raise TrainingInputError(str(e)) from None
            worlds.close()


def train(cfg: Config) -> dict[str, Any]:
    """Run (or resume) a GRPO run; returns its summary (final step, logged losses, run dir).
    Holds the run directory's lock throughout (RunDirInUse when another trainer has it)."""
    try:
        cfg = model_source.resolve(cfg)  # the CLI did; callers of train() may not have
    except ConfigError as e:
        raise TrainingInputError(str(e)) from None
    cfg = prepare(cfg)
    paths = RunPaths(cfg.train.run_dir)
    with RunLock(paths.root, take=jax.process_index() == 0):
        return _train(cfg, paths)


def _train(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    ph = phases_of(cfg)
    if jax.process_count() > 1:
        raise TrainingInputError("the GRPO loop runs in one process (one host's devices); got several")
    mesh = run_mesh(cfg)
    check_resume_config(paths, cfg)
    check_rl_resume(paths, cfg)
    check_model(cfg)
    run = start_run(cfg, paths, mesh, ph.total_steps, steps_per_epoch=ph.updates)
    state = run.state
    journal = RolloutJournal(paths.root, cfg.rl)
    phase_log = PhaseLog(run.writer, ph)
    hooks = run.hooks(phase_log)
    log.info(
        f"GRPO: phases {state.step // ph.updates} -> {ph.phases} of {cfg.rl.worlds_per_phase} "
        f"{cfg.rl.task} worlds x {cfg.rl.group_size} episodes, {ph.updates} optimizer steps of "
        f"{ph.rows} episodes x {ph.seq_len} tokens each"
    )
    with run.closing():
        for phase in range(state.step // ph.updates, ph.phases):
            # The previous phase's checkpoint committed (and hashed) before this phase plays: a kill
            # during the long rollouts then loses no update; then the journals it no longer needs go.
            run.ckpts.poll(wait=True)
            _prune(run, journal, ph, phase)
            played = _phase_rollouts(run, journal, ph, phase)
            arrays, stats = phase_batch(cfg, ph, played, phase)
            first = state.step - phase * ph.updates  # a resume inside the phase: its next mini-batch
            phase_log.start(phase, stats)
            run_steps(
                run.checkpointing.strategy.step,
                state,
                _mini_batches(run, ph, arrays, first),
                [*hooks, run.preemption],
            )
        for h in hooks:
            h.at_end(state)
    _prune(run, journal, ph, ph.phases)  # every save finished: the checkpoints that remain
    log.info(f"done: step {state.step} (phase {state.step // ph.updates}), checkpoint {paths.checkpoints}")
    run.export_at_end()
    return {"step": state.step, "losses": run.metrics_log.losses, "run_dir": str(paths.root)}


def _prune(run: Run, journal: RolloutJournal, ph: Phases, current: int) -> None:
    """Delete the journals that no retained checkpoint (nor the phase under way) resumes into."""
    if jax.process_index() == 0:
        journal.prune(keep_phases(run.ckpts.mngr.all_steps(), ph.updates, current))


def check_rl_resume(paths: RunPaths, cfg: Config) -> None:
    """Refuse to resume a run under different `rl` settings (they say what its episodes and its
    loss were: a resume under others would silently mix two runs)."""
    if not paths.config.exists():
        return
    old = json.loads(paths.config.read_text()).get("rl")
    new = json.loads(json_dumps(to_dict(cfg.rl)))
    if old is not None and old != new:
        changed = ", ".join(f"rl.{k}" for k in sorted(new) if old.get(k) != new[k])
        raise TrainingInputError(
            f"{paths.root} holds a GRPO run with different rl settings ({changed} "
            "changed); resuming would silently mix two runs. Use a new train.run_dir or restore the original "
            "settings."
        )


def _phase_rollouts(run: Run, journal: RolloutJournal, ph: Phases, phase: int) -> Phase:
    """The phase's episodes: read back from its journal, or played with the current parameters
    (then journaled before any update). A resume inside a phase must find its journal."""
    state = run.state
    played = journal.read(phase)
    if played is not None:
        log.info(f"phase {phase}: {len(played.rollouts)} episodes read back from {journal.path(phase)}")
        return played
    if state.step != phase * ph.updates:
        raise TrainingError(
            f"resuming at step {state.step}, inside phase {phase}, needs that phase's episodes from "
            f"{journal.path(phase)}, which is missing: the parameters they were played with are gone. "
            f"Resume from an earlier checkpoint (move the later ones away) or start a new train.run_dir."
        )
    played = play(run.fns.model(state.params), run.cfg, phase)
    if jax.process_index() == 0:
        journal.write(phase, played)
    faults.point("after_rollouts", phase)
    if run.preemption.requested:  # SIGTERM while playing: the episodes are kept, stop before updating
        run.checkpointing.save(state)
        run.checkpointing.finish()
        raise Preempted(
            f"preempted: phase {phase}'s episodes journaled, checkpoint at step {state.step} in "
            f"{run.paths.checkpoints}; rerun the same command to resume"
        )
    return played


def play(model: Any, cfg: Config, phase: int) -> Phase:
    """Play the phase's episodes (rl/rollout.py) with a progress line every PROGRESS_EVERY_S."""
    from agentrefine_jax.eval.progress import Progress
    from agentrefine_jax.rl.rollout import collect

    t0 = time.perf_counter()
    # The episode engine reports into the active heartbeat (eval/core.py); a line per finished
    # episode goes to the debug log (-v).
    with Progress(PROGRESS_EVERY_S, lambda line: log.info(f"phase {phase} rollouts {line}")):
        try:
            rollouts = collect(model, cfg, phase, progress=log.debug)
        except ValueError as e:  # the settings' fault (checked up front: rarely reached)
            raise TrainingInputError(f"phase {phase} rollouts: {e}") from None
        except RuntimeError as e:  # an environment that failed to start
            raise TrainingError(f"phase {phase} rollouts: {e}") from None
    return Phase(list(rollouts), time.perf_counter() - t0)


def phase_batch(
    cfg: Config, ph: Phases, played: Phase, phase: int
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The phase's token rows ([episodes, seq_len] each of ARRAY_KEYS), shuffled by (rl.seed,
    phase) so that a mini-batch mixes worlds, and the phase's episode statistics."""
    rl, rollouts = cfg.rl, played.rollouts
    if len(rollouts) != ph.episodes:
        raise TrainingError(f"phase {phase}: {len(rollouts)} episodes played, expected {ph.episodes}")
    rewards = [r.reward(rl.reward, rl.progress_weight) for r in rollouts]
    worlds = [r.world for r in rollouts]
    advantages = group_advantages(rewards, worlds, rl.advantage_norm)
    order = np.random.default_rng([rl.seed, phase]).permutation(len(rollouts))
    arrays, cut = to_arrays([rollouts[i] for i in order], advantages[order], ph.seq_len)
    if cut:
        log.warning(
            f"WARNING: phase {phase}: {cut} of {len(rollouts)} episodes longer than {ph.seq_len} tokens "
            "were cut (their later tokens are not trained on); raise data.max_length or lower rl.max_turns"
        )
    return arrays, episode_stats(rollouts, rewards, worlds, cut, played.seconds)


def episode_stats(
    rollouts: Sequence[Rollout], rewards: Sequence[float], worlds: Sequence[int], cut: int, seconds: float
) -> dict[str, float]:
    """What the phase row of metrics.jsonl says about a phase's episodes."""
    r = np.asarray(rewards, np.float64)
    sampled = sum(sum(x.trainable) for x in rollouts)
    by_world: dict[int, set[float]] = {}
    for w, v in zip(worlds, rewards, strict=True):
        by_world.setdefault(w, set()).add(v)
    return {
        "episodes": len(rollouts),
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "success_rate": float(np.mean([x.success for x in rollouts])),
        "progress_mean": float(np.mean([x.progress for x in rollouts])),
        "episode_turns": float(np.mean([x.turns for x in rollouts])),
        "episode_tokens": float(np.mean([len(x.token_ids) for x in rollouts])),
        "sampled_tokens": int(sampled),
        # groups whose episodes' rewards differ: the only ones with a non-zero advantage
        "groups_with_signal": sum(len(v) > 1 for v in by_world.values()) / max(len(by_world), 1),
        "cut_episodes": cut,
        "rollout_seconds": seconds,
        "rollout_tokens_per_sec": sampled / max(seconds, 1e-9),
    }


def _mini_batches(run: Run, ph: Phases, arrays: dict[str, np.ndarray], first: int) -> Iterator[dict]:
    """The phase's mini-batches from `first` on, as global arrays on the step's batch sharding, in
    the step's dtypes (StepFns.batch_dtypes: ids int32, log-probabilities and advantages float32)."""
    fns = run.fns
    for i in range(first, ph.updates):
        rows = slice(i * ph.rows, (i + 1) * ph.rows)
        local = {k: arrays[k][rows] for k in ARRAY_KEYS}
        yield to_global(local, fns.batch_sharding, ph.rows, fns.batch_dtypes)


class PhaseLog(Hook):
    """After each phase's last optimizer step (before its checkpoint is saved): one metrics.jsonl
    row for the phase — its episodes' statistics, the rollout and training throughputs — and a
    log line. A resume inside a phase writes the row when it finishes the phase (rows past the
    resumed step are dropped on resume: each phase's row appears once)."""

    def __init__(self, writer: MetricsWriter, ph: Phases) -> None:
        self.writer, self.ph = writer, ph
        self.phase: int | None = None
        self.stats: dict[str, float] = {}
        self.t0, self.tokens = time.perf_counter(), 0.0

    def start(self, phase: int, stats: dict[str, float]) -> None:
        self.phase, self.stats = phase, stats
        self.t0, self.tokens = time.perf_counter(), 0.0

    def wants(self, step: int) -> bool:
        return step % self.ph.updates == 0

    def on_metrics(self, step: int, m: Any, done_at: float) -> None:
        self.tokens += m["tokens"]

    def after_step(self, state: RunState) -> None:
        if state.step % self.ph.updates or self.phase is None:
            return
        s = self.stats
        train_tps = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.writer.write({"step": state.step, "phase": self.phase, **s, "train_tokens_per_sec": train_tps})
        log.info(
            f"phase {self.phase} (of {self.ph.phases}): "
            f"reward {s['reward_mean']:.3f} ± {s['reward_std']:.3f}  "
            f"success {100 * s['success_rate']:.0f}%  progress {s['progress_mean']:.2f}  "
            f"{s['episode_turns']:.1f} turns  {s['episode_tokens']:.0f} tok/episode  "
            f"rollouts {s['rollout_tokens_per_sec']:,.0f} sampled tok/s  updates {train_tps:,.0f} tok/s"
        )
        self.phase = None
