"""The PNG figures, drawn with matplotlib's object API on the Agg canvas (no display, no pyplot state).

Every figure has a fixed pixel size (`SIZES`, width x height at `DPI`), stated in the docs and
checked by the tests; no tight bounding box, which would change it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from agentrefine_jax.analyze.outputs import atomic

DPI = 100
SIZES = {
    "tsne": (800, 700),  # Figure 6
    "heatmap": (700, 600),  # Figure 7
    "bars": (900, 500),  # Figure 1
    "sweep": (700, 500),  # Figure 11
}


def _figure(kind: str):  # noqa: ANN202 - matplotlib.figure.Figure, imported lazily
    from matplotlib.figure import Figure

    w, h = SIZES[kind]
    return Figure(figsize=(w / DPI, h / DPI), dpi=DPI)


def _save(fig, path: str | os.PathLike[str]) -> None:  # noqa: ANN001
    with atomic(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")


def tsne_scatter(
    path: str | os.PathLike[str], xy: np.ndarray, labels: Sequence[str], title: str = "t-SNE of Thoughts"
) -> None:
    """Figure 6: one point per Thought, coloured by source."""
    fig = _figure("tsne")
    ax = fig.add_subplot()
    names = list(dict.fromkeys(labels))
    colors = _palette(len(names))
    lab = np.asarray(labels)
    for name, color in zip(names, colors, strict=True):
        pts = xy[lab == name]
        ax.scatter(pts[:, 0], pts[:, 1], s=8, alpha=0.7, color=color, label=f"{name} ({len(pts)})")
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="best", fontsize=8, markerscale=2)
    fig.tight_layout()
    _save(fig, path)


def heatmap(path: str | os.PathLike[str], matrix: np.ndarray, names: Sequence[str], title: str) -> None:
    """Figure 7: source x source mean cosine similarity, the value printed in each cell."""
    fig = _figure("heatmap")
    ax = fig.add_subplot()
    im = ax.imshow(matrix, cmap="viridis", vmin=min(0.0, float(matrix.min())), vmax=1.0)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=9)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    for i in range(len(names)):
        for j in range(len(names)):
            v = matrix[i, j]
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9, color="w" if v < 0.6 else "k")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(title)
    fig.tight_layout()
    _save(fig, path)


def grouped_bars(
    path: str | os.PathLike[str],
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    ylabel: str,
    title: str,
) -> None:
    """Figure 1: one group of bars per task, one bar per model (None: not measured, no bar)."""
    fig = _figure("bars")
    ax = fig.add_subplot()
    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(groups))
    for k, ((name, values), color) in enumerate(zip(series.items(), _palette(n), strict=False)):
        heights = [np.nan if v is None else 100 * v for v in values]
        bars = ax.bar(x - 0.4 + width * (k + 0.5), heights, width, label=name, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x, groups)
    ax.set_ylim(0, 100)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def sweep_line(
    path: str | os.PathLike[str],
    key: str,
    points: Sequence[tuple[float, float | None, float | None]],
    title: str,
) -> None:
    """Figure 11: held-out success and progress (%) against one training setting."""
    fig = _figure("sweep")
    ax = fig.add_subplot()
    pts = sorted(points)
    xs = [p[0] for p in pts]
    for idx, name, marker in ((1, "success", "o"), (2, "progress", "s")):
        ys = [np.nan if p[idx] is None else 100 * p[idx] for p in pts]
        ax.plot(xs, ys, marker=marker, label=f"held-out {name}")
    ax.set_xlabel(key)
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def _palette(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]
