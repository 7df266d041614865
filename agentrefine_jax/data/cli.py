"""`python -m agentrefine_jax.data {dump,stats,show}`: look at exactly what training will see.

dump   one JSON object per example (`--no-pack`) or per packed row: input_ids, loss_mask
       (loss_mask[i] == 1 when input_ids[i] is a token the loss trains the model to produce),
       plus segment_ids / positions for packed rows.
stats  length distribution, loss-token fraction, turn categories, packing vs padding.
show   one conversation in the terminal, trained spans in green, untrained ones dimmed.

All three run the same code as the training pipeline (`build_data`), so what they show is
what the trainer gets. `dump` and `stats` exit 2 with one line when no row is usable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from agentrefine_jax import logs, outputs
from agentrefine_jax.cli_errors import OneLineParser, fail
from agentrefine_jax.config import Config, DataConfig, validate
from agentrefine_jax.data.examples import prepare_messages
from agentrefine_jax.data.packing import materialize, padding_efficiency
from agentrefine_jax.data.pipeline import build_data, build_template
from agentrefine_jax.data.preference import PairReport, build_pairs, pairs_of_rows
from agentrefine_jax.data.report import DataReport
from agentrefine_jax.data.schema import (
    FORMATS,
    RowError,
    assistant_categories,
    check_loss_on,
    resolve_field_map,
)
from agentrefine_jax.data.sources import RecordSet
from agentrefine_jax.data.templates import TEMPLATES, hf_chat_template
from agentrefine_jax.outputs import json_dumps


def _common(p: argparse.ArgumentParser) -> None:
    d = DataConfig()
    p.add_argument(
        "--input", "-i", action="append", required=True, help="JSONL/JSON/parquet file, dir or glob"
    )
    p.add_argument(
        "--template",
        choices=TEMPLATES,
        default=None,
        help="default: hf (the directory's own) when --tokenizer is a directory that ships a chat "
        f"template, else {d.template}",
    )
    p.add_argument(
        "--tokenizer", default=None, help="llama3 | mistral | HF tokenizer dir (default: the template)"
    )
    p.add_argument(
        "--loss-on", default=",".join(d.loss_on), help="comma list of correct,refinement,erroneous"
    )
    p.add_argument("--max-length", type=int, default=d.max_length)
    p.add_argument("--overlength", choices=("truncate", "drop"), default=d.overlength)
    p.add_argument(
        "--drop-refinement-data", action="store_true", help="remove erroneous turns + their feedback"
    )
    p.add_argument("--format", choices=FORMATS, default=d.format)
    p.add_argument("--field-map", default="{}", help='JSON, e.g. {"turns": "conversations", "role": "from"}')
    p.add_argument(
        "--max-skip-fraction",
        type=float,
        default=d.max_skip_fraction,  # the training default, defined once in DataConfig
        help="fail when more than this fraction of the rows is skipped (default %(default)s)",
    )


def _default_template(tokenizer: str | None) -> str:
    """A tokenizer directory's own chat template when it ships one (as training from that
    directory would use), else the training default."""
    if tokenizer and pathlib.Path(tokenizer).is_dir() and hf_chat_template(tokenizer):
        return "hf"
    return DataConfig().template


def _config(args: argparse.Namespace, pack: bool) -> DataConfig:
    try:
        field_map = json.loads(args.field_map)
    except json.JSONDecodeError as e:
        raise ValueError(f"--field-map is not valid JSON: {e}") from None
    if not isinstance(field_map, dict):
        raise ValueError("--field-map must be a JSON object")
    template = args.template or _default_template(args.tokenizer)
    cfg = DataConfig(
        train_files=tuple(args.input),
        format=args.format,
        field_map=field_map,
        tokenizer=args.tokenizer or template,
        template=template,
        loss_on=tuple(sorted(check_loss_on(args.loss_on))),
        drop_refinement_data=args.drop_refinement_data,
        max_length=args.max_length,
        overlength=args.overlength,
        pack=pack,
        shuffle=False,
        max_skip_fraction=args.max_skip_fraction,
    )
    validate(Config(data=cfg))  # the training config's own checks: bad values fail before any read
    return cfg


log = logging.getLogger("agentrefine_jax.data")


def _refuse_input_as_output(records: RecordSet, out: str) -> None:
    """Writing the dump over one of its inputs would destroy the data it is reading."""
    target = pathlib.Path(out)
    for source in records.sources:
        src = pathlib.Path(source.label)
        if src.exists() and target.exists() and os.path.samefile(src, target):
            raise ValueError(f"--out {out} is the input file {source.label}; choose another output path")


def cmd_dump(args: argparse.Namespace) -> int:
    cfg = _config(args, pack=not args.no_pack)
    outputs.check_file(args.out)  # before reading: a directory or an unwritable place fails at once
    records = RecordSet(cfg.train_files)
    _refuse_input_as_output(records, args.out)
    local = build_data(cfg, "train", records=records)
    store = local.store
    tok = build_template(cfg).tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    n = 0
    with outputs.open_atomic(args.out) as f:
        if args.no_pack:
            for i in range(len(store)):
                ids, mask = store.example(i)
                rec = {
                    "source": store.where[i],
                    "input_ids": ids.tolist(),
                    "loss_mask": mask.astype(int).tolist(),
                }
                f.write(json_dumps(rec) + "\n")
                n += 1
        else:
            for row in local.rows:
                arrays = materialize(store, row, cfg.max_length, pad_id)
                rec: dict[str, Any] = {"sources": [store.where[i] for i in row]}
                rec.update({k: v.tolist() for k, v in arrays.items()})
                f.write(json_dumps(rec) + "\n")
                n += 1
    log.info(local.report.summary())
    log.info(f"wrote {n} {'examples' if args.no_pack else 'packed rows'} to {args.out}")
    return 0


PROGRESS_EVERY_S = 30.0  # `data stats`: seconds between progress lines


class _Progress:
    """Rows done, rate and ETA on stderr (logging), at most every `every` seconds."""

    def __init__(self, total: int, every: float):
        self.total, self.every, self.done = total, every, 0
        self.start = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last < self.every or self.done >= self.total:
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        log.info(
            f"stats: {self.done:,} of {self.total:,} rows ({self.done / self.total:.0%}), "
            f"{rate:,.0f} rows/s, about {_duration(eta)} left"
        )

    def finish(self) -> None:
        took = time.monotonic() - self.start
        log.info(
            f"stats: {self.done:,} rows in {_duration(took)} ({self.done / max(took, 1e-9):,.0f} rows/s)"
        )


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    s = round(seconds)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class _StatsRecords:
    """The records `data stats` reads, in one pass: `build_data` reads them chunk by chunk through
    this, and each chunk is also counted as preference pairs here, after its examples (the report
    used to read, parse and tokenize the whole input a second time for them, each pair's prompt
    -- its trajectory's prefix -- re-tokenized pair by pair). Encodings of equal texts are shared
    within a chunk (`_share_encodings`), so a pair costs no tokenizing: its texts are its row's.
    With `sample`, only those record indices exist."""

    def __init__(
        self,
        records: RecordSet,
        cfg: DataConfig,
        template: Any,
        pairs: Any,
        sample: np.ndarray | None,
        every: float,
    ):
        self.records, self.cfg, self.template, self.pairs = records, cfg, template, pairs
        self.sample = sample
        self.sources = records.sources
        self.field_map = resolve_field_map(cfg.format, cfg.field_map)
        self.encodings = _share_encodings(template)
        self.progress = _Progress(len(self), every)
        self.pending: list[tuple[str, Any]] = []

    def __len__(self) -> int:
        return len(self.records) if self.sample is None else len(self.sample)

    def describe(self) -> str:
        if self.sample is None:
            return self.records.describe()
        return f"{self.records.describe()}; a sample of {len(self.sample)} of {len(self.records)} records"

    def read(self, indices: Sequence[int]) -> list[tuple[str, Any]]:
        self.count_pairs()  # the previous chunk's, now that its examples are encoded
        wanted = indices if self.sample is None else self.sample[np.asarray(indices, np.int64)].tolist()
        self.pending = self.records.read(wanted)
        self.progress.add(len(self.pending))
        return self.pending

    def count_pairs(self) -> None:
        """Pairs of the chunk read last: their texts are its examples' (already encoded, shared),
        so this tokenizes next to nothing; then the shared encodings go (memory: one chunk's)."""
        if self.pending:
            build_pairs(
                pairs_of_rows(self.pending, self.field_map, self.pairs),
                self.template,
                self.cfg.max_length,
                self.pairs,
            )
        self.pending = []
        self.encodings.clear()


def _share_encodings(template: Any) -> dict[str, list[int]]:
    """Make `template.encode_text` encode each distinct text once (until the returned dict is
    cleared). Exact: every text is encoded on its own, whatever else is in the batch."""
    encode = template.encode_text
    known: dict[str, list[int]] = {}

    def encode_text(texts: Sequence[str]) -> list[list[int]]:
        new = [t for t in dict.fromkeys(texts) if t not in known]
        if new:
            known.update(zip(new, encode(new), strict=True))
        return [known[t] for t in texts]

    template.encode_text = encode_text
    return known


def cmd_stats(args: argparse.Namespace) -> int:
    cfg = _config(args, pack=True)
    if args.sample is not None and args.sample < 1:
        raise ValueError(f"--sample must be >= 1, got {args.sample}")
    records = RecordSet(cfg.train_files)
    sample = None
    if args.sample is not None and args.sample < len(records):
        # A uniform sample without replacement, read in file order (seeded: the same rows each run).
        sample = np.sort(np.random.default_rng(args.seed).choice(len(records), args.sample, replace=False))
    template = build_template(cfg)
    pairs = PairReport()  # preference pairs (docs/preference.md): only the counts are kept
    reading = _StatsRecords(records, cfg, template, pairs, sample, args.progress_every)
    local = build_data(cfg, "train", template=template, records=reading)  # type: ignore[arg-type]
    reading.count_pairs()
    reading.progress.finish()
    rep = local.report
    lengths = local.store.lengths
    stats = rep.to_dict()
    stats["per_batch_padding_efficiency"] = padding_efficiency(lengths, args.batch_size)
    stats["batch_size_for_padding"] = args.batch_size
    stats.pop("skipped_at", None)
    stats["preference"] = pairs.to_dict()
    if sample is not None:
        stats["sample"] = {"records": len(sample), "of": len(records), "seed": args.seed}
    if args.json:
        print(json_dumps(stats, indent=2, default=str))
        return 0
    if sample is not None:
        print(
            f"SAMPLE: {len(sample)} of {len(records)} records (uniform, --seed {args.seed}); "
            "every count below is of the sample"
        )
    print(rep.summary())
    print(pairs.summary())
    if len(lengths):
        edges = [0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 1 << 62]
        hist, _ = np.histogram(lengths, bins=edges)
        print("  length histogram:")
        for lo, hi, c in zip(edges[:-1], edges[1:], hist, strict=True):
            if c:
                label = f"{lo}-{hi - 1}" if hi < (1 << 62) else f">={lo}"
                print(f"    {label:>12}: {c:6d} {'#' * max(1, int(50 * c / len(lengths)))}")
    print(
        f"  token fill: packed {rep.packing_efficiency:.1%} | padded per batch of {args.batch_size} "
        f"{stats['per_batch_padding_efficiency']:.1%} | padded to max_length {rep.padded_efficiency:.1%}"
    )
    return 0


_GREEN, _DIM, _RED, _BOLD, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[31m", "\x1b[1m", "\x1b[0m"


def render_conversation(
    messages: list[dict[str, Any]], cfg: DataConfig, color: bool = True
) -> tuple[str, int, int]:
    """Token-exact rendering with trained spans highlighted; returns (text, tokens, loss tokens)."""
    template = build_template(cfg)
    ids, mask, ends = template.encode_batch([messages], cfg.loss_on)[0]
    cats = assistant_categories(messages)

    def span(a: int, b: int, label: str | None) -> str:
        out = []
        j = a
        while j < b:
            k = j
            while k < b and mask[k] == mask[j]:
                k += 1
            text = template.decode(ids[j:k], skip_special_tokens=False)
            if color:
                style = _GREEN if mask[j] else (_RED if label == "erroneous" else _DIM)
                out.append(f"{style}{text}{_RESET}")
            else:
                out.append(f"⟦{text}⟧" if mask[j] else text)
            j = k
        return "".join(out)

    parts = []
    start = 0
    for k, m in enumerate(messages):
        end = ends[k]
        cat = cats[k]
        tag = m["role"] + (f" · {cat} · {'TRAINED' if cat in cfg.loss_on else 'no loss'}" if cat else "")
        if m.get("_context"):
            tag = f"{m['role']} · context (trained in an earlier example)"
        head = f"{_BOLD}── {tag} ──{_RESET}" if color else f"── {tag} ──"
        parts.append(head + "\n" + span(start, end, cat))
        start = end
    return "\n".join(parts), len(ids), int(sum(mask))


def cmd_show(args: argparse.Namespace) -> int:
    cfg = _config(args, pack=False)
    if args.pair is not None:
        return show_pair(cfg, args.pair, args.color)
    records = RecordSet(cfg.train_files)
    if not 0 <= args.row < len(records):
        raise ValueError(f"--row {args.row} out of range: {len(records)} records in {records.describe()}")
    where, row = records.read([args.row])[0]
    report = DataReport()
    try:
        if isinstance(row, RowError):
            raise row
        messages = prepare_messages(
            row, resolve_field_map(cfg.format, cfg.field_map), where, cfg.drop_refinement_data, report
        )
    except RowError as e:
        print(f"{where}: skipped by the pipeline: {e}", file=sys.stderr)
        return 1
    color = sys.stdout.isatty() if args.color == "auto" else args.color == "always"
    try:
        # One example per render context (ChatTemplate.contexts: Qwen3's thinking splits a row).
        pieces = build_template(cfg).contexts(messages, cfg.loss_on)
        rendered = [render_conversation(piece, cfg, color=color) for piece in pieces]
    except RowError as e:
        print(f"{where}: skipped by the pipeline: {e}", file=sys.stderr)
        return 1
    for j, (text, _, _) in enumerate(rendered):
        if len(rendered) > 1:
            print(f"== example {j + 1} of {len(rendered)}: turns trained in the context inference renders ==")
        print(text)
    n, n_loss = sum(r[1] for r in rendered), sum(r[2] for r in rendered)
    legend = (
        f"{_GREEN}trained{_RESET}  {_DIM}not trained{_RESET}  {_RED}erroneous (no loss){_RESET}"
        if color
        else "⟦trained⟧, everything else not trained"
    )
    frac = n_loss / max(n, 1)
    print(f"\n{where}: {n} tokens, {n_loss} with loss ({frac:.1%}); loss_on={','.join(cfg.loss_on)}")
    print(legend)
    if n > cfg.max_length:
        print(f"note: {n} > max_length {cfg.max_length}: training would {cfg.overlength} this trajectory")
    return 0


def show_pair(cfg: DataConfig, k: int, color_opt: str) -> int:
    """Pair `k` (0-based, in file order) as the trainer renders it: prompt, then each reply's
    trained tokens (the reply and its end token)."""
    if k < 0:
        raise ValueError(f"--pair {k} must be >= 0")
    records, report = RecordSet(cfg.train_files), PairReport()
    field_map = resolve_field_map(cfg.format, cfg.field_map)
    seen = 0
    for start in range(0, len(records), 256):
        chunk = records.read(list(range(start, min(start + 256, len(records)))))
        for pair in pairs_of_rows(chunk, field_map, report):
            if seen == k:
                return _print_pair(cfg, pair, color_opt)
            seen += 1
    raise ValueError(f"--pair {k} out of range: {seen} pairs in {records.describe()}")


def _print_pair(cfg: DataConfig, pair: Any, color_opt: str) -> int:
    template = build_template(cfg)
    color = sys.stdout.isatty() if color_opt == "auto" else color_opt == "always"
    store = build_pairs([pair], template, cfg.max_length, report := PairReport())
    if not report.pairs:
        print(
            f"{pair.where}: skipped by the pipeline: longer than max_length {cfg.max_length}", file=sys.stderr
        )
        return 1
    prompt_ids = store.example(0)[0][: int(np.argmax(store.example(0)[1] > 0))]
    print(f"── prompt ({len(prompt_ids)} tokens) ──")
    print(template.decode(prompt_ids, skip_special_tokens=False))
    for i, label in ((0, "chosen (the refinement)"), (1, "rejected (the erroneous turn)")):
        ids, mask = store.example(i)
        reply = template.decode(ids[mask > 0], skip_special_tokens=False)
        head = f"── {label}: {int((mask > 0).sum())} scored tokens ──"
        print(
            f"{_BOLD}{head}{_RESET}\n{_GREEN if i == 0 else _RED}{reply}{_RESET}"
            if color
            else f"{head}\n⟦{reply}⟧"
        )
    shortened = " (oldest turns dropped to fit max_length)" if report.prompts_shortened else ""
    what = "an erroneous turn and its refinement" if "#turn" in pair.where else "a preference row"
    print(f"\n{pair.where}: the pair of {what}{shortened}")
    return 0


def cmd_demo_world(args: argparse.Namespace) -> int:
    import pathlib

    from agentrefine_jax.data.demo_world import write_split

    out = pathlib.Path(args.out_dir)
    n = write_split(out / "train.jsonl", range(args.train), args.error_rate)
    # Eval seeds start far from the training ones so the worlds differ.
    m = write_split(out / "eval.jsonl", range(1_000_000, 1_000_000 + args.eval), args.error_rate)
    print(f"wrote {n} train rows to {out / 'train.jsonl'} and {m} eval rows to {out / 'eval.jsonl'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m agentrefine_jax.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dump", help="write token ids + loss masks as JSONL")
    _common(p)
    p.add_argument("--no-pack", action="store_true", help="one object per example instead of per packed row")
    p.add_argument("--out", "-o", required=True)
    p.set_defaults(fn=cmd_dump)
    p = sub.add_parser("stats", help="length / loss / category / packing statistics")
    _common(p)
    p.add_argument(
        "--batch-size", type=int, default=8, help="batch size for the per-batch padding comparison"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="statistics of N records drawn uniformly (stated in the output); default: every record",
    )
    p.add_argument("--seed", type=int, default=0, help="the --sample draw's seed (default %(default)s)")
    p.add_argument(
        "--progress-every",
        type=float,
        default=PROGRESS_EVERY_S,
        metavar="S",
        help="seconds between progress lines on stderr (default %(default)s)",
    )
    p.set_defaults(fn=cmd_stats)
    p = sub.add_parser("show", help="render one conversation with trained spans coloured")
    _common(p)
    p.add_argument("--row", type=int, default=0, help="record index (0-based, over all inputs)")
    p.add_argument(
        "--pair", type=int, default=None, help="show preference pair K instead (docs/preference.md)"
    )
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("demo-world", help="regenerate the shipped demo trajectories (deterministic)")
    p.add_argument("--out-dir", required=True, help="where train.jsonl and eval.jsonl are written")
    p.add_argument("--train", type=int, default=400, help="number of training trajectories")
    p.add_argument("--eval", type=int, default=40, help="number of eval trajectories")
    p.add_argument("--error-rate", type=float, default=0.25, help="chance of a mistake at each step")
    p.set_defaults(fn=cmd_demo_world)
    for command in sub.choices.values():
        logs.add_flags(command)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup("data", args)
    try:
        return int(args.fn(args))
    except (ValueError, FileNotFoundError, TypeError) as e:
        return fail("data", e)
