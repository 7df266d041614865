"""`analyze report`: eval results -> one Markdown document in the paper's layouts, plus PNG figures."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

from agentrefine_jax.analyze import figures, tables
from agentrefine_jax.analyze.outputs import write_text
from agentrefine_jax.analyze.results import RunResult

SWEEP_KEYS = ("data.general_ratio", "data.train_size")


@dataclasses.dataclass
class Report:
    markdown: str
    files: list[str]  # every file written, the Markdown first


def sweep_points(results: Sequence[RunResult], key: str) -> list[tuple[float, float | None, float | None]]:
    """(setting, held-out success, held-out progress) of the runs whose training config sets `key`."""
    out = []
    for r in results:
        value = r.run_config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            held = r.held_out
            out.append((float(value), held.success if held else None, held.progress if held else None))
    return sorted(out)


def build_report(results: Sequence[RunResult], out_dir: str | pathlib.Path, include_paper: bool) -> Report:
    out = pathlib.Path(out_dir)
    files: list[str] = []
    sections: list[str] = ["# Evaluation report", ""]
    sections.append("Runs: " + "; ".join(f"`{r.label}` = {r.agent} ({r.path})" for r in results) + ".")
    sections.append(
        "Cells: success / progress in %."
        + (
            " Rows `paper: ...` are the paper's published numbers (Fu et al., ICLR 2025), not results "
            "of this project; `*` = held-in."
            if include_paper
            else ""
        )
    )
    optional = (
        ("## Table 1: success / progress per task", tables.table1(results, include_paper)),
        (
            "## Episodes: count, success 95% interval (Wilson), valid-action % and format-error % of the "
            "replies, and why episodes ended",
            tables.episodes_table(results),
        ),
        (
            "## Recovery: after a rejected turn (invalid or unparseable), the recovery rate % (next turn "
            "valid) / mean steps to recover / repeated-error rate % (the same rejected action again)",
            tables.recovery_table(results),
        ),
        ("## Table 2: ablations", tables.table2(results, include_paper)),
        (
            "## Table 3: perturbations (average and population std over the original and every perturbation)",
            tables.table3(results, include_paper),
        ),
        ("## Table 4: single sample vs Best-of-N", tables.table4(results, include_paper)),
        ("## Table 5: synthesis model (the paper's rows)", tables.table5() if include_paper else None),
        ("## Figure 8: HotpotQA exact match / F1 (%)", tables.figure8(results, include_paper)),
    )
    for title, body in optional:
        if body:
            sections += ["", title, "", body]

    with_tasks = [r for r in results if r.tasks]
    if with_tasks:
        bars = out / "figure1_progress.png"
        task_cols = tables.task_columns(with_tasks)
        figures.grouped_bars(
            bars,
            [tables.display(t) for t in task_cols],
            {r.label: [r.tasks[t].progress if t in r.tasks else None for t in task_cols] for r in with_tasks},
            "progress rate (%)",
            "Figure 1: progress per task",
        )
        files.append(str(bars))
        sections += ["", "## Figure 1: progress per task", "", f"![Figure 1]({bars.name})"]
    for key in SWEEP_KEYS:
        points = sweep_points(results, key)
        if len({p[0] for p in points}) < 2:
            continue
        png = out / f"figure11_{key.split('.')[-1]}.png"
        figures.sweep_line(png, key, points, f"Figure 11: held-out score vs {key}")
        files.append(str(png))
        rows = "\n".join(f"| {x:g} | {tables.pct(s)} | {tables.pct(p)} |" for x, s, p in points)
        sections += [
            "",
            f"## Figure 11: held-out score vs `{key}`",
            "",
            f"| {key} | held-out success | held-out progress |\n|---|---|---|\n{rows}",
            "",
            f"![Figure 11]({png.name})",
        ]
    markdown = "\n".join(sections) + "\n"
    md = out / "report.md"
    write_text(md, markdown)
    return Report(markdown, [str(md), *files])
