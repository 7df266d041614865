"""Markdown tables in the paper's layouts, from `RunResult`s (and, on request, the paper's own rows).

Cells are percentages with one decimal, `success / progress`; `–` where a run did not measure a
task. The paper's rows are labelled `paper: MODEL` and `*` marks its held-in cells.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentrefine_jax import objective_table
from agentrefine_jax.analyze import paper
from agentrefine_jax.analyze.results import RunResult, Score
from agentrefine_jax.eval import registry

# Column order: the paper's tasks, our TextWorld stand-in right after Jericho, then anything else.
_ORDER = (*paper.TASKS, registry.JERICHO_STAND_IN)
DASH = "–"


def display(task: str) -> str:
    return registry.display_name(task)


def pct(x: float | None, digits: int = 1) -> str:
    return DASH if x is None or math.isnan(x) else f"{100 * x:.{digits}f}"


def _paper_pct(x: float | None) -> str:
    return DASH if x is None else f"{x:.1f}"


def cell(s: Score | None) -> str:
    return DASH if s is None else f"{pct(s.success)} / {pct(s.progress)}"


def task_columns(results: Iterable[RunResult], include_paper: bool = False) -> list[str]:
    seen: list[str] = list(paper.TASKS) if include_paper else []
    for r in results:
        seen += [t for t in r.tasks if t not in seen]
    return sorted(seen, key=lambda t: (_ORDER.index(t) if t in _ORDER else len(_ORDER), seen.index(t)))


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _paper_cells(row: paper.PaperRow, tasks: Sequence[str]) -> list[str]:
    out = []
    for t in tasks:
        if t not in row.scores:
            out.append(DASH)
            continue
        s, p = row.scores[t]
        star = "*" if t in row.held_in else ""
        out.append(DASH if s is None and p is None else f"{_paper_pct(s)}{star} / {_paper_pct(p)}{star}")
    return out


def _run_row(label: str, scores: Mapping[str, Score], held: Score | None, tasks: Sequence[str]) -> list[str]:
    return [label, *(cell(scores.get(t)) for t in tasks), cell(held)]


def table1(results: Sequence[RunResult], include_paper: bool = False) -> str | None:
    """Table 1: success / progress per task per model, and the held-out mean."""
    results = [r for r in results if r.tasks]  # a HotpotQA-only run has no column here (Figure 8)
    tasks = task_columns(results, include_paper)
    rows = []
    for r in results:
        label = r.label if r.single_kind == "greedy" else f"{r.label} ({r.single_kind})"
        rows.append(_run_row(label, r.tasks, r.held_out, tasks))
    if include_paper:
        rows += [[f"paper: {p.model}", *_paper_cells(p, tasks), DASH] for p in paper.TABLE1]
    if not rows:
        return None
    notes = sorted({r.held_out_note for r in results if r.held_out_note})
    text = _markdown(["model", *map(display, tasks), "held-out"], rows)
    if notes:
        text += "\n\nheld-out: " + "; ".join(notes) + "."
    return text


def ablation_name(run_config: Mapping[str, Any]) -> str | None:
    """Table 2's row name for a run's data settings and training objective (None when the run
    carries no training config)."""
    loss_on = run_config.get("data.loss_on")
    drop = run_config.get("data.drop_refinement_data")
    if loss_on is None and drop is None:
        return None
    name = _data_setting_name(loss_on, drop)
    # A preference objective changes what a row is (docs/preference.md): its table entry's label
    # beside the data setting; an objective this version does not know, by its name.
    objective = run_config.get("train.objective") or objective_table.DEFAULT
    spec = objective_table.BY_NAME.get(objective)
    label = f"+ {objective}" if spec is None else spec.label
    return f"{name} {label}" if label else name


def _data_setting_name(loss_on: Any, drop: Any) -> str:
    chosen = set(loss_on or ("correct", "refinement"))
    if drop:
        return "w/o refinement data"
    if chosen == {"correct"}:
        return "w/o refinement loss"
    if "erroneous" in chosen:
        return "w/ erroneous loss"
    if chosen == {"correct", "refinement"}:
        return "AgentRefine"
    return "loss_on=" + ",".join(sorted(chosen))


def table2(results: Sequence[RunResult], include_paper: bool = False) -> str | None:
    """Table 2: one row per ablation setting (runs whose checkpoints carry their training config)."""
    runs = [(r, ablation_name(r.run_config)) for r in results]
    runs = [(r, name) for r, name in runs if name is not None]
    if len({name for _, name in runs}) < 2 and not include_paper:
        return None
    tasks = task_columns([r for r, _ in runs], include_paper)
    rows = [_run_row(f"{name} ({r.label})", r.tasks, r.held_out, tasks) for r, name in runs]
    if include_paper:
        rows += [[f"paper: {p.model}", *_paper_cells(p, tasks), DASH] for p in paper.TABLE2]
    return _markdown(["setting", *map(display, tasks), "held-out"], rows)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval of a success rate (95% at z = 1.96); None without episodes. Unlike
    p ± z·se it stays inside [0, 1] and is not empty at 0 or n successes (small evals score 0 often)."""
    if n <= 0:
        return None
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _episodes_cell(s: Score | None) -> str:
    if s is None:
        return DASH
    parts = [f"n={s.episodes}" if s.episodes is not None else "n=?"]
    if s.episodes and s.success is not None:
        lo, hi = wilson_interval(round(s.success * s.episodes), s.episodes) or (math.nan, math.nan)
        parts.append(f"succ 95% CI {pct(lo)}–{pct(hi)}")
    parts.append(f"valid {pct(s.valid_action_rate)}")
    parts.append(f"fmt err {pct(s.format_error_rate)}")
    if s.terminations:
        parts.append("ends: " + ", ".join(f"{k} {c}" for k, c in s.terminations))
    return "; ".join(parts)


