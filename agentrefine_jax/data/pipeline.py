"""The Grain input pipeline the trainer consumes.

records -> split (eval hold-out) -> [train_size selection] -> parse/validate -> tokenize+mask
-> [+ general chat mix] -> pack (plan once) -> per-epoch row order -> each process
materialises its rows of each global batch -> prefetch.

Topology invariance: everything up to the row order is computed identically on every
process from the whole dataset, so the global batch at step k holds the same packed rows
in the same order whatever the number of processes or devices; process p then materialises
only the rows of each global batch that its devices hold (`batch_rows`). The iterator's
position is the global step, so a run stopped on one topology resumes on another with the
same data (`Pipeline.iterator(start_step)`). The price: every process tokenizes the whole
training set up front (the packing plan and `steps_per_epoch` need every length before
step 0), which is a one-off cost of about 130k tokens/s/core and ~5 bytes per token (held in
memory up to `examples.SPILL_BYTES`, then in a temporary file); records are parsed
`_READ_CHUNK` at a time, so the file's size never has to fit in memory.

Final partial batch: the training split DROPS it (rows are reshuffled every epoch, so a
different handful sits out each epoch; the report says how many). The eval split PADS it
with empty rows (segment 0, mask 0), so every eval token is scored once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from agentrefine_jax import objective_table
from agentrefine_jax.config import DataConfig
from agentrefine_jax.data.examples import StoreBuilder, TokenStore, build_examples, concat_stores
from agentrefine_jax.data.packing import materialize, pack_best_fit
from agentrefine_jax.data.preference import PairReport, build_pairs, pairs_of_rows
from agentrefine_jax.data.report import MAX_KEPT_LOCATIONS, DataReport
from agentrefine_jax.data.schema import FieldMap, check_loss_on, resolve_field_map
from agentrefine_jax.data.sources import RecordSet
from agentrefine_jax.data.templates import ChatTemplate, get_template
from agentrefine_jax.data.tokenizers import load_tokenizer

SPLITS = ("train", "eval")
# Seeds of the independent random streams derived from data.seed.
_HOLDOUT, _SELECT, _GENERAL, _EPOCH = 0xE7A1, 0x5E1EC7, 0x6E7E, 0xE90C
_READ_CHUNK = 512  # records parsed at once: bounds the memory of parsed rows, whatever the file size


class DataError(ValueError):
    """No usable training data (one line; the report has the details)."""


class NoPairsError(DataError):
    """A preference objective on data without a single pair: the input's fault (exit 2)."""


def split_indices(n_total: int, cfg: DataConfig, split: str, has_eval_files: bool) -> np.ndarray:
    """Global record indices of `split` within the training files (eval_fraction hold-out)."""
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {cfg.eval_fraction}")
    all_idx = np.arange(n_total, dtype=np.int64)
    if has_eval_files or cfg.eval_fraction == 0.0:
        return all_idx
    n_eval = max(1, int(round(cfg.eval_fraction * n_total)))
    # The hold-out depends only on the seed and the record count, so every process agrees.
    held = np.zeros(n_total, dtype=bool)
    held[np.random.default_rng([cfg.seed, _HOLDOUT]).permutation(n_total)[:n_eval]] = True
    return all_idx[held] if split == "eval" else all_idx[~held]


def build_template(cfg: DataConfig) -> ChatTemplate:
    return get_template(cfg.template, load_tokenizer(cfg.tokenizer))


@dataclasses.dataclass
class BuiltData:
    """The whole split as every process sees it: examples, packed rows, report."""

    store: TokenStore
    rows: list[tuple[int, ...]]
    report: DataReport


