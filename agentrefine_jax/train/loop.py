"""The training loop: data -> sharded step -> hooks (metrics, eval, checkpoints, export).

Re-running the same command with the same `train.run_dir` resumes from the newest intact
checkpoint (params and optimizer state; the data position is the global step) and reproduces
the uninterrupted run step for step, on any number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from agentrefine_jax import cli_errors, faults
from agentrefine_jax import sharding as shd
from agentrefine_jax.checkpoint import (
    CheckpointIntegrityError,
    CheckpointMeta,
    TrainCheckpoints,
    choose_resume_step,
    make_meta,
    read_meta,
    restore_train_state,
)
from agentrefine_jax.config import Config
from agentrefine_jax.config_checks import ConfigError
from agentrefine_jax.data.packing import BATCH_KEYS
from agentrefine_jax.hf import model_source
from agentrefine_jax.paths import as_path, join
from agentrefine_jax.train import flops, save_strategy
from agentrefine_jax.train.hooks import (
    Checkpointing,
    Evaluate,
    ExportAtEnd,
    Hook,
    MetricsLog,
    Preempted,
    Preemption,
    RunState,
)
from agentrefine_jax.train.metrics import MetricsWriter
from agentrefine_jax.train.optimizer import make_optimizer
from agentrefine_jax.train.param_mode import ParamMode
from agentrefine_jax.train.run_dir import (
    RunPaths,
    TrainingError,
    TrainingInputError,
    check_resume_config,
    check_schedule,
    check_trains_on_data,
)
from agentrefine_jax.train.run_lock import RunLock
from agentrefine_jax.train.step import StepFns, build_steps

__all__ = ["Preempted", "TrainingError", "TrainingInputError", "build_train_step", "train"]

log = logging.getLogger("agentrefine_jax.train")


def check_batch_split(cfg: Config, mesh: jax.sharding.Mesh) -> None:
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.train.micro_batch_size or cfg.train.global_batch_size
    if micro % batch_shards:
        raise TrainingError(
            f"the (micro) batch of {micro} rows cannot be split over data x fsdp = {batch_shards} devices; "
            "use a batch that is a multiple of it, or a mesh with fewer batch shards (e.g. more tensor)"
        )


def build_train_step(cfg: Config, mesh: jax.sharding.Mesh, total_steps: int) -> tuple[StepFns, Any]:
    """The trainer's jitted steps on `mesh` and its LR schedule; `train.aot` compiles this same
    step ahead of time for a TPU slice."""
    check_batch_split(cfg, mesh)
    optimizer, schedule = make_optimizer(cfg.optim, total_steps)
    fns = build_steps(
        cfg.model,
        optimizer,
        mesh,
        cfg.mesh.rules,
        global_batch=cfg.train.global_batch_size,
        micro_batch=cfg.train.micro_batch_size,
        loss_chunk=cfg.train.loss_chunk_size,
        loss_impl=cfg.train.loss_impl,
        mode=ParamMode.of(cfg),
        objective=cfg.train.objective,
        knobs={
            "beta": cfg.train.beta,
            "sft_weight": cfg.train.sft_weight,
            "dpo_weight": cfg.train.dpo_weight,
            "clip_low": cfg.rl.clip_low,
            "clip_high": cfg.rl.clip_high,
            "kl_coef": cfg.rl.kl_coef,
        },
        router_aux_coef=cfg.model.router_aux_loss_coef if cfg.train.router_aux_loss else 0.0,
    )
    return fns, schedule


def to_global(
    batch: dict[str, np.ndarray],
    sharding: jax.sharding.NamedSharding,
    global_batch: int,
    dtypes: dict[str, Any] | None = None,
) -> dict:
    """This process's rows of a global batch as global arrays: `dtypes` (the step's
    StepFns.batch_dtypes; default the packed SFT batch's int32 BATCH_KEYS) names what it holds."""
    out = {}
    for k, dtype in (dtypes or dict.fromkeys(BATCH_KEYS, np.int32)).items():
        local = np.asarray(batch[k], dtype=dtype)
        out[k] = jax.make_array_from_process_local_data(sharding, local, (global_batch, *local.shape[1:]))
    return out