def episodes_table(results: Sequence[RunResult]) -> str | None:
    """Per run and task: episode count, the success rate's Wilson 95% interval, the valid-action and
    format-error rates (%) and why episodes ended (counts), so a score reads with its sample size and
    what the replies did; rows named like Table 1's (the run's label)."""
    results = [r for r in results if r.tasks]
    if not results:
        return None
    tasks = task_columns(results)
    rows = [[r.label, *(_episodes_cell(r.tasks.get(t)) for t in tasks)] for r in results]
    return _markdown(["model", *map(display, tasks)], rows)


def _recovery_cell(s: Score | None) -> str:
    if s is None or (s.recovery_rate is None and s.mean_steps_to_recover is None):
        return DASH
    steps = DASH if s.mean_steps_to_recover is None else f"{s.mean_steps_to_recover:.2f}"
    return f"{pct(s.recovery_rate)} / {steps} / {pct(s.repeated_error_rate)}"


def recovery_table(results: Sequence[RunResult]) -> str | None:
    """Per run and task: the recovery rate (%), the mean steps to recover and the repeated-error rate (%)
    (docs/eval.md, "Metrics"); None when no run recorded them (files written before they existed)."""
    results = [r for r in results if r.tasks]
    tasks = task_columns(results)
    rows = [[r.label, *(_recovery_cell(r.tasks.get(t)) for t in tasks)] for r in results]
    if all(c == DASH for row in rows for c in row[1:]):
        return None
    return _markdown(["model", *map(display, tasks)], rows)


def paper_style_summary(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Table 3's average and std over the original and every perturbation. Every published average is
    the mean of all six values; the population std of the six gives some published stds (AgentRefine's
    success 3.73, LLaMA-3's progress 0.47) but not others, and the paper does not say how it got them."""
    if not values or any(v is None for v in values):
        return None, None
    mean = sum(values) / len(values)  # type: ignore[arg-type]
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))  # type: ignore[operator]


