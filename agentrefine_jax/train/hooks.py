"""Everything a training run does besides stepping, one small hook each.

The loop (`train/loop.py`) calls, per step:
  `on_metrics(step, m, done_at)` with step k's metrics as host floats, one step late (nanodo's
      trick: the host reads step k while the device runs step k+1, so it never stalls the device),
      and when the host first saw step k finished (`time.perf_counter()`; `run_steps` says how);
  `after_step(state)` with the newest params (checkpointing, evaluation). A hook that needs
      step k's metrics to be checked first says so with `wants(k)`, and the loop reads them
      before calling it: no checkpoint is written for a step whose loss was never looked at;
  `at_end(state)` once, after the last step.
Checkpointing owns the saves (poll, save, finish); Preemption (SIGTERM) is a hook too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from agentrefine_jax.checkpoint import CheckpointMeta, TrainCheckpoints
from agentrefine_jax.config import Config
from agentrefine_jax.train.metrics import MetricsWriter, format_eta
from agentrefine_jax.train.run_dir import TrainingError
from agentrefine_jax.train.save_strategy import SaveStrategy

log = logging.getLogger("agentrefine_jax.train")


@dataclasses.dataclass
class RunState:
    step: int
    total_steps: int
    start_step: int
    params: Any
    opt_state: Any


class Hook:
    def wants(self, step: int) -> bool:
        return False

    def on_metrics(self, step: int, m: Mapping[str, float], done_at: float) -> None:
        pass

    def after_step(self, state: RunState) -> None:
        pass

    def at_end(self, state: RunState) -> None:
        pass


def check_step(m: Mapping[str, float], step: int) -> None:
    """Both faults were already kept out of the params inside the jitted step; here they stop the run."""
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


# Steps after a process's first whose mean rate may raise a measured CPU peak: enough that one step
# timed short (a late read) cannot carry the mean far (`MetricsLog._mfu`).
PEAK_EVIDENCE_STEPS = 4
# How far above that mean one row's rate may be and still count as a rate the host ran at (step-to-step
# jitter); a row seen short by a whole step (a late read) reads 2x and more.
PEAK_JITTER = 1.25


class MetricsLog(Hook):
    """Checks every step's metrics, writes a row every `log_every` steps (and the last), with
    throughput, MFU and ETA; keeps the logged losses for the run's summary."""

    def __init__(
        self,
        writer: MetricsWriter,
        schedule: Callable[[int], Any],
        *,
        log_every: int,
        total_steps: int,
        step_flops: Callable[[Mapping[str, float]], float],
        peak_flops: float | None,
        last_good: Callable[[], str],
        raise_peak: Callable[[float], Any] | None = None,
    ) -> None:
        self.writer, self.schedule, self.last_good = writer, schedule, last_good
        self.log_every, self.total_steps = log_every, total_steps
        # A step's model FLOPs from its metrics: they depend on its projected positions (flops.py).
        self.step_flops, self.peak = step_flops, peak_flops
        # Given where the peak is this host's measurement (CPU): called with the host's FLOP/s sustained
        # over several steps when they beat it, which then is the peak (`cpu_peak.raise_to`).
        self.raise_peak = raise_peak
        self.losses: list[float] = []
        self.t_last = time.perf_counter()
        self.tokens_since, self.steps_since, self.flops_since = 0.0, 0, 0.0
        # This process's first step and when it finished: the ETA runs on the steps after it. The first
        # step holds the compile (minutes for a large model) and, after a resume, the restore; averaged
        # in, it made a resumed SmolLM2 run print "eta 73:34:12" for a run ~2 hours from its end.
        self.first_step: int | None = None
        self.first_done = 0.0
        self.flops_after_first = 0.0  # the model FLOPs of the steps after the first (the peak's evidence)

    def on_metrics(self, step: int, m: Mapping[str, float], done_at: float) -> None:
        self.steps_since += 1
        if self.first_step is None:
            self.first_step, self.first_done = step, done_at
        try:
            check_step(m, step)
        except TrainingError as e:
            e = TrainingError(f"{e} {self.last_good()}")
            self.writer.write({"step": step, **m, "error": str(e)})
            raise e from None
        flops = self.step_flops(m)
        self.tokens_since += m["tokens"]
        self.flops_since += flops
        if step > self.first_step:
            self.flops_after_first += flops
        if step % self.log_every and step != self.total_steps:
            return
        now = done_at  # not the time of this call: see run_steps
        dt = max(now - self.t_last, 1e-9)
        tps = self.tokens_since / dt
        mfu = self._mfu(step, dt, now)
        row = {
            "step": step,
            "loss": m["loss"],
            "lr": float(self.schedule(step - 1)),
            "grad_norm": m["grad_norm"],
            "tokens": int(m["tokens"]),
            "loss_tokens": int(m["loss_tokens"]),
            "tokens_per_sec": tps,
            "mfu": mfu,
        }
        for k, v in m.items():  # a preference objective's rewards, margin, accuracy, pairs
            row.setdefault(k, v)
        self.losses.append(m["loss"])
        self.writer.write(row)
        eta = self.eta(step, now)
        log.info(
            f"step {step}/{self.total_steps}  loss {m['loss']:.4f}  lr {row['lr']:.3g}  "
            f"gnorm {m['grad_norm']:.3f}  loss_tok {row['loss_tokens']}  {tps:,.0f} tok/s  "
            f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}  eta {format_eta(eta)}"
        )
        self.t_last, self.tokens_since, self.steps_since, self.flops_since = now, 0.0, 0, 0.0

    def _mfu(self, step: int, dt: float, now: float) -> float | None:
        """This row's MFU; None where its time reads shorter than this host's steps can run.

        A row above 100% means one of two things: the host's measured peak is low (a matmul timed
        while other processes held the cores: MFU read 117% on the 2-core AMD EPYC), or the row's time
        was read short (its completion seen late, with the next step's: see `run_steps`). The mean
        over the steps after the first tells them apart — a late read moves time between neighbours,
        not out of that window — once there are `PEAK_EVIDENCE_STEPS` of them: a row within
        `PEAK_JITTER` of the mean is a real rate, and the peak is raised to it (kept for the host,
        `cpu_peak.raise_to`); where the mean itself beats the peak, the peak is raised to the mean; a
        row still above 100% gets no MFU. Raising the peak to any row's rate let one read 260x short
        (CI, stop 57) set this host's peak to 1,289 GFLOP/s for every later run."""
        if not self.peak:
            return None
        rate = self.flops_since / dt / jax.device_count()  # per device, as the peak
        if rate <= self.peak:
            return rate / self.peak
        assert self.first_step is not None
        if self.raise_peak is not None and step - self.first_step >= PEAK_EVIDENCE_STEPS:
            mean = self.flops_after_first / max(now - self.first_done, 1e-9) / jax.device_count()
            new = rate if rate <= PEAK_JITTER * mean else mean
            if new > self.peak:
                old, self.peak = self.peak, new
                host = self.peak * jax.local_device_count()
                self.raise_peak(host)
                log.info(
                    f"step {step} ran at {host / 1e9:,.1f} GFLOP/s on this host (steps {self.first_step + 1}-"
                    f"{step}: {mean * jax.local_device_count() / 1e9:,.1f} on average), above its measured "
                    f"matmul peak {old * jax.local_device_count() / 1e9:,.1f} (measured while the machine "
                    f"was busy?): that is the peak from now on"
                )
        if rate <= self.peak:
            return rate / self.peak
        log.info(
            f"step {step}: {dt:.3g} s for {self.steps_since} step(s) is faster than this host's steps run "
            f"(MFU {rate / self.peak:.0%}; its completion was likely seen late): no MFU for this row"
        )
        return None

    def eta(self, step: int, now: float) -> float:
        """Seconds left at the mean time of this process's steps after its first (nan while only the
        first has run: its time is mostly the compile, not a step's; `format_eta` prints "?")."""
        assert self.first_step is not None
        if step <= self.first_step:
            return 0.0 if step >= self.total_steps else math.nan
        return (now - self.first_done) / (step - self.first_step) * (self.total_steps - step)


