"""The training loop: data -> sharded step -> metrics, checkpoints, resume, preemption.

Re-running the same command with the same `train.run_dir` resumes from the latest
checkpoint (params, optimizer state, data-iterator state) and reproduces the
uninterrupted run step for step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from agentrefine_jax import sharding as shd
from agentrefine_jax.checkpoint import (
    ITEM_META,
    ITEM_PARAMS,
    CheckpointIntegrityError,
    as_path,
    is_url,
    newest_intact_step,
    read_meta,
    write_manifest,
)
from agentrefine_jax.config import Config, to_dict
from agentrefine_jax.train import flops
from agentrefine_jax.train.optimizer import horizon_matters, make_optimizer
from agentrefine_jax.train.step import BATCH_KEYS, StepFns, build_steps

# Sections of the config that must not change when a run resumes.
_FROZEN_ON_RESUME = ("model", "data", "optim")
_FROZEN_TRAIN_KEYS = ("global_batch_size", "micro_batch_size", "seed", "init_from_hf", "loss_chunk_size")
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "stopped cleanly, run the same command again"


class TrainingError(RuntimeError):
    """A run stopped for a reason the user must act on (NaN, no loss tokens, bad config)."""


def is_main_process() -> bool:
    return jax.process_index() == 0


def log(msg: str) -> None:
    if is_main_process():
        print(msg, flush=True)


@dataclasses.dataclass
class RunPaths:
    """The run directory's layout; `root` may be a URL (gs://...), never turned into a local path."""

    root: epath.Path

    def __post_init__(self) -> None:
        self.root = as_path(self.root)

    @property
    def checkpoints(self) -> epath.Path:
        return self.root / "checkpoints"

    @property
    def rejected(self) -> epath.Path:
        """Where checkpoints that fail verification are moved (kept for inspection, out of Orbax's way)."""
        return self.root / "checkpoints_rejected"

    @property
    def metrics(self) -> epath.Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> epath.Path:
        return self.root / "config.json"

    @property
    def tensorboard(self) -> epath.Path:
        return self.root / "tensorboard"


def check_resume_config(paths: RunPaths, cfg: Config) -> None:
    """Refuse to resume a run under a different model/data/optimizer configuration."""
    if not paths.config.exists():
        return
    old = json.loads(paths.config.read_text())
    new = json.loads(json.dumps(to_dict(cfg)))
    diffs = [k for k in _FROZEN_ON_RESUME if old.get(k) != new.get(k)]
    diffs += [f"train.{k}" for k in _FROZEN_TRAIN_KEYS if old.get("train", {}).get(k) != new["train"].get(k)]
    if diffs:
        raise TrainingError(
            f"{paths.root} holds a run with a different configuration ({', '.join(diffs)} changed); "
            "resuming would silently mix two runs. Use a new train.run_dir or restore the original settings."
        )


def make_checkpoint_manager(paths: RunPaths, cfg: Config, steps_per_epoch: int = 0) -> ocp.CheckpointManager:
    import grain
    from orbax.checkpoint import checkpoint_managers as policies

    keep: Any = policies.LatestN(n=cfg.train.keep_checkpoints)
    if cfg.train.keep_epoch_checkpoints and steps_per_epoch > 0:
        keep = policies.AnyPreservationPolicy([keep, policies.EveryNSteps(interval_steps=steps_per_epoch)])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=keep,
        enable_async_checkpointing=True,
        create=True,
    )
    return ocp.CheckpointManager(
        paths.checkpoints,
        options=options,
        item_handlers={
            # Same item names and formats as `agentrefine_jax.checkpoint`, which export,
            # generation and serving read; the trainer adds optimizer and data state.
            ITEM_PARAMS: ocp.StandardCheckpointHandler(),
            ITEM_META: ocp.JsonCheckpointHandler(),
            "opt_state": ocp.StandardCheckpointHandler(),
            "data_iter": grain.checkpoint.CheckpointHandler(),
        },
    )