def table3(results: Sequence[RunResult], include_paper: bool = False) -> str | None:
    """Table 3: original, each perturbation, average and std (success / progress), one table per task."""
    tasks = task_columns([r for r in results if r.perturbations])
    tasks = [t for t in tasks if any(t in r.perturbations for r in results)]
    if include_paper and "alfworld" not in tasks:
        tasks.insert(0, "alfworld")
    if not tasks:
        return None
    parts = []
    for t in tasks:
        runs = [r for r in results if t in r.perturbations]
        k = max(
            [len(r.perturbations[t]) - 1 for r in runs] + ([5] if include_paper and t == "alfworld" else [])
        )
        header = ["model", "original", *(f"P{i}" for i in range(1, k + 1)), "average", "std"]
        rows = []
        for r in runs:
            scores = r.perturbations[t]
            s_mean, s_std = paper_style_summary([s.success for s in scores])
            p_mean, p_std = paper_style_summary([s.progress for s in scores])
            cells = [cell(s) for s in scores] + [DASH] * (k + 1 - len(scores))
            std = f"{pct(s_std, 2)} / {pct(p_std, 2)}"
            rows.append([r.label, *cells, cell(Score(s_mean, p_mean)), std])
        if include_paper and t == "alfworld":
            for p in paper.TABLE3:
                pairs = [p.original, *p.perturbations, p.average]
                rows.append(
                    [
                        f"paper: {p.model}",
                        *(f"{a:.1f} / {b:.1f}" for a, b in pairs),
                        f"{p.std[0]:.2f} / {p.std[1]:.2f}",
                    ]
                )
        parts.append(f"**{display(t)}**\n\n" + _markdown(header, rows))
    return "\n\n".join(parts)


def table4(results: Sequence[RunResult], include_paper: bool = False) -> str | None:
    """Table 4: single-sample, Best-of-N and their difference per task (success / progress)."""
    runs = [r for r in results if r.best_of > 1]
    if not runs and not include_paper:
        return None
    tasks = task_columns(runs, include_paper)
    rows = []
    for r in runs:
        rows.append(_run_row(f"{r.label} {r.single_kind}", r.tasks, None, tasks)[:-1])
        rows.append(_run_row(f"{r.label} Best-of-{r.best_of}", r.best_of_tasks, None, tasks)[:-1])
        delta = {}
        for t in tasks:
            a, b = r.tasks.get(t), r.best_of_tasks.get(t)
            if a is not None and b is not None:
                delta[t] = Score(_diff(b.success, a.success), _diff(b.progress, a.progress))
        rows.append(_run_row(f"{r.label} Δ", delta, None, tasks)[:-1])
    if include_paper:
        rows += [[f"paper: {p.model}", *_paper_cells(p, tasks)] for p in paper.TABLE4]
    return _markdown(["model", *map(display, tasks)], rows)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def table5() -> str:
    """Table 5 (the synthesis model): the paper's rows; our runs of each data set are Table 1 rows."""
    tasks = list(paper.TASKS)
    rows = [[f"paper: {p.model}", *_paper_cells(p, tasks)] for p in paper.TABLE5]
    return _markdown(["model", *map(display, tasks)], rows)


def figure8(results: Sequence[RunResult], include_paper: bool = False) -> str | None:
    """Figure 8's numbers: HotpotQA exact match and F1 per model (and Best-of-N beside)."""
    rows = []
    for r in results:
        for task, q in r.qa.items():
            name = r.label if task == "hotpotqa" else f"{r.label} ({display(task)})"
            kind = "" if r.best_of == 1 else f" {r.single_kind}"
            rows.append([f"{name}{kind}", pct(q.em), pct(q.f1)])
            if task in r.qa_best_of:
                b = r.qa_best_of[task]
                rows.append([f"{name} Best-of-{r.best_of}", pct(b.em), pct(b.f1)])
    if not rows and not include_paper:
        return None
    if include_paper:
        rows += [[f"paper: {m}", f"{em:.1f}", f"{f1:.1f}"] for m, (em, f1) in paper.FIGURE8.items()]
    return _markdown(["model", "EM", "F1"], rows)
