"""The training loop: data -> sharded step -> metrics, checkpoints, resume, preemption.

Re-running the same command with the same `train.run_dir` resumes from the latest
checkpoint (params, optimizer state, data-iterator state) and reproduces the
uninterrupted run step for step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import signal
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from agentrefine_jax import sharding as shd
from agentrefine_jax.checkpoint import ITEM_META, ITEM_PARAMS
from agentrefine_jax.config import Config, to_dict
from agentrefine_jax.train import flops
from agentrefine_jax.train.optimizer import make_optimizer
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
    root: pathlib.Path

    @property
    def checkpoints(self) -> pathlib.Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> pathlib.Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> pathlib.Path:
        return self.root / "config.json"

    @property
    def tensorboard(self) -> pathlib.Path:
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


def make_checkpoint_manager(paths: RunPaths, cfg: Config) -> ocp.CheckpointManager:
    import grain

    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.train.keep_checkpoints,
        enable_async_checkpointing=True,
        create=True,
    )
    return ocp.CheckpointManager(
        paths.checkpoints.absolute(),
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


def _meta(cfg: Config, step: int) -> dict[str, Any]:
    from agentrefine_jax.checkpoint import make_meta

    return make_meta(
        cfg.model, step=step, tokenizer=cfg.data.tokenizer, template=cfg.data.template, config=cfg
    )


def save_checkpoint(
    mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any, data_iter: Any, cfg: Config
) -> None:
    import grain

    mngr.save(
        step,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(_meta(cfg, step)),
            data_iter=grain.checkpoint.CheckpointSave(data_iter),
        ),
        force=True,
    )


def restore_checkpoint(mngr: ocp.CheckpointManager, step: int, fns: StepFns) -> tuple[Any, Any]:
    # The data position is not restored from the (per-process) Grain state: it is the step
    # (`Pipeline.iterator(step)`), so a run may resume on a different number of processes.
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


class MetricsWriter:
    def __init__(self, paths: RunPaths) -> None:
        self.enabled = is_main_process()
        self._tb = None
        if self.enabled:
            paths.root.mkdir(parents=True, exist_ok=True)
            self._file = open(paths.metrics, "a", buffering=1)  # noqa: SIM115 - closed in close()
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(paths.tensorboard))
            except ImportError:  # TensorBoard is optional; metrics.jsonl is the record.
                self._tb = None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def _format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def train(cfg: Config) -> dict[str, Any]:
    """Run (or resume) training; returns a summary with the final step and losses."""
    from agentrefine_jax.data.pipeline import DataError, make_pipeline, process_batch_rows

    tc = cfg.train
    paths = RunPaths(pathlib.Path(tc.run_dir))
    mesh = shd.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    rules = cfg.mesh.rules
    pc = jax.process_count()
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
    # Each process materialises exactly the rows of the global batch its devices hold.
    batch_rows = process_batch_rows(shd.batch_sharding(mesh, rules), tc.global_batch_size)
    try:
        pipeline = make_pipeline(
            cfg.data,
            split="train",
            global_batch_size=tc.global_batch_size,
            num_epochs=tc.num_epochs,
            batch_rows=batch_rows,
        )
    except DataError as e:  # unusable data: the one-line reason, not a traceback
        raise TrainingError(str(e)) from None
    log(pipeline.report.summary())
    if pipeline.steps_per_epoch < 1:
        raise TrainingError(
            "the training data yields no full batch; lower train.global_batch_size or add data"
        )
    total_steps = pipeline.steps_per_epoch * tc.num_epochs
    if tc.max_steps is not None:
        total_steps = min(total_steps, tc.max_steps)
    optimizer, schedule = make_optimizer(cfg.optim, total_steps)

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

    mngr = make_checkpoint_manager(paths, cfg)
    start_step = mngr.latest_step()
    if start_step is not None:
        params, opt_state = restore_checkpoint(mngr, start_step, fns)
        log(f"resumed from {paths.checkpoints}/{start_step}")
    else:
        start_step = 0
        params = _initial_params(cfg, fns, mesh)
        opt_state = fns.init_opt(params)
        if is_main_process():
            paths.root.mkdir(parents=True, exist_ok=True)
            paths.config.write_text(json.dumps(to_dict(cfg), indent=2))
    data_iter = pipeline.iterator(start_step)  # the data position is the global step

    eval_pipeline = None
    if tc.eval_every and (cfg.data.eval_files or cfg.data.eval_fraction > 0):
        eval_pipeline = make_pipeline(
            cfg.data,
            split="eval",
            global_batch_size=tc.global_batch_size,
            num_epochs=1,
            batch_rows=batch_rows,
        )

    seq_len = cfg.data.max_length
    peak = flops.device_peak_flops(tc.peak_flops_per_device)
    flops_per_step = flops.flops_per_token(model_cfg, seq_len) * tc.global_batch_size * seq_len
    writer = MetricsWriter(paths)
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
            try:
                _check_step(m, step, last_saved, paths)
            except TrainingError as e:
                writer.write({"step": step, **m, "error": str(e)})
                raise
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
            if tc.checkpoint_every and step % tc.checkpoint_every == 0:
                save_checkpoint(mngr, step, params, opt_state, data_iter, cfg)
                last_saved = step
            if preempt.check(step):
                if last_saved != step:
                    save_checkpoint(mngr, step, params, opt_state, data_iter, cfg)
                mngr.wait_until_finished()
                log(f"preempted: saved step {step} to {paths.checkpoints}; rerun the same command to resume")
                writer.close()
                sys.exit(EXIT_PREEMPTED)
        if last_saved != step:
            save_checkpoint(mngr, step, params, opt_state, data_iter, cfg)
        mngr.wait_until_finished()
    finally:
        writer.close()
        mngr.wait_until_finished()
    log(f"done: step {step}, checkpoint {paths.checkpoints}/{step}")
    if tc.export_hf_at_end:
        export_final(fns, params, cfg, step)
    return {"step": step, "losses": losses, "run_dir": str(paths.root)}


def export_final(fns: StepFns, params: Any, cfg: Config, step: int) -> None:
    """Export to `train.export_hf_at_end`, replacing an earlier export of this run atomically.

    Written beside the target first, so a crash mid-export never leaves a half-written
    model where a user (or a re-run of the same command) expects a complete one.
    """
    import shutil

    from flax import nnx

    from agentrefine_jax.export.hf_io import save_hf

    out = pathlib.Path(cfg.train.export_hf_at_end)
    if not out.is_absolute():  # relative to the run, so two runs never write the same place
        out = pathlib.Path(cfg.train.run_dir) / out
    tmp = out.with_name(out.name + ".partial")
    if is_main_process() and tmp.exists():
        shutil.rmtree(tmp)
    model = nnx.merge(fns.graphdef, params)
    save_hf(model, cfg.model, tmp, dtype=cfg.train.export_dtype, tokenizer=cfg.data.tokenizer)
    if is_main_process():
        old = out.with_name(out.name + ".old")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        if old.exists():
            shutil.rmtree(old)
    log(f"exported step {step} as a Hugging Face checkpoint to {out}")


def _check_step(m: dict[str, float], step: int, last_saved: int, paths: RunPaths) -> None:
    if m["loss_tokens"] <= 0:
        raise TrainingError(
            f"step {step}: the global batch carries no loss tokens (every assistant turn masked?). "
            f"Check data.loss_on and `python -m agentrefine_jax.data stats`. "
            f"The update was not applied; last checkpoint: step {last_saved} in {paths.checkpoints}."
        )
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
        raise TrainingError(
            f"step {step}: non-finite loss {m['loss']} / grad norm {m['grad_norm']}; the update was not "
            f"applied and the run stopped. Last good checkpoint: step {last_saved} in {paths.checkpoints}."
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
    arch = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_embeddings",
    )
    bad = [
        f"{k}: config {getattr(cfg.model, k)} vs checkpoint {getattr(hf_cfg, k)}"
        for k in arch
        if getattr(cfg.model, k) != getattr(hf_cfg, k)
    ]
    if bad:
        raise TrainingError(f"train.init_from_hf={cfg.train.init_from_hf} does not match model config: {bad}")
    log(f"initialised from {cfg.train.init_from_hf}")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.device_put(params, fns.param_shardings)