def run_steps(
    step: Callable[[Any, Any, Any], tuple[Any, Any, Any]],
    state: RunState,
    batches: Iterator[dict[str, jax.Array]],
    hooks: Sequence[Hook],
) -> None:
    """Step until `state.total_steps` (or the data ends); metrics are read one step late, and
    before any hook that `wants` the step (a save, an evaluation, a preemption) acts on it.

    Each step's `done_at` is the first moment the host saw it finished: right after its dispatch
    returned when it was already done (XLA:CPU may run a step inside the call), or when its metrics
    were read. Timing the hooks' call instead would charge one step's time to its neighbour whenever
    two steps are read back to back (a save or an evaluation wants the newest), so a throughput or
    MFU row could read near zero and the next one impossibly high.

    A read can also return late: the host thread is descheduled or waits for the GIL (a busy
    machine, the background save's threads) while the device finishes step k-1 *and* step k. Then
    the host saw both finish at once and cannot tell where one ended: each is charged half of the
    pair's time (CI, stop 57: step 4 of a run read 222,038 tokens/s, 260x its median).

    Or it returns late by less than a step: the host comes back after step k-1 finished but before
    step k did, so step k is seen finishing a moment after k-1 and would be charged a sliver of its
    time (stop 64: 0.3 ms against a median of 11 ms). Step k-1 is then found already finished when
    the host comes to read it: all the host knows is that it finished after the last time it was
    seen running and before now, so it is charged the middle of that interval (the error is at most
    half the interval, where "now" could be off by all of it)."""
    # (step, metrics, when the host saw it finished or None, when the host last saw it running)
    pending: tuple[int, Any, float | None, float] | None = None
    last_done: float | None = None  # when the host saw the step before `pending` finish

    def ready_at(metrics: Any) -> float | None:
        return time.perf_counter() if all(x.is_ready() for x in jax.tree.leaves(metrics)) else None

    def seen(step_no: int, metrics: Any, running_at: float) -> tuple[int, Any, float | None, float]:
        """Look at a step once more: finished (and when), or still running (and when seen so)."""
        at = ready_at(metrics)
        return (step_no, metrics, at, running_at if at is not None else time.perf_counter())

    def read_pending(newer: Any = None) -> None:
        """Hand the pending step's metrics to the hooks; `newer`: the metrics of the step
        dispatched after it, if any (to tell whether this read came after both had finished)."""
        nonlocal pending, last_done
        if pending is not None:
            done, metrics, done_at, running_at = pending
            pending = None
            # Found finished before the read: it ended while the host was away, it cannot say when.
            already = ready_at(metrics) if done_at is None else None
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if done_at is None:
                done_at = time.perf_counter() if already is None else (running_at + already) / 2
                if newer is not None and last_done is not None and ready_at(newer) is not None:
                    done_at = (last_done + time.perf_counter()) / 2  # see the docstring: a late read
            last_done = done_at
            for h in hooks:
                h.on_metrics(done, m, done_at)

    while state.step < state.total_steps:
        try:
            batch = next(batches)
        except StopIteration:
            break
        if pending is not None and pending[2] is None:
            pending = seen(*pending[:2], pending[3])
        state.params, state.opt_state, metrics = step(state.params, state.opt_state, batch)
        state.step += 1
        faults.swallowed("dropped_in_library", state.step)
        cli_errors.raise_if_interrupted()  # a Ctrl-C that a library's bare `except:` dropped
        if last_done is None:
            # This process's first step has no predecessor: a late read of it shares the time from
            # when its dispatch (and compile) returned.
            last_done = time.perf_counter()
        read_pending(metrics)  # step k-1: the device is already busy with step k
        pending = seen(state.step, metrics, time.perf_counter())
        if any([h.wants(state.step) for h in hooks]):  # every hook is asked (no short circuit)
            read_pending()
        for h in hooks:
            h.after_step(state)
    read_pending()


def train(cfg: Config) -> dict[str, Any]:
    """Run (or resume) training; returns a summary with the final step and losses.
    Holds the run directory's lock throughout (RunDirInUse when another trainer has it)."""
    try:
        cfg = model_source.resolve(cfg)  # the train CLI did; callers of train() may not have
    except ConfigError as e:
        raise TrainingInputError(str(e)) from None
    check_trains_on_data(cfg)
    paths = RunPaths(cfg.train.run_dir)
    with RunLock(paths.root, take=jax.process_index() == 0):
        return _train(cfg, paths)