class Evaluate(Hook):
    """Held-out loss every `every` steps."""

    def __init__(self, every: int, run_eval: Callable[[Any], float], writer: MetricsWriter) -> None:
        self.every, self.run_eval, self.writer = every, run_eval, writer

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def after_step(self, state: RunState) -> None:
        if self.wants(state.step):
            eval_loss = self.run_eval(state.params)
            self.writer.write({"step": state.step, "eval_loss": eval_loss})
            log.info(f"step {state.step}  eval_loss {eval_loss:.4f}")


class Checkpointing(Hook):
    """Saves every `every` steps, at each epoch's end when asked, on request (preemption) and
    after the last step; `meta` is the run's CheckpointMeta (the facts readers need), each save
    stamped with its step and, on a step that closes an epoch, the epoch.

    Owns the saves' life cycle: after every step it polls the background saves (a failed one
    stops the run at that step boundary, not at the end; committed steps get their manifests),
    tells the run's save strategy what each save hands Orbax, and `finish`es them at the end."""

    def __init__(
        self,
        ckpts: TrainCheckpoints,
        cfg: Config,
        meta: CheckpointMeta,
        *,
        every: int,
        steps_per_epoch: int,
        start_step: int,
        saved: Callable[[Any], Any] = lambda params: params,
        before_save: Callable[[], None] | None = None,
        strategy: SaveStrategy | None = None,
    ) -> None:
        self.ckpts, self.cfg, self.meta = ckpts, cfg, meta
        self.strategy = strategy  # the step's side of a save (spare buffers on CPU), when it has one
        self.saved = saved  # the part of the params a checkpoint holds (LoRA: the adapters)
        self.before_save = before_save  # e.g. store metrics.jsonl up to this step first
        self.every, self.steps_per_epoch = every, steps_per_epoch
        self.last_saved = start_step

    def wants(self, step: int) -> bool:
        epoch_end = self.cfg.train.keep_epoch_checkpoints and step % self.steps_per_epoch == 0
        return bool(self.every and step % self.every == 0) or epoch_end

    def after_step(self, state: RunState) -> None:
        self.ckpts.poll()
        if self.wants(state.step):
            self.save(state)

    def save(self, state: RunState) -> None:
        if self.last_saved == state.step:
            return
        if self.before_save is not None:
            try:
                self.before_save()
            except Exception as e:  # noqa: BLE001 - any storage error ends the run with one line
                first = (str(e).strip().splitlines() or [""])[0]
                raise TrainingError(
                    f"storing the run's metrics before checkpoint step {state.step} failed "
                    f"({type(e).__name__}: {first}); the run stopped. {self.ckpts.last_good_note()}"
                ) from None
        spe = self.steps_per_epoch
        epoch = state.step // spe if spe and state.step % spe == 0 else None
        meta = dataclasses.replace(self.meta, step=state.step, epoch=epoch)
        saved = self.saved(state.params)
        self.ckpts.save(state.step, saved, state.opt_state, meta)
        if self.strategy is not None:
            self.strategy.handed((saved, state.opt_state))
        self.last_saved = state.step

    def at_end(self, state: RunState) -> None:
        self.save(state)
        self.finish()

    def finish(self) -> None:
        """Wait for every save and manifest (after a failed save: nothing more to wait for)."""
        if not self.ckpts.failed:
            self.ckpts.finish()
        if self.strategy is not None:
            self.strategy.release()