def _examples(
    cfg: DataConfig,
    records: RecordSet,
    order: np.ndarray,
    limit: int | None,
    template: ChatTemplate,
    field_map: FieldMap | None,
    report: DataReport,
) -> TokenStore:
    """Examples from `records[order]`; with `limit`, exactly the first `limit` valid ones.

    Records are parsed `_READ_CHUNK` at a time (never the whole file at once: a parsed row
    costs several times its bytes), and with `limit` never more than are still missing (a
    record yields at most one example, or several when the template splits it: then the examples
    stop at `limit`), so the examples and the report cover exactly the records consumed: the
    shortest prefix of `order` holding `limit` valid examples.
    """
    kwargs = dict(
        loss_on=check_loss_on(cfg.loss_on),
        max_length=cfg.max_length,
        overlength=cfg.overlength,
        drop_refinement=cfg.drop_refinement_data,
        field_map=field_map,
        report=report,
        seen_ids={},
    )
    builder, pos = StoreBuilder(), 0  # tokens past SPILL_BYTES go to a temporary file
    while pos < len(order) and (limit is None or len(builder) < limit):
        want = _READ_CHUNK if limit is None else min(_READ_CHUNK, limit - len(builder))
        chunk = order[pos : pos + want]
        pos += len(chunk)
        missing = None if limit is None else limit - len(builder)
        builder.add(build_examples(records.read(chunk.tolist()), template, max_examples=missing, **kwargs))
    report.records_in_shard = pos
    return builder.finish()


_HINT = "check data.format / data.field_map (all skips: python -m agentrefine_jax.data stats)"


def _check_skips(cfg: DataConfig, report: DataReport, what: str) -> None:
    if not report.records_in_shard:  # an empty file (or a split left empty) is no data, not 0% skipped
        raise DataError(f"no {what} records in {report.sources or 'the inputs'}")
    if report.examples == 0:
        raise DataError(f"no usable {what} examples: {report.one_line()}; {_HINT}")
    if report.records_in_shard and report.skipped_total > cfg.max_skip_fraction * report.records_in_shard:
        raise DataError(
            f"{what}: {report.one_line()}: more than data.max_skip_fraction={cfg.max_skip_fraction}; {_HINT}"
        )


def build_data(
    cfg: DataConfig,
    split: str,
    template: ChatTemplate | None = None,
    records: RecordSet | None = None,
    objective: str = objective_table.DEFAULT,
) -> BuiltData:
    """Examples, packed rows and report of `split`: identical on every process.

    The data is what the `objective`'s table entry trains on (objective_table.py): SFT examples,
    preference pairs (data/preference.py), or both. A pair's chosen and rejected are one packing
    unit: they sit in the same row, as consecutive segments."""
    spec = objective_table.get(objective)
    if spec.rollouts:  # the RL loop's rollouts are its batches (rl/): a split has none to give
        raise DataError(f"objective={objective} trains on rollouts (rl/), not on the {split} split's data")
    if spec.pairs:
        return _build_preference(cfg, split, template, records, spec)
    return _build_examples(cfg, split, template, records)