def _train(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    tc = cfg.train
    mesh = run_mesh(cfg)
    check_resume_config(paths, cfg)
    check_model(cfg)
    pipeline, batch_rows, total_steps = _train_pipeline(cfg, mesh)
    run = start_run(cfg, paths, mesh, total_steps, pipeline.steps_per_epoch)
    state = run.state
    evaluate_hook = _evaluate_hook(cfg, run.fns, run.writer, batch_rows)
    hooks = run.hooks(*([evaluate_hook] if evaluate_hook else []))
    log.info(
        f"training steps {state.start_step} -> {total_steps} ({pipeline.steps_per_epoch} steps/epoch, "
        f"{tc.num_epochs} epochs, global batch {tc.global_batch_size} x {cfg.data.max_length} tokens)"
    )
    batches = (  # the data position is the global step
        to_global(local, run.fns.batch_sharding, tc.global_batch_size)
        for local in pipeline.iterator(state.start_step)
    )
    with run.closing():
        run_steps(run.checkpointing.strategy.step, state, batches, [*hooks, run.preemption])
        for h in hooks:
            h.at_end(state)
    log.info(f"done: step {state.step}, checkpoint {paths.checkpoints}/{state.step}")
    run.export_at_end()
    return {"step": state.step, "losses": run.metrics_log.losses, "run_dir": str(paths.root)}


@dataclasses.dataclass
class Run:
    """A run's machinery around its step, set up once by `start_run` (the trainer's loop and the
    GRPO loop, rl/loop.py, share it): the jitted steps and schedule, the checkpoints and the state
    restored from them (or fresh), metrics.jsonl, the metrics log, checkpointing and preemption."""

    cfg: Config
    paths: RunPaths
    mesh: jax.sharding.Mesh
    fns: StepFns
    schedule: Any
    meta: CheckpointMeta
    ckpts: TrainCheckpoints
    state: RunState
    writer: MetricsWriter
    metrics_log: MetricsLog
    checkpointing: Checkpointing
    preemption: Preemption

    def hooks(self, *extra: Hook) -> list[Hook]:
        """The run's hooks in order: metrics log, `extra` (e.g. evaluation), checkpointing
        (preemption is the loop's last hook, after these)."""
        return [self.metrics_log, *extra, self.checkpointing]

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """The stepping block: afterwards (also on an error) metrics.jsonl is closed and every
        background save finished."""
        ok = False
        try:
            yield
            ok = True
        finally:
            self.writer.close(failing=not ok, storage_failed=self.ckpts.failed)
            self.checkpointing.finish()

    def export_at_end(self) -> None:
        """`train.export_hf_at_end`, when set (SIGTERM interrupts it: Preempted)."""
        if not self.cfg.train.export_hf_at_end:
            return
        fns, cfg, mesh, dtype = self.fns, self.cfg, self.mesh, self.meta.source_dtype
        with self.preemption.interrupting():
            ExportAtEnd(lambda p, s: export_final(fns, p, cfg, s, mesh, dtype)).at_end(self.state)


def start_run(
    cfg: Config, paths: RunPaths, mesh: jax.sharding.Mesh, total_steps: int, steps_per_epoch: int
) -> Run:
    """Build the steps for `total_steps`, resume from the newest intact checkpoint (or start
    fresh), open metrics.jsonl at the resumed step and make the hooks every run has."""
    tc = cfg.train
    fns, schedule = build_train_step(cfg, mesh, total_steps)
    try:
        resume_step = choose_resume_step(paths.checkpoints, paths.rejected)
    except CheckpointIntegrityError as e:
        raise TrainingError(str(e)) from None
    meta = run_meta(cfg, paths, fns.mode, resume_step, total_steps, steps_per_epoch)
    keep_every = steps_per_epoch if tc.keep_epoch_checkpoints else 0
    ckpts = TrainCheckpoints(
        paths.checkpoints,
        keep=tc.keep_checkpoints,
        keep_every=keep_every,
        compression=tc.checkpoint_compression,
    )
    state = start_state(cfg, paths, fns, mesh, ckpts, resume_step, total_steps, meta)
    writer = MetricsWriter(paths, state.start_step)
    metrics_log, checkpointing = _hooks(cfg, fns, schedule, writer, ckpts, meta, state)
    preemption = Preemption(checkpointing, str(paths.checkpoints))
    return Run(
        cfg, paths, mesh, fns, schedule, meta, ckpts, state, writer, metrics_log, checkpointing, preemption
    )


def run_mesh(cfg: Config) -> jax.sharding.Mesh:
    """The run's device mesh (`mesh.*`), its global batch checked against the processes and the
    batch shards."""
    try:
        mesh = shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    except ValueError as e:  # mesh sizes that this host's devices cannot fill: the config's fault
        raise TrainingInputError(f"mesh.data/fsdp/tensor: {e}") from None
    pc = jax.process_count()
    if cfg.train.global_batch_size % pc:
        raise TrainingError(
            f"train.global_batch_size={cfg.train.global_batch_size} not divisible by {pc} processes"
        )
    check_batch_split(cfg, mesh)
    log.info(f"mesh {dict(mesh.shape)} over {jax.device_count()} devices ({pc} processes)")
    return mesh


def _train_pipeline(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Any, Any, int]:
    """(the training data pipeline, the rows of each global batch this process holds, total steps)."""
    from agentrefine_jax.data.pipeline import DataError, NoPairsError, make_pipeline, process_batch_rows

    tc = cfg.train
    # Each process materialises exactly the rows of the global batch its devices hold.
    batch_rows = process_batch_rows(shd.batch_sharding(mesh, cfg.mesh.rules), tc.global_batch_size)
    try:
        pipeline = make_pipeline(
            cfg.data,
            split="train",
            global_batch_size=tc.global_batch_size,
            num_epochs=tc.num_epochs,
            batch_rows=batch_rows,
            objective=tc.objective,
        )
    except NoPairsError as e:  # a preference objective on data without pairs: the input's fault
        raise TrainingInputError(str(e)) from None
    except DataError as e:  # unusable data: the one-line reason, not a traceback
        raise TrainingError(str(e)) from None
    log.info(pipeline.report.summary())
    if pipeline.steps_per_epoch < 1:
        raise TrainingError(
            "the training data yields no full batch; lower train.global_batch_size or add data"
        )
    total_steps = pipeline.steps_per_epoch * tc.num_epochs
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps)
    return pipeline, batch_rows, total_steps


