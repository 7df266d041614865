"""`python -m agentrefine_jax.analyze {diversity,judge-agreement,report}`: the paper's analyses.

diversity        Figures 6-7: t-SNE of the sources' Thoughts, source x source environment similarity,
                 one diversity number per source (mean pairwise cosine distance of its Thoughts).
judge-agreement  Figure 10: `synth verify` per-turn verdicts against a human's labels (2x2, kappa).
report           eval result JSONs -> Markdown tables in the paper's layouts (Tables 1-5, Figure 8)
                 and PNG figures (Figure 1, Figure 11).

python -m agentrefine_jax.analyze diversity --source agentrefine=data/ar.jsonl \
    --source agentflan=data/flan.jsonl --format agentflan=agentflan --out div/
python -m agentrefine_jax.analyze judge-agreement --judge report.jsonl --human human.jsonl
python -m agentrefine_jax.analyze report oracle.json random=r.json --out report/ --paper-rows
"""

from __future__ import annotations

import argparse
import logging
import math
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from agentrefine_jax import logs
from agentrefine_jax.cli_errors import OneLineParser, fail, int_in
from agentrefine_jax.data.schema import FORMATS

log = logging.getLogger("agentrefine_jax.analyze")
INTERRUPTED = 130


# Strict JSON has no NaN: a mean over pairs of fewer than two rows is null, for this reason.
NULLS = "a source with fewer than 2 Thoughts or environments has no pair to average"


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def _similarity_json(labels: Sequence[str], m: Any) -> dict[str, dict[str, float | None]]:
    return {a: dict(zip(labels, map(_finite, m[i].tolist()), strict=True)) for i, a in enumerate(labels)}