def _build_examples(
    cfg: DataConfig, split: str, template: ChatTemplate | None, records: RecordSet | None
) -> BuiltData:
    """The SFT examples of `split`, packed."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    files = cfg.eval_files if (split == "eval" and cfg.eval_files) else cfg.train_files
    if not files:
        raise ValueError(
            f"no input files for split {split!r}: set data.train_files"
            + (" and data.eval_files or data.eval_fraction" if split == "eval" else "")
        )
    if split == "eval" and not cfg.eval_files and cfg.eval_fraction == 0.0:
        raise ValueError("split 'eval' needs data.eval_files or data.eval_fraction > 0")
    records = records or RecordSet(files)
    template = template or build_template(cfg)
    idx = split_indices(len(records), cfg, split, has_eval_files=bool(cfg.eval_files))
    report = DataReport(split=split, sources=records.describe(), records_total=len(records), packed=cfg.pack)
    limit = cfg.train_size if split == "train" else None
    if limit is not None:
        idx = idx[np.random.default_rng([cfg.seed, _SELECT]).permutation(len(idx))]
    field_map = resolve_field_map(cfg.format, cfg.field_map)
    store = _examples(cfg, records, idx, limit, template, field_map, report)
    _check_skips(cfg, report, split)
    if limit is not None:
        if len(store) < limit:
            raise DataError(
                f"data.train_size={limit} but only {len(store)} usable examples in {len(idx)} records"
            )
        report.selection = (
            f"train_size: the first {limit} valid examples of a permutation seeded by data.seed={cfg.seed} "
            f"({report.records_in_shard} of {len(idx)} records read)"
        )
    if split == "train" and cfg.general_ratio > 0:
        store = concat_stores([store, _general(cfg, len(store), template, report)])
    if cfg.pack:
        rows = [tuple(r) for r in pack_best_fit(store.lengths, cfg.max_length)]
    else:
        rows = [(i,) for i in range(len(store))]
    report.rows = len(rows)
    return BuiltData(store=store, rows=rows, report=report)


def _build_preference(
    cfg: DataConfig,
    split: str,
    template: ChatTemplate | None,
    records: RecordSet | None,
    objective: objective_table.Objective,
) -> BuiltData:
    """Pairs (and the SFT examples, when the objective trains on both) of `split`, packed with
    each pair in one row."""
    files = cfg.eval_files if (split == "eval" and cfg.eval_files) else cfg.train_files
    records = records or RecordSet(files)
    template = template or build_template(cfg)
    if objective.examples:
        sft = _build_examples(cfg, split, template, records)
        store, report = sft.store, sft.report
    else:
        store = concat_stores([])
        report = DataReport(
            split=split, sources=records.describe(), records_total=len(records), packed=cfg.pack
        )
    idx = split_indices(len(records), cfg, split, has_eval_files=bool(cfg.eval_files))
    if not objective.examples:
        report.records_in_shard = len(idx)
    preport = PairReport()
    report.preference = preport
    field_map = resolve_field_map(cfg.format, cfg.field_map)
    chunks = (records.read(idx[i : i + 1024].tolist()) for i in range(0, len(idx), 1024))
    pairs = build_pairs(
        (p for chunk in chunks for p in pairs_of_rows(chunk, field_map, preport)),
        template,
        cfg.max_length,
        preport,
    )
    if not objective.examples:  # pairs alone: the records they skipped are this run's skipped rows
        report.skipped.update(preport.rows_skipped)
        report.skipped_at.extend(preport.rows_skipped_at[: MAX_KEPT_LOCATIONS - len(report.skipped_at)])
        report.parsed = report.records_in_shard - report.skipped_total
    if not preport.pairs:
        raise NoPairsError(
            f"objective={objective.name} needs preference pairs, but {report.sources or 'the inputs'} "
            f"({split}) has none:{preport.summary().split(':', 1)[1]}; see docs/preference.md"
        )
    if report.skipped_total > cfg.max_skip_fraction * report.records_in_shard:
        raise DataError(
            f"{split}: {report.one_line()}: more than data.max_skip_fraction={cfg.max_skip_fraction}; {_HINT}"
        )
    n_sft = len(store)
    store = concat_stores([store, pairs])
    units = [(i,) for i in range(n_sft)] + [(n_sft + 2 * k, n_sft + 2 * k + 1) for k in range(preport.pairs)]
    unit_lengths = np.asarray([sum(int(store.lengths[e]) for e in u) for u in units], np.int64)
    report.lengths = np.concatenate([report.lengths, store.lengths[n_sft:]])
    report.max_length = cfg.max_length
    report.tokens += int(store.lengths[n_sft:].sum())  # rows hold the pairs too (their fill)
    report.pair_units = preport.pairs
    if cfg.pack:
        rows = [tuple(e for u in r for e in units[u]) for r in pack_best_fit(unit_lengths, cfg.max_length)]
    else:
        rows = list(units)
    report.rows = len(rows)
    return BuiltData(store=store, rows=rows, report=report)


def pair_counts(cfg: DataConfig, template: ChatTemplate, records: RecordSet) -> PairReport:
    """Pair counts of the training files, read chunk by chunk (nothing but counts is kept)."""
    report = PairReport()
    field_map = resolve_field_map(cfg.format, cfg.field_map)
    for start in range(0, len(records), 1024):
        chunk = records.read(list(range(start, min(start + 1024, len(records)))))
        build_pairs(pairs_of_rows(chunk, field_map, report), template, cfg.max_length, report)
    return report


def _general(cfg: DataConfig, n_agent: int, template: ChatTemplate, report: DataReport) -> TokenStore:
    """round(general_ratio * n_agent) general chat examples: the first of a seeded permutation."""
    want = int(round(cfg.general_ratio * n_agent))
    records = RecordSet(cfg.general_files)
    order = np.random.default_rng([cfg.seed, _GENERAL]).permutation(len(records))
    gen = DataReport(split="general", sources=records.describe(), records_total=len(records), packed=cfg.pack)
    report.general = gen
    if want == 0:
        return concat_stores([])
    store = _examples(cfg, records, order, want, template, resolve_field_map(cfg.general_format), gen)
    _check_skips(cfg, gen, "general")
    if len(store) < want:
        raise DataError(
            f"data.general_ratio={cfg.general_ratio} x {n_agent} agent examples needs {want} general "
            f"examples; data.general_files has only {len(store)} usable"
        )
    gen.selection = (
        f"general_ratio {cfg.general_ratio}: the first {want} valid examples of a permutation seeded by "
        f"data.seed={cfg.seed}"
    )
    return store


def contiguous_rows(process_index: int, process_count: int, global_batch_size: int) -> np.ndarray:
    """Process p's rows of a global batch when each process holds one contiguous block."""
    local = global_batch_size // process_count
    return np.arange(process_index * local, (process_index + 1) * local, dtype=np.int64)