def run_meta(
    cfg: Config,
    paths: RunPaths,
    mode: ParamMode,
    resume_step: int | None,
    total_steps: int,
    steps_per_epoch: int,
) -> CheckpointMeta:
    """The meta every checkpoint of this run carries (each save stamps its step and epoch); on
    resume, checked against the checkpoint's: the schedule's horizon and the parameter mode's
    (a LoRA run's base)."""
    source_dtype = None
    stored = read_meta(paths.checkpoints, resume_step) if resume_step is not None else None
    if stored is not None:
        check_schedule(paths, stored, total_steps, cfg)
        source_dtype = stored.source_dtype
    elif cfg.train.init_from_hf:
        from agentrefine_jax.hf.io import hf_storage_dtype

        source_dtype = hf_storage_dtype(cfg.train.init_from_hf)
    meta = make_meta(
        cfg.model,
        step=resume_step or 0,
        config=cfg,
        tokenizer=cfg.data.tokenizer,
        template=cfg.data.template,
        source_dtype=source_dtype,
        schedule_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        **mode.meta_fields(cfg),
    )
    if stored is not None:
        mode.check_resume(stored, meta, what=f"resuming {paths.checkpoints}")
    return meta


def start_state(
    cfg: Config,
    paths: RunPaths,
    fns: StepFns,
    mesh: jax.sharding.Mesh,
    ckpts: TrainCheckpoints,
    resume_step: int | None,
    total_steps: int,
    meta: CheckpointMeta,
) -> RunState:
    """Params and optimizer state restored from `resume_step`, or fresh (then config.json is written)."""
    if resume_step is None:
        params = fns.mode.fresh(cfg, fns.built, mesh, meta)
        opt_state = fns.init_opt(params)
        if jax.process_index() == 0:
            paths.write_config(cfg)
        return RunState(0, total_steps, 0, params, opt_state)
    try:
        restored = restore_train_state(
            ckpts.mngr,
            resume_step,
            {"params": fns.abstract_trainable, "opt_state": fns.abstract_opt},
            {"params": fns.trainable_shardings, "opt_state": fns.opt_shardings},
        )
    except ValueError as e:
        raise TrainingError(str(e)) from None
    params = fns.mode.restored(restored["params"], cfg, fns.built, mesh, meta)
    log.info(f"resumed from {paths.checkpoints}/{resume_step}")
    return RunState(resume_step, total_steps, resume_step, params, restored["opt_state"])


def _step_flops(cfg: Config) -> Callable[[Mapping[str, float]], float]:
    """A step's model FLOPs from its logged counts: the output projection's for the positions it ran
    on (`projected_tokens`: the objective's loss projects only the targets it reads)."""
    seq_len, rows = cfg.data.max_length, cfg.train.global_batch_size

    def count(m: Mapping[str, float]) -> float:
        return flops.flops_per_step(cfg.model, seq_len, rows * seq_len, m["projected_tokens"])

    return count