def _meta(cfg: Config, step: int, facts: dict[str, Any] | None = None) -> dict[str, Any]:
    from agentrefine_jax.checkpoint import make_meta

    extra = dict(facts or {})
    spe = extra.get("steps_per_epoch") or 0
    extra["epoch"] = step // spe if spe and step % spe == 0 else None
    return make_meta(
        cfg.model,
        step=step,
        tokenizer=cfg.data.tokenizer,
        template=cfg.data.template,
        config=cfg,
        extra=extra,
    )


def save_checkpoint(
    mngr: ocp.CheckpointManager,
    step: int,
    params: Any,
    opt_state: Any,
    data_iter: Any,
    cfg: Config,
    facts: dict[str, Any] | None = None,
) -> None:
    import grain

    mngr.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(_meta(cfg, step, facts)),
            data_iter=grain.checkpoint.CheckpointSave(data_iter),
        ),
        force=True,
    )


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "orbax" in record.pathname:
            record.exc_info, record.exc_text = None, None
        return True


def _one_line_orbax_errors() -> None:
    """Orbax logs each background save failure with a full traceback from several threads; the
    run reports the failure itself (CheckpointSaveError), so keep Orbax's to one line each."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _NoTraceback) for f in absl_logger.filters):
        absl_logger.addFilter(_NoTraceback())


class CheckpointSaveError(TrainingError):
    """An (asynchronous) checkpoint save failed: disk full, no permission, bucket gone..."""


class RunCheckpoints:
    """The run's Orbax manager plus what Orbax does not do: a checksum manifest written once a
    step is finalised, and save failures surfaced at the next step instead of at the end."""

    def __init__(self, paths: RunPaths, cfg: Config, steps_per_epoch: int) -> None:
        _one_line_orbax_errors()
        self.paths = paths
        self.mngr = make_checkpoint_manager(paths, cfg, steps_per_epoch)
        self.pending: list[int] = []
        self.failed = False

    def save(self, step: int, params: Any, opt_state: Any, data_iter: Any, cfg: Config, facts: Any) -> None:
        # Orbax would wait for the previous save here anyway; finishing it first lets its manifest
        # be written before the keep policy can delete anything.
        self.poll(wait=True)
        try:
            save_checkpoint(self.mngr, step, params, opt_state, data_iter, cfg, facts)
        except Exception as e:  # noqa: BLE001 - any storage error ends the run with one line
            self._fail(step, e)
        self.pending.append(step)

    def poll(self, wait: bool = False) -> None:
        """Raise CheckpointSaveError if a save failed; write the manifests of finished saves."""
        if not self.pending or self.failed:
            return
        if not wait and self.mngr.is_saving_in_progress():
            return
        try:
            self.mngr.wait_until_finished()  # returns at once unless `wait`; re-raises a failed save
        except Exception as e:  # noqa: BLE001
            self._fail(self.pending[-1], e)
        if is_main_process():
            kept = set(self.mngr.all_steps())
            for step in self.pending:
                if step in kept and (self.paths.checkpoints / str(step)).exists():  # not removed since
                    write_manifest(self.paths.checkpoints / str(step))
        self.pending.clear()

    def _fail(self, step: int, e: BaseException) -> None:
        self.failed = True
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointSaveError(
            f"saving checkpoint step {step} to {self.paths.checkpoints} failed "
            f"({type(e).__name__}: {first}); the run stopped. {self.last_good_note()}"
        ) from None

    def last_good_note(self) -> str:
        """Names the newest checkpoint that really exists and is complete."""
        if not self.failed:
            self.poll(wait=True)
        done = [s for s in self.mngr.all_steps() if s not in self.pending]
        if not done:
            return "No checkpoint has been written yet."
        return f"Last good checkpoint: step {max(done)} in {self.paths.checkpoints}."

    def finish(self) -> None:
        self.poll(wait=True)


def choose_resume_step(paths: RunPaths) -> int | None:
    """The newest intact checkpoint step (None: fresh run); newer broken ones are reported by name
    and moved to `checkpoints_rejected/` so the run continues from the intact one and can save
    those steps again. Process 0 decides; every process gets the same answer."""
    code, error = -1, ""
    if is_main_process():
        try:
            step, skipped = newest_intact_step(paths.checkpoints)
            for bad, problem in skipped:
                dest = paths.rejected / f"{bad}-{time.strftime('%Y%m%d-%H%M%S')}"
                paths.rejected.mkdir(parents=True, exist_ok=True)
                (paths.checkpoints / str(bad)).rename(dest)
                log(f"WARNING: {problem}; moved it to {dest} and falling back to an earlier checkpoint")
            code = -1 if step is None else step
        except CheckpointIntegrityError as e:
            code, error = -2, str(e)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if code == -2:
        raise TrainingError(error or f"no intact checkpoint in {paths.checkpoints} (see process 0's log)")
    return None if code < 0 else code


def check_schedule(paths: RunPaths, meta: dict[str, Any], total_steps: int, cfg: Config) -> None:
    """The LR schedule is part of the optimizer state's meaning: a new horizon must be asked for
    (only where it changes the learning rate: cosine, not constant)."""
    old = meta.get("schedule_steps")
    if old is None or int(old) == total_steps or not horizon_matters(cfg.optim):
        return
    allow_change = cfg.train.allow_schedule_change
    if not allow_change:
        raise TrainingError(
            f"{paths.root} was trained on a {old}-step learning-rate schedule, this run's schedule has "
            f"{total_steps} steps (train.max_steps / train.num_epochs changed); resuming would change "
            f"the learning rate mid-run. Restore the original settings, or set "
            f"train.allow_schedule_change=true to continue on the {total_steps}-step schedule."
        )
    log(
        f"NOTE: schedule horizon changed from {old} to {total_steps} steps "
        f"(train.allow_schedule_change=true); the learning rate follows the new schedule from here"
    )


def restore_checkpoint(
    mngr: ocp.CheckpointManager, step: int, fns: StepFns, data_iter: Any
) -> tuple[Any, Any]:
    import grain

    def target(abstract: Any, shardings: Any) -> Any:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )

    abstract_params, abstract_opt = fns.abstract_params, fns.abstract_opt
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target(abstract_params, fns.param_shardings)),
            opt_state=ocp.args.StandardRestore(target(abstract_opt, fns.opt_shardings)),
            data_iter=grain.checkpoint.CheckpointRestore(data_iter),
        ),
    )
    _check_restored(restored["params"], abstract_params, "params")
    _check_restored(restored["opt_state"], abstract_opt, "opt_state")
    return restored["params"], restored["opt_state"]


def _check_restored(tree: Any, abstract: Any, what: str) -> None:
    """A missing or mis-shaped leaf must never be filled in silently."""
    got = jax.tree.structure(tree)
    want = jax.tree.structure(abstract)
    if got != want:
        raise TrainingError(f"checkpoint {what} tree does not match the model: {got} vs {want}")
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(abstract), strict=True
    ):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TrainingError(
                f"checkpoint {what}{jax.tree_util.keystr(path)} has {a.shape}/{a.dtype}, "
                f"model expects {b.shape}/{b.dtype}"
            )


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding, global_batch: int) -> dict:
    out = {}
    for k in BATCH_KEYS:
        local = np.asarray(batch[k], dtype=np.int32)
        out[k] = jax.make_array_from_process_local_data(sharding, local, (global_batch, *local.shape[1:]))
    return out


class _Preemption:
    """SIGTERM (TPU maintenance / spot preemption) -> save at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._multi = jax.process_count() > 1
        if not self._multi:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def check(self, step: int) -> bool:
        if self._multi:
            # All hosts must agree on the step to save at, or the collective save deadlocks.
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self.requested


