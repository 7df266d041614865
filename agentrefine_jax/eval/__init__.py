"""Held-out agent evaluation: ReAct agent loop, offline environments, policies and metrics.

See docs/eval.md. Simulator packages (minigrid, scienceworld, pddlgym, textworld) are imported
only when their task runs.
"""

from agentrefine_jax.eval.envs.base import EvalTask, StepResult, TextEnv
from agentrefine_jax.eval.loop import EpisodeJob, EpisodeResult, run_episodes
from agentrefine_jax.eval.metrics import (
    PAPER_WEIGHTS,
    best_of_n,
    held_out_average,
    perturbation_summary,
    summarize,
)
from agentrefine_jax.eval.perturb import ActionWord, Vocabulary
from agentrefine_jax.eval.policies import (
    ActRequest,
    CheckpointPolicy,
    OpenAIChatPolicy,
    OraclePolicy,
    Policy,
    PolicyError,
    RandomPolicy,
    SamplingParams,
)
from agentrefine_jax.eval.react import parse_action
from agentrefine_jax.eval.runner import (
    TASK_NAMES,
    EvalConfig,
    available_tasks,
    format_table,
    make_task,
    register_task,
    run_eval,
)

__all__ = [
    "PAPER_WEIGHTS",
    "TASK_NAMES",
    "ActRequest",
    "ActionWord",
    "CheckpointPolicy",
    "EpisodeJob",
    "EpisodeResult",
    "EvalConfig",
    "EvalTask",
    "OpenAIChatPolicy",
    "OraclePolicy",
    "Policy",
    "PolicyError",
    "RandomPolicy",
    "SamplingParams",
    "StepResult",
    "TextEnv",
    "Vocabulary",
    "available_tasks",
    "best_of_n",
    "format_table",
    "held_out_average",
    "make_task",
    "parse_action",
    "perturbation_summary",
    "register_task",
    "run_episodes",
    "run_eval",
    "summarize",
]
