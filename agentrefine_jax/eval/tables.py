"""The text tables `eval` prints: one entry point, `format_table`, for every results document it writes.

A built-in run's table is the paper's (success / progress per task and the weighted held-out average,
every perturbed variant, reply behaviour, recovery); an AgentBoard run's is AgentBoard's metrics (grounding,
the easy/hard splits, its unweighted held-out mean beside ours, labelled); `--all-checkpoints` prints one
AgentBoard table per checkpoint and the best. Both add the paper's Table 4 layout for Best-of-N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agentrefine_jax.eval.metrics import BEHAVIOUR, HELD_OUT, RECOVERY
from agentrefine_jax.eval.registry import display_name, lookup, weights_label


def format_table(doc: dict[str, Any]) -> str:
    """The table of any results document `eval` writes (built-in, AgentBoard, or `--all-checkpoints`)."""
    if "checkpoints" in doc:
        return checkpoints_table(doc)
    if doc.get("source", doc.get("protocol")) == "agentboard":
        return agentboard_table(doc)
    return builtin_table(doc)


def _pct(x: float | None) -> str:
    return "  n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:5.1f}"


def _metric_label(task: str) -> str:
    """A column's sub-header: the task's registered metric names (HotpotQA: EM / F1), else succ / prog."""
    try:
        names = lookup(task).metric_names
    except ValueError:  # the held-out average, or a task registered by a plug-in no longer loaded
        names = ("success", "progress")
    return "succ / prog" if names == ("success", "progress") else " / ".join(names)


def builtin_table(doc: dict[str, Any]) -> str:
    """A table like the paper's: success / progress (%) per task and the weighted held-out average."""
    variants = doc["variants"]
    tasks = [t for t in doc["config"]["tasks"] if any(t in v["tasks"] for v in variants.values())]
    names = {t: display_name(t) for t in tasks}
    cols = [names[t] for t in tasks] + ["Held-out avg"]
    width = 15
    head = f"{'':<18}" + "".join(f"{c:^{width}}" for c in cols)
    sub = f"{'':<18}" + "".join(f"{_metric_label(t):^{width}}" for t in [*tasks, HELD_OUT])
    lines = [
        f"policy: {doc['policy']}   (success % / progress %; below each: valid-action % / format-error %, "
        "recovery % / repeated-error %)",
        head,
        sub,
    ]

    def row(label: str, values: Sequence[tuple[float, float]]) -> str:
        return f"{label:<18}" + "".join(f"{_pct(s) + ' / ' + _pct(p):^{width}}" for s, p in values)

    for vname in sorted(variants, key=lambda v: (v != "original", v)):
        v = variants[vname]
        vals = [
            (v["tasks"][t]["success_rate"], v["tasks"][t]["progress_rate"])
            if t in v["tasks"]
            else (math.nan, math.nan)
            for t in tasks
        ]
        vals.append((v[HELD_OUT]["success_rate"], v[HELD_OUT]["progress_rate"]))
        lines.append(row(vname, vals))
        # How the replies fared (valid-action % / format-error %): no held-out average of these.
        rates = [
            tuple(v["tasks"][t].get(k) for k in BEHAVIOUR) if t in v["tasks"] else (math.nan, math.nan)
            for t in tasks
        ]
        lines.append(row("  valid / fmt err", [*rates, (None, None)]))
        # Recovery after a rejected turn (recovery % / repeated-error %; steps to recover in the file).
        rates = [
            tuple(v["tasks"][t].get(k) for k in RECOVERY[::2]) if t in v["tasks"] else (math.nan, math.nan)
            for t in tasks
        ]
        lines.append(row("  recover / repeat", [*rates, (None, None)]))
    summary = doc.get("perturbation_summary") or {}
    if summary:
        keys = tasks + [HELD_OUT]
        mean = [(summary[k]["success_rate"]["mean"], summary[k]["progress_rate"]["mean"]) for k in keys]
        std = [(summary[k]["success_rate"]["std"], summary[k]["progress_rate"]["std"]) for k in keys]
        lines.append(row("perturbed mean", mean))
        lines.append(row("perturbed std", std))
    weights = variants.get("original", next(iter(variants.values())))[HELD_OUT]["weights"]
    lines.append(
        f"held-out weights (paper: {weights_label()}; TextWorld takes Jericho's): "
        + ", ".join(f"{names[t]} {weights[t]:.3f}" for t in tasks if t in weights)
    )
    counts = []
    for vname, v in variants.items():
        for t, m in v["tasks"].items():
            bad = {k: c for k, c in m["terminations"].items() if k in ("error", "context_overflow")}
            if bad:
                counts.append(f"{vname}/{t}: {bad}")
    if counts:
        lines.append("episodes ended by errors (counted as failures): " + "; ".join(counts))
    best_of = doc["config"]["best_of"]
    if best_of > 1:
        lines.append(f"Best-of-{best_of}: an episode succeeds if any sample succeeds; progress is the max.")
        lines += best_of_table(doc["best_of"]) if "best_of" in doc else []
    return "\n".join(lines)