def process_batch_rows(sharding: Any, global_batch_size: int) -> np.ndarray:
    """The global-batch rows this process's devices hold under `sharding`, ascending.

    This is the order `jax.make_array_from_process_local_data` expects the process-local
    rows in, whatever the mesh's device order (hosts interleaved, batch replicated...).
    """
    rows: set[int] = set()
    for device, index in sharding.addressable_devices_indices_map((global_batch_size, 1)).items():
        del device
        rows.update(range(global_batch_size)[index[0]])
    return np.asarray(sorted(rows), dtype=np.int64)


class _Rows:
    """Local index -> row dict. Picklable (used by Grain worker processes when num_workers > 0).

    Local index i is row `batch_rows[i % L]` of global batch `i // L` (L = len(batch_rows));
    global batch s of epoch e holds positions [s*G, (s+1)*G) of that epoch's row order.
    """

    def __init__(
        self,
        store: TokenStore,
        rows: list[tuple[int, ...]],
        steps_per_epoch: int,
        global_batch_size: int,
        batch_rows: np.ndarray,
        shuffle: bool,
        seed: int,
        max_length: int,
        pad_id: int,
    ):
        self.store = store
        self.rows = rows
        self.steps_per_epoch = steps_per_epoch
        self.global_batch_size = global_batch_size
        self.batch_rows = np.asarray(batch_rows, dtype=np.int64)
        self.shuffle = shuffle
        self.seed = seed
        self.max_length = max_length
        self.pad_id = pad_id
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """Row order of `epoch` (a fresh permutation per epoch; cached for the current one)."""
        cached = self._cached
        if cached is not None and cached[0] == epoch:
            return cached[1]
        n = len(self.rows)
        if self.shuffle:
            order = np.random.default_rng([self.seed, _EPOCH, epoch]).permutation(n)
        else:
            order = np.arange(n)
        self._cached = (epoch, order)
        return order

    def __call__(self, index: int, _element: Any) -> dict[str, np.ndarray]:
        step, j = divmod(int(index), len(self.batch_rows))
        epoch, s = divmod(step, self.steps_per_epoch)
        pos = s * self.global_batch_size + int(self.batch_rows[j])
        order = self.order(epoch)
        examples = self.rows[int(order[pos])] if pos < len(order) else ()  # () = padding row (eval)
        return materialize(self.store, examples, self.max_length, self.pad_id)