def _hooks(
    cfg: Config,
    fns: StepFns,
    schedule: Any,
    writer: MetricsWriter,
    ckpts: TrainCheckpoints,
    meta: CheckpointMeta,
    state: RunState,
) -> tuple[MetricsLog, Checkpointing]:
    """Every run's metrics log and checkpointing."""
    tc = cfg.train
    metrics_log = MetricsLog(
        writer,
        schedule,
        log_every=tc.log_every,
        total_steps=state.total_steps,
        step_flops=_step_flops(cfg),
        peak_flops=flops.device_peak_flops(tc.peak_flops_per_device, log=log.info),
        last_good=ckpts.last_good_note,
        raise_peak=flops.measured_peak_raiser(tc.peak_flops_per_device),
    )
    checkpointing = Checkpointing(
        ckpts,
        cfg,
        meta,
        saved=fns.trainable,
        every=tc.checkpoint_every,
        steps_per_epoch=meta.steps_per_epoch or 0,
        start_step=state.start_step,
        before_save=writer.sync,
        # chosen once, from what a save hands over: spare buffers for big states on CPU
        strategy=save_strategy.choose(fns, (fns.trainable(state.params), state.opt_state)),
    )
    return metrics_log, checkpointing


def _evaluate_hook(cfg: Config, fns: StepFns, writer: MetricsWriter, batch_rows: Any) -> Evaluate | None:
    """Held-out loss every `train.eval_every` steps, when asked and there is held-out data."""
    tc = cfg.train
    if not (tc.eval_every and (cfg.data.eval_files or cfg.data.eval_fraction > 0)):
        return None
    from agentrefine_jax.data.pipeline import NoPairsError, make_pipeline

    try:
        eval_pipeline = make_pipeline(
            cfg.data,
            split="eval",
            global_batch_size=tc.global_batch_size,
            num_epochs=1,
            batch_rows=batch_rows,
            objective=tc.objective,
        )
    except NoPairsError as e:
        raise TrainingInputError(f"evaluation: {e}") from None
    return Evaluate(tc.eval_every, lambda p: evaluate(fns, p, eval_pipeline, tc.global_batch_size), writer)


def export_final(
    fns: StepFns,
    params: Any,
    cfg: Config,
    step: int,
    mesh: jax.sharding.Mesh,
    source_dtype: str | None = None,
) -> None:
    """Export to `train.export_hf_at_end` (relative: inside the run dir; may be a URL), replacing an
    earlier export of this run without ever leaving a half-written one in its place. A LoRA run on
    an HF base exports its adapters merged into that base as stored (as `export to-hf --merge-lora`)."""
    from agentrefine_jax.hf.io import resolve_export_dtype, write_hf

    out = join(cfg.train.run_dir, cfg.train.export_hf_at_end)
    dtype = resolve_export_dtype(
        cfg.train.export_dtype, source_dtype=source_dtype, param_dtype=cfg.model.param_dtype
    )
    model = fns.handoff_model(params, cfg, mesh)

    def wrote(_: str) -> None:  # a file of the export is in its staging dir: the fault tests' kill point
        faults.point("during_export", step)

    where = write_hf(
        model,
        cfg.model,
        out,
        overwrite=True,  # an earlier export of this run (checked at config load; never anything else)
        protect=[str(as_path(cfg.train.run_dir))],
        tool="train export_hf_at_end",
        dtype=dtype,
        tokenizer=cfg.data.tokenizer,
        log=wrote,
    )
    log.info(f"exported step {step} as a Hugging Face checkpoint ({dtype}) to {where}")


def evaluate(fns: StepFns, params: Any, pipeline: Any, global_batch: int) -> float:
    total, count = 0.0, 0.0
    for local in pipeline:
        loss_sum, n = fns.evaluate(params, to_global(local, fns.batch_sharding, global_batch))
        total += float(loss_sum)
        count += float(n)
    return total / max(count, 1.0)


def check_model(cfg: Config) -> None:
    """The model's inputs checked before any data work (hf/model_source.check: `train.init_from_hf`
    from its headers, its tokenizer files, the tokenizer against the vocabulary), as exit 2."""
    try:
        model_source.check(cfg)
    except ConfigError as e:
        raise TrainingInputError(str(e)) from None
