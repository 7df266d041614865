"""The Grain input pipeline the trainer consumes.

source -> shard by record -> parse/validate -> tokenize+mask -> pack (plan once) ->
per-epoch row shuffle -> materialise rows -> batch -> prefetch.

Tokenisation and the packing plan are done up front: the plan needs every example length,
and `steps_per_epoch` must be known (and equal on every process) before step 0. What
streams through Grain afterwards is cheap: picking a row and copying its tokens.

Final partial batch: the training split DROPS it. Rows are reshuffled every epoch, so a
different handful of rows sits out each epoch (the report says how many). With several
processes every process emits the same number of batches: `min` over processes of its own
full batches. The eval split PADS instead (empty rows: segment 0, mask 0) to the `max` over
processes, so every eval token is scored once.

Resuming: the iterator is a `grain.DatasetIterator`; `get_state()` / `set_state()` (or
`grain.checkpoint.CheckpointSave/CheckpointRestore` inside an orbax CheckpointManager)
restore the exact position, including mid-epoch. See docs/data.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from agentrefine_jax.config import DataConfig
from agentrefine_jax.data.examples import TokenStore, build_examples
from agentrefine_jax.data.packing import materialize, pack_best_fit
from agentrefine_jax.data.report import DataReport
from agentrefine_jax.data.schema import check_loss_on, resolve_field_map
from agentrefine_jax.data.sources import RecordSet
from agentrefine_jax.data.templates import ChatTemplate, get_template
from agentrefine_jax.data.tokenizers import load_tokenizer

SPLITS = ("train", "eval")
BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")


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
    held[np.random.default_rng([cfg.seed, 0xE7A1]).permutation(n_total)[:n_eval]] = True
    return all_idx[held] if split == "eval" else all_idx[~held]


def build_template(cfg: DataConfig) -> ChatTemplate:
    return get_template(cfg.template, load_tokenizer(cfg.tokenizer))


@dataclasses.dataclass
class LocalData:
    store: TokenStore
    rows: list[tuple[int, ...]]
    report: DataReport


def build_local(
    cfg: DataConfig,
    split: str,
    process_index: int,
    process_count: int,
    template: ChatTemplate | None = None,
    records: RecordSet | None = None,
) -> LocalData:
    """Everything one process holds: its shard's examples, its packed rows, and the report."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
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
    field_map = resolve_field_map(cfg.format, cfg.field_map)
    idx = split_indices(len(records), cfg, split, has_eval_files=bool(cfg.eval_files))
    mine = idx[process_index::process_count]
    report = DataReport(
        split=split,
        process_index=process_index,
        process_count=process_count,
        sources=records.describe(),
        records_total=len(records),
        records_in_shard=len(mine),
        packed=cfg.pack,
    )
    store = build_examples(
        records.read(mine.tolist()),
        template,
        loss_on=check_loss_on(cfg.loss_on),
        max_length=cfg.max_length,
        overlength=cfg.overlength,
        drop_refinement=cfg.drop_refinement_data,
        field_map=field_map,
        report=report,
    )
    if report.records_in_shard and report.skipped_total > cfg.max_skip_fraction * report.records_in_shard:
        raise ValueError(
            f"{report.skipped_total} of {report.records_in_shard} records skipped (more than "
            f"data.max_skip_fraction={cfg.max_skip_fraction}); check data.format / data.field_map.\n"
            + report.summary()
        )
    if cfg.pack:
        rows = [tuple(r) for r in pack_best_fit(store.lengths, cfg.max_length)]
    else:
        rows = [(i,) for i in range(len(store))]
    report.rows = len(rows)
    return LocalData(store=store, rows=rows, report=report)


def _agree(local: int, op: str, count_for: Any, process_index: int, process_count: int) -> int:
    """The same number on every process: min (train) or max (eval) of per-process counts.

    Under a real multi-process JAX runtime the counts are all-gathered; when processes are
    simulated in one Python process (tests, offline inspection) each shard is built here.
    """
    if process_count == 1:
        return local
    import jax

    if jax.process_count() == process_count:
        from jax.experimental import multihost_utils

        counts = np.asarray(multihost_utils.process_allgather(np.asarray([local], np.int64))).reshape(-1)
    else:
        counts = np.asarray([local if p == process_index else count_for(p) for p in range(process_count)])
    return int(counts.min() if op == "min" else counts.max())


