"""Agent evaluation: one registry of tasks (`registry.py`), each with its episode sources (AgentBoard's
checkout, built-in simulators), the episode loop, actors (checkpoint, endpoint, oracle, random),
Best-of-N, perturbations and metrics.

See docs/eval.md. Simulator packages (minigrid, scienceworld, pddlgym, textworld) are imported
only when their task runs.
"""

from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.core import EpisodeJob, run_episodes
from agentrefine_jax.eval.envs.base import EvalTask, StepResult, TextEnv
from agentrefine_jax.eval.loop import EpisodeResult
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
    Reply,
    SamplingParams,
    Solver,
)
from agentrefine_jax.eval.react import parse_action
from agentrefine_jax.eval.registry import available_tasks, make_task, register_task
from agentrefine_jax.eval.runner import TASK_NAMES, run_eval
from agentrefine_jax.eval.tables import format_table

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
    "Reply",
    "SamplingParams",
    "Solver",
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
