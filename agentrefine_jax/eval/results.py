"""The results document both sources write: one layout, schema `agentrefine_jax.eval/2` (docs/eval.md).

The two sources differ in how they run (the built-in source samples every variant N times and runs the
greedy pass beside them; AgentBoard's runs every variant greedily and samples the original N times) and
in their per-task and per-episode fields; the sections and what each means are the same:

* `tasks`: the headline single-sample scores of the original variant (greedy; see `best_of.greedy_run`);
* `held_out`: the paper's weighted held-out average of `tasks` (AgentBoard's source: only when all four
  held-out tasks ran), the held-out tasks `missing`, and AgentBoard's unweighted mean when all four ran;
* `variants`: each variant's scores over its samples per episode, with its weighted held-out average;
* `perturbation_summary`: per task, the original, each perturbation, their mean and std;
* `best_of` (with `--best-of N`): Table 4 per task — greedy, Best-of-N, their difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.metrics import SCHEMA, best_of_held_out, held_out_summary, variants_section
from agentrefine_jax.eval.registry import task_weights


def results_document(
    source: str,
    agent: str,
    config: EvalConfig | Mapping[str, Any],
    *,
    tasks: Mapping[str, Mapping[str, Any]],
    variants: Mapping[str, Mapping[str, Mapping[str, Any]]],
    episodes: list[dict[str, Any]],
    best_of: dict[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The document for `source`: `tasks` (task -> headline metrics), `variants` (variant -> task ->
    metrics), the run's episode records, its Best-of-N section (`n`, `tasks`, ...; the held-out row is
    added here) and the source's own top-level fields (`extra`). `config` is the run's, or its JSON form
    (a merge of several runs' results)."""
    weights = task_weights(source)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "source": source,
        "protocol": source,
        "agent": agent,
        "config": config.to_json() if isinstance(config, EvalConfig) else dict(config),
        **(extra or {}),
        "tasks": dict(tasks),
        # AgentBoard's summaries average all four held-out tasks or none: a partial mean is not its number
        "held_out": held_out_summary(tasks, weights, complete_only=source == "agentboard"),
        **variants_section(variants, weights),
    }
    if best_of is not None:
        doc["best_of"] = best_of | {"held_out": best_of_held_out(best_of["tasks"], list(weights))}
    doc["episodes"] = episodes
    return doc