def _pairs(values: Sequence[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        label, sep, rest = v.partition("=")
        if not sep or not label or not rest:
            raise ValueError(f"{flag} {v!r}: expected LABEL=VALUE")
        out.append((label, rest))
    return out


class _Bar:
    """A tqdm bar on stderr (off with -q), sized by the first update that knows the total."""

    def __init__(self, desc: str, quiet: bool, total: int | None = None):
        self.desc, self.quiet, self.bar = f"[analyze] {desc}", quiet, None
        if total is not None:
            self._open(total)

    def _open(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, desc=self.desc, file=sys.stderr, disable=self.quiet, mininterval=1.0, leave=False
        )

    def update(self, n: int, total: int | None = None) -> None:
        if self.bar is None:
            self._open(total or 0)
        self.bar.update(n)  # type: ignore[union-attr]

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_diversity(args: argparse.Namespace) -> int:
    from agentrefine_jax.analyze import diversity as div
    from agentrefine_jax.analyze import figures
    from agentrefine_jax.analyze.outputs import write_csv, write_json
    from agentrefine_jax.analyze.texts import read_source

    sources: dict[str, list[str]] = {}
    for label, path in _pairs(args.source, "--source"):
        sources.setdefault(label, []).append(path)
    formats: dict[str, str] = {}
    for v in args.format:
        label, sep, fmt = v.rpartition("=")
        formats[label if sep else "*"] = fmt
    for label, fmt in formats.items():
        if label != "*" and label not in sources:
            raise ValueError(f"--format {label}={fmt}: no --source labelled {label!r}")
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt!r}: choose from {', '.join(FORMATS)}")
    embedder = None
    if args.model:  # load first: a bad model path fails before any data is read
        from agentrefine_jax.analyze.embed import ModelEmbedder

        embedder = ModelEmbedder(
            args.model, tokenizer=args.tokenizer, max_tokens=args.max_tokens, batch_size=args.batch_size
        )
    texts = []
    for label, specs in sources.items():
        fmt = formats.get(label, formats.get("*", "auto"))
        with _Bar(f"reading {label}", args.quiet) as bar:
            st = read_source(
                label,
                specs,
                fmt,
                max_rows=args.max_rows,
                max_thoughts=args.max_thoughts,
                seed=args.seed,
                progress=bar.update,
            )
        skipped = sum(st.skipped.values())
        log.info(
            f"{label}: {st.rows_read}/{st.rows_total} rows read ({skipped} skipped"
            f"{': ' + str(dict(st.skipped)) if skipped else ''}), {st.assistant_turns} assistant turns, "
            f"{st.without_thought} without a Thought; {len(st.thoughts)} Thoughts and "
            f"{len(st.environments)} environments sampled"
        )
        texts.append(st)
    if embedder is not None:
        n = sum(len(s.thoughts) + len(s.environments) for s in texts)
        with _Bar("embedding", args.quiet, n) as bar:
            emb = div.embed_sources(texts, lambda t: embedder(t, progress=bar.update))
        method = f"model:{args.model} (mean-pooled hidden states, {args.max_tokens} tokens max)"
    else:
        from agentrefine_jax.analyze.embed import tfidf

        emb = div.embed_sources(texts, tfidf)
        method = "tfidf"
    log.info("t-SNE ...")
    xy = div.tsne(emb.thoughts, args.seed, args.threads)
    labels = [s.label for s in texts]
    env_sim = div.similarity_matrix(emb.environments)
    thought_sim = div.similarity_matrix(emb.thoughts)
    scores = {s.label: div.diversity(x) for s, x in zip(texts, emb.thoughts, strict=True)}

    out = pathlib.Path(args.out)
    files = {
        "tsne_csv": out / "tsne.csv",
        "similarity_csv": out / "environment_similarity.csv",
        "thought_similarity_csv": out / "thought_similarity.csv",
        "tsne_png": out / "figure6_tsne.png",
        "heatmap_png": out / "figure7_similarity.png",
        "json": out / "diversity.json",
    }
    rows, k = [], 0
    for s in texts:
        for rid, msg, text in s.thoughts:
            rows.append([s.label, rid, msg, f"{xy[k, 0]:.6f}", f"{xy[k, 1]:.6f}", text])
            k += 1
    write_csv(files["tsne_csv"], ["source", "id", "message", "x", "y", "thought"], rows)
    for key, m in (("similarity_csv", env_sim), ("thought_similarity_csv", thought_sim)):
        write_csv(
            files[key], ["source", *labels], [[a, *(f"{v:.6f}" for v in m[i])] for i, a in enumerate(labels)]
        )
    figures.tsne_scatter(
        files["tsne_png"],
        xy,
        [row[0] for row in rows],
        f"Figure 6: t-SNE of Thoughts ({method.split(' ')[0]})",
    )
    figures.heatmap(files["heatmap_png"], env_sim, labels, "Figure 7: environment similarity (mean cosine)")
    summary = {
        "embedding": method,
        "seed": args.seed,
        "sources": {
            s.label: {
                "diversity": _finite(scores[s.label]),
                "thoughts": len(s.thoughts),
                "environments": len(s.environments),
                "rows_total": s.rows_total,
                "rows_read": s.rows_read,
                "rows_skipped": dict(s.skipped),
                "assistant_turns": s.assistant_turns,
                "turns_without_thought": s.without_thought,
            }
            for s in texts
        },
        "environment_similarity": _similarity_json(labels, env_sim),
        "thought_similarity": _similarity_json(labels, thought_sim),
        "files": {k: str(v) for k, v in files.items() if k != "json"},
        "figure_sizes_px": {"tsne": figures.SIZES["tsne"], "heatmap": figures.SIZES["heatmap"]},
    }
    if any(math.isnan(v) for v in [*scores.values(), *env_sim.ravel(), *thought_sim.ravel()]):
        summary["nulls"] = NULLS
    write_json(files["json"], summary)
    print(f"diversity (mean pairwise cosine distance of Thoughts, {method.split(' ')[0]}):")
    for s in texts:
        print(f"  {s.label}: {scores[s.label]:.4f}  ({len(s.thoughts)} Thoughts from {s.rows_read} rows)")
    log.info(f"wrote {', '.join(str(v) for v in files.values())}")
    return 0


def cmd_judge(args: argparse.Namespace) -> int:
    from agentrefine_jax.analyze import judge, paper
    from agentrefine_jax.analyze.outputs import write_json

    a = judge.agreement(judge.read_judge(args.judge), judge.read_human(args.human))
    print(judge.markdown(a, paper.FIGURE10 if args.paper_rows else None))
    if a.judge_only or a.human_only:
        log.warning(
            f"{len(a.judge_only) + len(a.human_only)} unmatched turn(s): {len(a.judge_only)} judged but not "
            f"labelled, {len(a.human_only)} labelled but not judged (listed in --out)"
        )
    if args.out:
        write_json(args.out, a.to_dict() | {"judge": args.judge, "human": args.human})
        log.info(f"wrote {args.out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from agentrefine_jax.analyze.report import build_report
    from agentrefine_jax.analyze.results import read_results

    results = read_results(args.results, args.setting)
    rep = build_report(results, args.out, args.paper_rows)
    print(rep.markdown, end="")
    log.info(f"wrote {', '.join(rep.files)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m agentrefine_jax.analyze", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("diversity", help="Figures 6-7: t-SNE of Thoughts, environment similarity, diversity")
    d.add_argument(
        "--source",
        action="append",
        required=True,
        help="LABEL=PATH: a dataset the data stage reads (file, dir, glob, datasets name); repeat per "
        "source (the same LABEL twice concatenates)",
    )
    d.add_argument(
        "--format",
        action="append",
        default=[],
        help=f"[LABEL=]FORMAT, the data.format preset ({', '.join(FORMATS)}); without LABEL for every "
        "source (default auto)",
    )
    d.add_argument("--model", help="embed with this model (project checkpoint or HF dir); default TF-IDF")
    d.add_argument("--tokenizer", help="with --model: tokenizer name/dir (default: the model's)")
    d.add_argument("--max-tokens", type=int_in(1), default=256, help="with --model: tokens per text")
    d.add_argument("--batch-size", type=int_in(1), default=16, help="with --model: texts per forward pass")
    d.add_argument("--max-rows", type=int_in(1), default=2000, help="rows sampled per source (seeded)")
    d.add_argument(
        "--max-thoughts",
        type=int_in(2),
        default=1000,
        help="Thoughts and environments kept per source (seeded)",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--threads", type=int_in(1), help="CPU threads for t-SNE (default: all; 1 on a busy shared machine)"
    )
    d.add_argument("--out", required=True, help="output directory (CSVs, PNGs, diversity.json)")
    d.set_defaults(func=cmd_diversity)

    j = sub.add_parser("judge-agreement", help="Figure 10: synthesis judge vs human per-turn labels")
    j.add_argument("--judge", required=True, help="`synth verify --out` JSONL (with per-turn verdicts)")
    j.add_argument("--human", required=True, help='JSONL of {"id", "turn", "needs_refinement"}')
    j.add_argument("--out", help="also write the table, accuracy, kappa and unmatched turns as JSON")
    j.add_argument("--paper-rows", action="store_true", help="add the paper's Figure 10 counts, labelled")
    j.set_defaults(func=cmd_judge)

    r = sub.add_parser("report", help="eval results -> the paper's tables (Markdown) and figures (PNG)")
    r.add_argument("results", nargs="+", help="eval result JSONs, PATH or LABEL=PATH (LABEL names the row)")
    r.add_argument("--out", required=True, help="output directory (report.md, PNGs)")
    r.add_argument("--paper-rows", action="store_true", help="add the paper's published rows, labelled")
    r.add_argument(
        "--setting",
        action="append",
        default=[],
        help="LABEL:KEY=VALUE, a run's training setting when its file does not name its checkpoint "
        "(e.g. mix20:data.general_ratio=0.2; Table 2 reads data.loss_on / data.drop_refinement_data, "
        "Figure 11 data.general_ratio / data.train_size)",
    )
    r.set_defaults(func=cmd_report)
    for command in sub.choices.values():
        logs.add_flags(command)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup("analyze", args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        return fail("analyze", e)
    except KeyboardInterrupt:
        print("[analyze] interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