class Preempted(Exception):
    """SIGTERM stopped the run cleanly (its state is saved): exit 75, rerun the same command."""


class Preemption(Hook):
    """SIGTERM (TPU maintenance / spot preemption) -> save at the next step boundary and stop
    (Preempted); during the end-of-run export (no step boundary to wait for) `interrupting`
    makes it interrupt the export instead. Multi-host: every host asks the same sync point each
    step, so all of them save at the same step (a collective save would deadlock otherwise)."""

    def __init__(self, checkpointing: Checkpointing, where: str) -> None:
        self.checkpointing, self.where = checkpointing, where
        self.requested = False
        self._stop_at: int | None = None
        self._multi = jax.process_count() > 1
        if not self._multi:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def _interrupt(self, signum: int, frame: Any) -> None:
        self.requested = True
        raise Preempted("preempted during the end-of-run export; rerun the same command to export again")

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """SIGTERM raises Preempted inside this block (single host; a pod drains at step boundaries)."""
        if self.requested:
            raise Preempted("preempted before the end-of-run export; rerun the same command to export")
        if self._multi:
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def wants(self, step: int) -> bool:
        """Asked once per step (the loop asks every hook): whether to stop after this step, so the
        loop reads the step's metrics before the save."""
        if self._multi:
            from jax.experimental import multihost_utils

            stop = bool(multihost_utils.reached_preemption_sync_point(step))
        else:
            stop = self.requested
        self._stop_at = step if stop else None
        return stop

    def after_step(self, state: RunState) -> None:
        if self._stop_at != state.step:
            return
        self.checkpointing.save(state)
        self.checkpointing.finish()
        raise Preempted(
            f"preempted: saved step {state.step} to {self.where}; rerun the same command to resume"
        )


class ExportAtEnd(Hook):
    """`train.export_hf_at_end`: a Hugging Face directory of the final weights."""

    def __init__(self, export: Callable[[Any, int], None]) -> None:
        self.export = export

    def at_end(self, state: RunState) -> None:
        self.export(state.params, state.step)