class _Rows:
    """Index -> row dict. Picklable (used by Grain worker processes when num_workers > 0)."""

    def __init__(
        self,
        store: TokenStore,
        rows: list[tuple[int, ...]],
        rows_per_epoch: int,
        shuffle: bool,
        seed: int,
        process_index: int,
        max_length: int,
        pad_id: int,
    ):
        self.store = store
        self.rows = rows
        self.rows_per_epoch = rows_per_epoch
        self.shuffle = shuffle
        self.seed = seed
        self.process_index = process_index
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
            order = np.random.default_rng([self.seed, self.process_index, epoch]).permutation(n)
        else:
            order = np.arange(n)
        self._cached = (epoch, order)
        return order

    def __call__(self, index: int, _element: Any) -> dict[str, np.ndarray]:
        epoch, j = divmod(int(index), self.rows_per_epoch)
        order = self.order(epoch)
        examples = self.rows[int(order[j])] if j < len(order) else ()  # () = padding row (eval)
        return materialize(self.store, examples, self.max_length, self.pad_id)


@dataclasses.dataclass
class Pipeline:
    """Iterate for this process's slice of each global batch (see module docstring)."""

    steps_per_epoch: int
    report: DataReport
    global_batch_size: int
    local_batch_size: int
    num_epochs: int | None
    max_length: int
    pad_id: int
    dataset: Any  # grain.MapDataset of batches (index = global step)
    read_options: grain.ReadOptions
    num_workers: int
    store: TokenStore
    rows: list[tuple[int, ...]]

    def __iter__(self) -> grain.DatasetIterator:
        ds = self.dataset.to_iter_dataset(self.read_options)
        if self.num_workers > 0:
            # grain 0.2.x reads an absl flag in its worker code and raises when the program
            # never parsed absl flags (google/grain#1355): declare the defaults as parsed.
            from absl import flags

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers))
        return iter(ds)

    @property
    def total_steps(self) -> int | None:
        return None if self.num_epochs is None else self.steps_per_epoch * self.num_epochs

    def epoch_of_step(self, step: int) -> int:
        return step // self.steps_per_epoch


def make_pipeline(
    cfg: DataConfig,
    *,
    split: str = "train",
    global_batch_size: int,
    num_epochs: int | None,
    process_index: int = 0,
    process_count: int = 1,
) -> Pipeline:
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size {global_batch_size} must be a positive multiple of {process_count}"
        )
    if num_epochs is not None and num_epochs <= 0:
        raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
    local_bs = global_batch_size // process_count
    template = build_template(cfg)
    records = RecordSet(cfg.eval_files if (split == "eval" and cfg.eval_files) else cfg.train_files)
    local = build_local(cfg, split, process_index, process_count, template, records)
    n_rows = len(local.rows)

    def rows_of(p: int) -> int:
        return len(build_local(cfg, split, p, process_count, template, records).rows)

    if split == "train":
        rows_all = _agree(n_rows, "min", rows_of, process_index, process_count)
        steps = rows_all // local_bs
        if steps == 0:
            raise ValueError(
                f"split {split!r}: {rows_all} rows per process is less than one local batch of {local_bs} "
                f"(global batch {global_batch_size}); lower the batch size or add data\n"
                + local.report.summary()
            )
        shuffle = cfg.shuffle
    else:
        rows_all = _agree(n_rows, "max", rows_of, process_index, process_count)
        steps = -(-rows_all // local_bs)
        shuffle = False
    if steps == 0:
        raise ValueError(f"split {split!r} has no examples\n" + local.report.summary())
    rows_per_epoch = steps * local_bs
    report = local.report
    report.steps_per_epoch = steps
    report.rows_per_epoch = rows_per_epoch
    report.last_batch = "drop" if split == "train" else "pad"

    tok = template.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_token_ids[0]
    picker = _Rows(
        local.store, local.rows, rows_per_epoch, shuffle, cfg.seed, process_index, cfg.max_length, pad_id
    )
    ds = grain.MapDataset.range(rows_per_epoch)
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
        num_epochs=num_epochs,
        max_length=cfg.max_length,
        pad_id=int(pad_id),
        dataset=ds,
        read_options=read_options,
        num_workers=cfg.num_workers,
        store=local.store,
        rows=local.rows,
    )
