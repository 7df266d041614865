"""The one evaluation config, for both episode sources (built-in simulators and an AgentBoard checkout).

A run's settings mean the same under either source (episodes per task, perturbed variants, Best-of-N,
steps, batching); only their defaults come from the source, resolved by `validate`: the built-in source
runs 10 episodes per task and each task's own step limit (40), AgentBoard's all of its episodes and its
30 steps. Both run the paper's five reworded-action variants (Table 3) when perturbations are asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrefine_jax.eval import registry
from agentrefine_jax.eval.perturb import REWORDINGS
from agentrefine_jax.layout import check_style

BUILTIN_EPISODES = 10
# AgentBoard's CFG run.max_num_steps: a source's default lives here, below the source
# (`agentboard/protocol.py` reads it as its DEFAULT_MAX_STEPS), so the config never imports upward.
AGENTBOARD_MAX_STEPS = 30
# Run seeds are in [0, SEED_LIMIT): every built-in task's eval episodes then lie in a range its training
# episodes (`EvalTask.training_specs`, the on-policy collector's) never reach (docs/eval.md, "Training
# episodes and on-policy refinement data").
SEED_LIMIT = 2**31
PAPER_PERTURBATIONS = 5  # Table 3: the original and five action-description perturbations


@dataclasses.dataclass
class EvalConfig:
    tasks: tuple[str, ...] = ()  # () -> the source's paper tasks (registry.default_tasks)
    source: str = "builtin"  # "builtin" | "agentboard"
    # Episodes per task. Built-in: generated from `seed` (None -> 10); AgentBoard: the first N of its list
    # (None -> all of them, a full run).
    episodes: int | None = None
    best_of: int = 1  # samples per episode (Table 4); the greedy run is reported beside them
    # The Best-of-N samples' decoding under the AgentBoard source, whose model backend decodes greedily
    # otherwise. A built-in run's actor carries its own sampling (`policies.SamplingParams`).
    temperature: float | None = None
    top_p: float = 1.0
    # Reworded-action variants run beside the original (0: none), at most as many as a task defines
    # (each built-in task defines 3; AgentBoard's ALFWorld the paper's 5).
    perturbations: int = 0
    seed: int = 0
    max_steps: int | None = None  # None: the source's default (each built-in task's own; AgentBoard's 30)
    batch_size: int = 8  # episodes in flight, answered by one batched model call
    workdir: str = ""  # built-in: where games, tool caches and scratch files go (required)
    log_dir: str | None = None  # AgentBoard: write its logs (logs/<task>.jsonl, <task>.txt, all_results.txt)
    # Built-in: options of a task's episode source (strings), e.g. {"hotpotqa": {"file": "dev.json"}}.
    task_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Built-in: our prompt layout (agentrefine_jax.layout), "chat" or "agentboard" (one user message).
    prompt_style: str = "chat"
    name: str | None = None  # a label for the run, stored in the results

    def validate(self) -> None:
        """Check every field and resolve the source's defaults and task aliases; one-line errors."""
        if self.source not in registry.SOURCES:
            raise ValueError(f"source must be one of {registry.SOURCES}, got {self.source!r}")
        agentboard = self.source == "agentboard"
        self.tasks = tuple(self.tasks) or registry.default_tasks(self.source)
        # registered names or aliases -> the names the results carry (built-in jericho: textworld)
        self.tasks = tuple(registry.lookup(t, self.source).result_name(self.source) for t in self.tasks)
        if self.episodes is None and not agentboard:
            self.episodes = BUILTIN_EPISODES
        if self.max_steps is None and agentboard:
            self.max_steps = AGENTBOARD_MAX_STEPS
        for field in ("episodes", "max_steps", "best_of", "batch_size"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {value}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"--seed must be in [0, 2**31), got {self.seed}")
        if self.perturbations < 0:
            raise ValueError(f"--num-perturbations must be >= 0, got {self.perturbations}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        check_style(self.prompt_style)
        if agentboard:
            self._validate_agentboard()
        elif not self.workdir:
            raise ValueError("workdir is required (tool caches and generated games go there)")
        elif self.log_dir:
            raise ValueError("--log-dir (AgentBoard's logs) needs the agentboard source")

    def _validate_agentboard(self) -> None:
        if self.best_of > 1 and not (self.temperature and self.temperature > 0):
            raise ValueError("--best-of > 1 needs --temperature > 0 (greedy samples would all be equal)")
        if self.perturbations > len(REWORDINGS):
            raise ValueError(
                f"AgentBoard's ALFWorld defines {len(REWORDINGS)} perturbations, not {self.perturbations}"
            )
        if self.perturbations and "alfworld" not in self.tasks:
            raise ValueError("AgentBoard's perturbations (reworded actions, Table 3) are ALFWorld's only")
        if self.task_options:
            raise ValueError("--task-option applies to built-in episode sources only")
        if self.prompt_style != "chat":
            raise ValueError("--prompt-style is our harness's layout; AgentBoard's episodes use its prompts")

    def to_json(self) -> dict[str, Any]:
        """The settings a results file records (not the scratch workdir), plus the names the two sources'
        configs wrote in schema /1, before they became this one (readers of /1 files find them)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "workdir"}
        if self.source == "agentboard":
            return out | {"limit": self.episodes}
        return out | {"perturb": self.perturbations > 0, "num_perturbations": self.perturbations}