@dataclasses.dataclass
class Pipeline:
    """Iterate for this process's rows of each global batch (see module docstring)."""

    steps_per_epoch: int
    report: DataReport
    global_batch_size: int
    local_batch_size: int
    batch_rows: np.ndarray  # which rows of every global batch this process materialises
    num_epochs: int | None
    max_length: int
    pad_id: int
    dataset: Any  # grain.MapDataset of local batches (index = global step)
    read_options: grain.ReadOptions
    num_workers: int
    store: TokenStore
    rows: list[tuple[int, ...]]

    def iterator(self, start_step: int = 0) -> grain.DatasetIterator:
        """Batches from global step `start_step` on: the data position is the step, so this is
        how a run resumes, on any number of processes."""
        if self.num_workers == 0:
            it = iter(self.dataset.to_iter_dataset(self.read_options))
            if start_step:  # Grain's own state then stays the global step (`{"next_index": step}`)
                it.set_state({"next_index": start_step})
            return it
        # grain 0.2.x reads an absl flag in its worker code and raises when the program
        # never parsed absl flags (google/grain#1355): declare the defaults as parsed.
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = (self.dataset[start_step:] if start_step else self.dataset).to_iter_dataset(self.read_options)
        return iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers)))

    def __iter__(self) -> grain.DatasetIterator:
        return self.iterator(0)

    @property
    def total_steps(self) -> int | None:
        return None if self.num_epochs is None else self.steps_per_epoch * self.num_epochs


def make_pipeline(
    cfg: DataConfig,
    *,
    split: str = "train",
    global_batch_size: int,
    num_epochs: int | None,
    process_index: int = 0,
    process_count: int = 1,
    batch_rows: Sequence[int] | None = None,
    objective: str = objective_table.DEFAULT,
) -> Pipeline:
    """The pipeline of `split` for one process.

    `batch_rows`: the rows of each global batch this process materialises (ascending; see
    `process_batch_rows`); default: the contiguous block `process_index` of `process_count`.
    No collective is involved: every process computes the same plan on its own.
    """
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size {global_batch_size} must be a positive multiple of {process_count}"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if num_epochs is not None and num_epochs <= 0:
        raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
    if batch_rows is None:
        batch_rows = contiguous_rows(process_index, process_count, global_batch_size)
    batch_rows = np.asarray(batch_rows, dtype=np.int64)
    if not len(batch_rows) or batch_rows.min() < 0 or batch_rows.max() >= global_batch_size:
        raise ValueError(f"batch_rows must be non-empty rows of [0, {global_batch_size})")
    template = build_template(cfg)
    data = build_data(cfg, split, template, objective=objective)
    n_rows = len(data.rows)
    report = data.report
    if split == "train":
        steps = n_rows // global_batch_size
        if steps == 0:
            raise DataError(
                f"split {split!r}: {n_rows} rows is less than one global batch of {global_batch_size}; "
                "lower the batch size or add data"
            )
        shuffle = cfg.shuffle
    else:
        steps = -(-n_rows // global_batch_size)
        shuffle = False
    report.steps_per_epoch = steps
    report.rows_per_epoch = steps * global_batch_size
    report.last_batch = "drop" if split == "train" else "pad"

    tok = template.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_token_ids[0]
    local_bs = len(batch_rows)
    picker = _Rows(
        data.store,
        data.rows,
        steps,
        global_batch_size,
        batch_rows,
        shuffle,
        cfg.seed,
        cfg.max_length,
        pad_id,
    )
    ds = grain.MapDataset.range(steps * local_bs)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds.map_with_index(picker).batch(local_bs, drop_remainder=True)
    read_options = grain.ReadOptions(
        num_threads=1 if cfg.prefetch > 0 else 0, prefetch_buffer_size=cfg.prefetch
    )
    return Pipeline(
        steps_per_epoch=steps,
        report=report,
        global_batch_size=global_batch_size,
        local_batch_size=local_bs,
        batch_rows=batch_rows,
        num_epochs=num_epochs,
        max_length=cfg.max_length,
        pad_id=int(pad_id),
        dataset=ds,
        read_options=read_options,
        num_workers=cfg.num_workers,
        store=data.store,
        rows=data.rows,
    )