def json_row(row: dict[str, Any]) -> str:
    """One JSON line; NaN/inf become null (bare NaN is not JSON)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


class MetricsWriter:
    """metrics.jsonl (+ TensorBoard). On resume from step k, rows past k are dropped first: those
    steps are trained again, and a step must appear once. Remote run dirs (object stores cannot
    append) get the whole file rewritten, at most every `remote_flush_s` and on close."""

    remote_flush_s = 30.0

    def __init__(self, paths: RunPaths, resume_step: int = 0) -> None:
        self.enabled = is_main_process()
        self._tb = None
        self._file: Any = None
        if not self.enabled:
            return
        paths.root.mkdir(parents=True, exist_ok=True)
        self._path = paths.metrics
        self._remote = is_url(paths.root)
        self._lines = self._kept_lines(resume_step)
        self._last_flush = 0.0
        if not self._remote:
            self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(paths.tensorboard))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is the record.
            self._tb = None
        except Exception as e:  # noqa: BLE001 - e.g. a URL scheme tensorboardX cannot write
            log(f"WARNING: TensorBoard disabled ({type(e).__name__}: {e}); metrics.jsonl still written")
            self._tb = None

    def _kept_lines(self, resume_step: int) -> list[str]:
        if not self._path.exists():
            return []
        kept, dropped, broken = [], 0, 0
        for line in self._path.read_text().splitlines():
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                broken += 1  # e.g. a line cut short by a kill
                continue
            if step > resume_step:
                dropped += 1
            else:
                kept.append(line)
        if dropped or broken:
            log(
                f"metrics.jsonl: dropped {dropped} row(s) past step {resume_step} (trained again now)"
                + (f" and {broken} unreadable line(s)" if broken else "")
            )
            self._path.write_text("".join(x + "\n" for x in kept))
        return kept

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json_row(row)
        if self._remote:
            self._lines.append(line)
            if time.monotonic() - self._last_flush > self.remote_flush_s:
                self._flush_remote()
        else:
            self._file.write(line + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(k, v, row["step"])

    def _flush_remote(self) -> None:
        self._path.write_text("".join(x + "\n" for x in self._lines))
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._remote:
            self._flush_remote()
        elif self._file is not None and not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def train(cfg: Config) -> dict[str, Any]:
    """Run (or resume) training; returns a summary with the final step and losses."""
    from agentrefine_jax.data.pipeline import make_pipeline

    tc = cfg.train
    paths = RunPaths(tc.run_dir)
    mesh = shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    rules = cfg.mesh.rules
    pc, pi = jax.process_count(), jax.process_index()
    if tc.global_batch_size % pc:
        raise TrainingError(f"train.global_batch_size={tc.global_batch_size} not divisible by {pc} processes")
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = tc.micro_batch_size or tc.global_batch_size
    if micro % batch_shards:
        raise TrainingError(
            f"the (micro) batch of {micro} rows cannot be split over data x fsdp = {batch_shards} devices; "
            "use a batch that is a multiple of it, or a mesh with fewer batch shards (e.g. more tensor)"
        )
    log(f"mesh {dict(mesh.shape)} over {jax.device_count()} devices ({pc} processes)")

    check_resume_config(paths, cfg)
    pipeline = make_pipeline(
        cfg.data,
        split="train",
        global_batch_size=tc.global_batch_size,
        num_epochs=tc.num_epochs,
        process_index=pi,
        process_count=pc,
    )
    log(pipeline.report.summary())
    if pipeline.steps_per_epoch < 1:
        raise TrainingError(
            "the training data yields no full batch; lower train.global_batch_size or add data"
        )
    total_steps = pipeline.steps_per_epoch * tc.num_epochs
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps)
    optimizer, schedule = make_optimizer(cfg.optim, total_steps)
    resume_step = choose_resume_step(paths)
    facts: dict[str, Any] = {"schedule_steps": total_steps, "steps_per_epoch": pipeline.steps_per_epoch}
    if resume_step is not None:
        meta = read_meta(paths.checkpoints, resume_step)
        check_schedule(paths, meta, total_steps, cfg)
        facts["source_dtype"] = meta.get("source_dtype")

    model_cfg = cfg.model
    fns = build_steps(
        model_cfg,
        optimizer,
        mesh,
        rules,
        global_batch=tc.global_batch_size,
        micro_batch=tc.micro_batch_size,
        loss_chunk=tc.loss_chunk_size,
    )

    ckpts = RunCheckpoints(paths, cfg, pipeline.steps_per_epoch)
    mngr = ckpts.mngr
    data_iter = iter(pipeline)
    if resume_step is not None:
        start_step = resume_step
        params, opt_state = restore_checkpoint(mngr, start_step, fns, data_iter)
        log(f"resumed from {paths.checkpoints}/{start_step}")
    else:
        start_step = 0
        params = _initial_params(cfg, fns, mesh)
        opt_state = fns.init_opt(params)
        if cfg.train.init_from_hf:
            from agentrefine_jax.export.hf_io import hf_storage_dtype

            facts["source_dtype"] = hf_storage_dtype(cfg.train.init_from_hf)
        if is_main_process():
            paths.root.mkdir(parents=True, exist_ok=True)
            paths.config.write_text(json.dumps(to_dict(cfg), indent=2))

    eval_pipeline = None
    if tc.eval_every and (cfg.data.eval_files or cfg.data.eval_fraction > 0):
        eval_pipeline = make_pipeline(
            cfg.data,
            split="eval",
            global_batch_size=tc.global_batch_size,
            num_epochs=1,
            process_index=pi,
            process_count=pc,
        )

    seq_len = cfg.data.max_length
    peak = flops.device_peak_flops(tc.peak_flops_per_device)
    flops_per_step = flops.flops_per_token(model_cfg, seq_len) * tc.global_batch_size * seq_len
    writer = MetricsWriter(paths, start_step)
    preempt = _Preemption()
    step = start_step
    losses: list[float] = []
    last_saved = start_step
    log(
        f"training steps {start_step} -> {total_steps} ({pipeline.steps_per_epoch} steps/epoch, "
        f"{tc.num_epochs} epochs, global batch {tc.global_batch_size} x {seq_len} tokens)"
    )
    t_last, tokens_since, steps_since = time.perf_counter(), 0.0, 0
    t_start = t_last
    try:
        while step < total_steps:
            try:
                local = next(data_iter)
            except StopIteration:
                break
            batch = to_global(local, fns.batch_sharding, tc.global_batch_size)
            params, opt_state, metrics = fns.train(params, opt_state, batch)
            step += 1
            steps_since += 1
            # A scalar fetch per step: NaN or loss-free batches must stop the run at once.
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            ckpts.poll()  # a failed background save stops the run here, not at the end
            try:
                _check_step(m, step)
            except TrainingError as e:
                e = TrainingError(f"{e} {ckpts.last_good_note()}")
                writer.write({"step": step, **m, "error": str(e)})
                raise e from None
            tokens_since += m["tokens"]
            if step % tc.log_every == 0 or step == total_steps:
                now = time.perf_counter()
                dt = max(now - t_last, 1e-9)
                tps = tokens_since / dt
                mfu = (flops_per_step * steps_since / dt / (peak * jax.device_count())) if peak else None
                row = {
                    "step": step,
                    "loss": m["loss"],
                    "lr": float(schedule(step - 1)),
                    "grad_norm": m["grad_norm"],
                    "tokens": int(m["tokens"]),
                    "loss_tokens": int(m["loss_tokens"]),
                    "tokens_per_sec": tps,
                    "mfu": mfu,
                }
                losses.append(m["loss"])
                writer.write(row)
                eta = (now - t_start) / max(step - start_step, 1) * (total_steps - step)
                log(
                    f"step {step}/{total_steps}  loss {m['loss']:.4f}  lr {row['lr']:.3g}  "
                    f"gnorm {m['grad_norm']:.3f}  loss_tok {row['loss_tokens']}  {tps:,.0f} tok/s  "
                    f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}  eta {_format_eta(eta)}"
                )
                t_last, tokens_since, steps_since = now, 0.0, 0
            if eval_pipeline is not None and step % tc.eval_every == 0:
                eval_loss = evaluate(fns, params, eval_pipeline, tc.global_batch_size)
                writer.write({"step": step, "eval_loss": eval_loss})
                log(f"step {step}  eval_loss {eval_loss:.4f}")
            epoch_end = tc.keep_epoch_checkpoints and step % pipeline.steps_per_epoch == 0
            if (tc.checkpoint_every and step % tc.checkpoint_every == 0) or epoch_end:
                ckpts.save(step, params, opt_state, data_iter, cfg, facts)
                last_saved = step
            if preempt.check(step):
                if last_saved != step:
                    ckpts.save(step, params, opt_state, data_iter, cfg, facts)
                ckpts.finish()
                log(f"preempted: saved step {step} to {paths.checkpoints}; rerun the same command to resume")
                writer.close()
                sys.exit(EXIT_PREEMPTED)
        if last_saved != step:
            ckpts.save(step, params, opt_state, data_iter, cfg, facts)
        ckpts.finish()
    finally:
        writer.close()
        if not ckpts.failed:
            ckpts.finish()
    log(f"done: step {step}, checkpoint {paths.checkpoints}/{step}")
    if tc.export_hf_at_end:
        export_final(fns, params, cfg, step, facts.get("source_dtype"))
    return {"step": step, "losses": losses, "run_dir": str(paths.root)}


def export_final(fns: StepFns, params: Any, cfg: Config, step: int, source_dtype: str | None = None) -> None:
    """Export to `train.export_hf_at_end` (relative: inside the run dir; may be a URL), replacing an
    earlier export of this run without ever leaving a half-written one in its place."""
    from flax import nnx

    from agentrefine_jax.checkpoint import join
    from agentrefine_jax.export.hf_io import resolve_export_dtype, write_hf

    out = join(cfg.train.run_dir, cfg.train.export_hf_at_end)
    dtype = resolve_export_dtype(
        cfg.train.export_dtype, source_dtype=source_dtype, param_dtype=cfg.model.param_dtype
    )
    model = nnx.merge(fns.graphdef, params)
    where = write_hf(model, cfg.model, out, replace=True, dtype=dtype, tokenizer=cfg.data.tokenizer)
    log(f"exported step {step} as a Hugging Face checkpoint ({dtype}) to {where}")


def _check_step(m: dict[str, float], step: int) -> None:
    if m["loss_tokens"] <= 0:
        raise TrainingError(
            f"step {step}: the global batch carries no loss tokens (every assistant turn masked?). "
            f"Check data.loss_on and `python -m agentrefine_jax.data stats`. The update was not applied."
        )
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
        raise TrainingError(
            f"step {step}: non-finite loss {m['loss']} / grad norm {m['grad_norm']}; the update was not "
            f"applied and the run stopped."
        )


def evaluate(fns: StepFns, params: Any, pipeline: Any, global_batch: int) -> float:
    total, count = 0.0, 0.0
    for local in pipeline:
        loss_sum, n = fns.evaluate(params, to_global(local, fns.batch_sharding, global_batch))
        total += float(loss_sum)
        count += float(n)
    return total / max(count, 1.0)


def _initial_params(cfg: Config, fns: StepFns, mesh: jax.sharding.Mesh) -> Any:
    if not cfg.train.init_from_hf:
        return fns.init_params(cfg.train.seed)
    from flax import nnx

    from agentrefine_jax.export.hf_io import load_hf_model

    hf_cfg, model = load_hf_model(
        cfg.train.init_from_hf, mesh=mesh, rules=cfg.mesh.rules, param_dtype=cfg.model.param_dtype
    )
    bad = [
        f"{f}: config {getattr(cfg.model, f)!r} vs checkpoint {getattr(hf_cfg, f)!r}"
        for f in cfg.model.architecture_diff(hf_cfg)
    ]
    if bad:
        raise TrainingError(f"train.init_from_hf={cfg.train.init_from_hf} does not match model config: {bad}")
    log(f"initialised from {cfg.train.init_from_hf}")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.device_put(params, fns.param_shardings)