def _pct_sign(x: float | None) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def agentboard_table(doc: dict[str, Any]) -> str:
    """A plain-text table of the per-task metrics and the held-out means."""
    cols = ("success", "progress", "grounding", "SR easy", "SR hard")
    head = f"{'task':<10} {'n':>4} " + " ".join(f"{c:>9}" for c in cols)
    lines = [f"AgentBoard protocol — {doc['agent']} (max {doc['max_steps']} steps)", head]
    for name, m in doc["tasks"].items():
        keys = ("success_rate", "progress_rate", "grounding_acc", "success_rate_easy", "success_rate_hard")
        lines.append(f"{name:<10} {m['episodes']:>4} " + " ".join(f"{_pct_sign(m[k]):>9}" for k in keys))
    held = doc.get("held_out", {})
    if "unweighted_mean" in held:
        u = held["unweighted_mean"]
        lines.append(
            f"held-out unweighted mean (AgentBoard's convention): success {_pct_sign(u['success_rate'])} "
            f"progress {_pct_sign(u['progress_rate'])}"
        )
    if held.get("success_rate") is not None:  # AgentBoard's source: only when all four held-out tasks ran
        lines.append(
            f"held-out weighted mean (paper weights {weights_label()}, over {', '.join(held['tasks'])}; "
            f"NOT AgentBoard's): success {_pct_sign(held['success_rate'])} "
            f"progress {_pct_sign(held['progress_rate'])}"
        )
    for name, p in doc.get("perturbation_summary", {}).items():
        if name == HELD_OUT:
            continue
        for m in ("success_rate", "progress_rate"):
            r = p[m]
            spread = "" if r["std"] is None else f" ± {100 * r['std']:.1f}"
            lines.append(
                f"{name} {m} under reworded actions: original {_pct_sign(r['original'])}, "
                f"{len(r['perturbations'])} variants mean {_pct_sign(r['mean'])}{spread}"
            )
    bon = doc.get("best_of")
    if bon:
        lines += best_of_table(bon)
    for note in doc.get("checkout_notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def checkpoints_table(doc: dict[str, Any]) -> str:
    parts = []
    for r in doc["checkpoints"]:
        mark = "  <- best" if r["step"] == doc["best_step"] else ""
        parts.append(f"== step {r['step']}: score {r['score'][0]:.3f}/{r['score'][1]:.3f}{mark}")
        parts.append(agentboard_table(r["result"]))
    parts.append(
        f"best checkpoint: step {doc['best_step']} ({doc['best_checkpoint']}); by {doc['selection']}"
    )
    return "\n".join(parts)


def best_of_table(bon: dict[str, Any]) -> list[str]:
    """The paper's Table 4 layout: greedy, Best-of-N and their difference, success / progress per task."""
    rows = dict(bon["tasks"]) | ({"held-out": bon["held_out"]} if bon.get("held_out") else {})
    label = f"Best-of-{bon['n']}"
    temp = "" if bon["temperature"] is None else f" (temperature {bon['temperature']})"
    out = [
        f"{label}{temp}: success if any sample succeeds, progress the max; "
        "greedy = the standard (temperature 0) run",
        f"{'':<12}" + "".join(f"{display_name(n):>18}" for n in rows),
    ]
    for row, title in (("greedy", "greedy"), ("best_of", label), ("delta", "Δ")):
        sign = "+" if row == "delta" else ""
        cells = [
            f"{100 * r[row]['success_rate']:{sign}.1f} / {100 * r[row]['progress_rate']:{sign}.1f}"
            for r in rows.values()
        ]
        out.append(f"{title:<12}" + "".join(f"{c:>18}" for c in cells))
    return out
