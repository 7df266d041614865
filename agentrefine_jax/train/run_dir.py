"""A training run directory: its layout, and the checks that make resuming it honest.

`root` may be a URL (gs://...): it is never turned into a local path.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from etils import epath

from agentrefine_jax import objective_table
from agentrefine_jax.checkpoint import RUN_CHECKPOINTS_SUBDIR, CheckpointMeta
from agentrefine_jax.config import Config, to_dict
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path
from agentrefine_jax.train.optimizer import horizon_matters

log = logging.getLogger(__name__)

# Sections of the config that must not change when a run resumes.
_FROZEN_ON_RESUME = ("model", "data", "optim")
_FROZEN_TRAIN_KEYS = (
    "global_batch_size",
    "micro_batch_size",
    "seed",
    "init_from_hf",
    "loss_chunk_size",
    "lora",  # rank, alpha, dropout, targets, base dtype: the adapters' meaning
)


class TrainingError(RuntimeError):
    """A run stopped for a reason the user must act on (NaN, no loss tokens, bad config)."""


class TrainingInputError(TrainingError):
    """Bad input found after the config loaded (e.g. an unusable `train.init_from_hf` directory):
    exit 2, as a bad config value."""


# The command that runs an objective learning from the model's own rollouts (train sits below rl in
# the import layers: named here, never imported).
RL_COMMAND = "python -m agentrefine_jax.rl"


def check_trains_on_data(cfg: Config) -> None:
    """The trainer's objectives train on data (SFT examples, preference pairs); one whose table
    entry trains on rollouts learns from the model's own episodes and runs in the rl stage."""
    spec = objective_table.get(cfg.train.objective)
    if spec.rollouts:
        raise TrainingInputError(
            f"train.objective={spec.name} learns from the model's own rollouts, not from training data: "
            f"run it with `{RL_COMMAND} --config ...` (docs/rl.md)"
        )


@dataclasses.dataclass
class RunPaths:
    """The run directory's layout, fixed from `root` when made."""

    root: epath.Path
    checkpoints: epath.Path = dataclasses.field(init=False)
    # Where checkpoints that fail verification are moved (kept for inspection, out of Orbax's way).
    rejected: epath.Path = dataclasses.field(init=False)
    metrics: epath.Path = dataclasses.field(init=False)  # metrics.jsonl: a row per logged step
    config: epath.Path = dataclasses.field(init=False)  # what check_resume_config holds a resume to
    tensorboard: epath.Path = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.root = as_path(self.root)
        self.checkpoints = self.root / RUN_CHECKPOINTS_SUBDIR
        self.rejected = self.root / "checkpoints_rejected"
        self.metrics = self.root / "metrics.jsonl"
        self.config = self.root / "config.json"
        self.tensorboard = self.root / "tensorboard"

    def write_config(self, cfg: Config) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(json_dumps(to_dict(cfg), indent=2))


def check_resume_config(paths: RunPaths, cfg: Config) -> None:
    """Refuse to resume a run under a different model/data/optimizer configuration."""
    if not paths.config.exists():
        return
    old = json.loads(paths.config.read_text())
    new = json.loads(json_dumps(to_dict(cfg)))
    diffs = [k for k in _FROZEN_ON_RESUME if old.get(k) != new.get(k)]
    diffs += [f"train.{k}" for k in _FROZEN_TRAIN_KEYS if old.get("train", {}).get(k) != new["train"].get(k)]
    if diffs:
        raise TrainingInputError(
            f"{paths.root} holds a run with a different configuration ({', '.join(diffs)} changed); "
            "resuming would silently mix two runs. Use a new train.run_dir or restore the original settings."
            + _base_dtype_hint(old, new)
        )


def _base_dtype_hint(old: dict, new: dict) -> str:
    """A run from before train.lora.base_dtype's default became "auto" (the model's param_dtype)
    recorded "bfloat16": say how to resume it as it was trained."""
    was = old.get("train", {}).get("lora", {}).get("base_dtype")
    now = new.get("train", {}).get("lora", {}).get("base_dtype")
    if now != "auto" or was in (None, "auto"):
        return ""
    return (
        f" (train.lora.base_dtype now defaults to auto, the model's param_dtype; this run trained "
        f"with {was}: --set train.lora.base_dtype={was} resumes it)"
    )


def check_schedule(paths: RunPaths, meta: CheckpointMeta, total_steps: int, cfg: Config) -> None:
    """The LR schedule is part of the optimizer state's meaning: a new horizon must be asked for
    (only where it changes the learning rate: cosine, not constant)."""
    old = meta.schedule_steps
    if old is None or old == total_steps or not horizon_matters(cfg.optim):
        return
    if not cfg.train.allow_schedule_change:
        raise TrainingError(
            f"{paths.root} was trained on a {old}-step learning-rate schedule, this run's schedule has "
            f"{total_steps} steps (train.max_steps / train.num_epochs changed); resuming would change "
            f"the learning rate mid-run. Restore the original settings, or set "
            f"train.allow_schedule_change=true to continue on the {total_steps}-step schedule."
        )
    log.info(
        f"NOTE: schedule horizon changed from {old} to {total_steps} steps "
        f"(train.allow_schedule_change=true); the learning rate follows the new schedule from here"
    )
