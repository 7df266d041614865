"""KV-cache reuse across the turns of many conversations (agent episodes) decoded together.

An agent's prompt at turn t+1 is its prompt at turn t, its reply and the new observation: with
`engine.generate` every turn prefills the whole history again. `SessionCache` keeps one cache
row per conversation ("slot") between calls and prefills only the tokens after the longest
common prefix with what that row already holds; a history that changed earlier (truncated,
re-rendered) simply shares a shorter prefix, and the rest of the row is masked out.

Layout. The cache has one write index shared by all rows (the model's cache format). Each call
writes one block of columns (two, see below; a width bucketed in steps of 64: one compile per width), every
row's new tokens left-aligned in it (segment 0 elsewhere), and the index moves only past the longest row's new
tokens, so the decode steps, one column each, overwrite the block's padding tail. A row's tokens
therefore sit in increasing but not contiguous columns; every other column of the row has
segment 0, which no real query attends (`attention_mask`: equal segments and causal positions),
and positions are the row's own token positions, so a row computes what it would compute alone.
Columns of tokens that are no longer part of a row (after the common prefix, an evicted
conversation's, filler of rows that sat out a call, decode steps after a row ended) are set to
segment 0 before each call attends.
Each call sizes the cache to the 2^k or 1.5 x 2^k columns it needs (`cache_columns`; one compile per
size): the prefill and every decode step attend over, and copy, all of the cache's columns, so none are
kept beyond the last one written. When a call would need the next size, each row's live
columns are first packed to the front of the row (compaction: a gather, so the cache stays about
as long as its longest conversation instead of growing by every call's block); only if they
still do not fit does it grow; at `max_columns` every row starts over (fresh prefills).

A call whose rows need very different numbers of new tokens (a new conversation's whole prompt
beside others' one-turn tails) would pad every row to the longest: attention and the layers cost
rows x block width. Such a call writes two blocks instead: the short rows' block for the whole
batch, then the long rows' block on just those rows (gathered out of the cache and scattered back,
`_extend` with `rows`), the split chosen by that cost (`_long_rows`).

Episodes of one task start alike (the system prompt and the task's instructions: 99 of ~300 tokens
for demo_world, 326 of ~470 for BabyAI). A new conversation whose prompt shares at least FORK_MIN
tokens with what another row holds copies that row (`gather_rows`, the other columns then masked)
instead of prefilling them; new conversations of one call that share such a prefix and have no row to
copy it from have it written once, on one of their rows, which the others then copy (`_share_plan`).

Slots are assigned per conversation key; a key seen for the first time takes a free slot, or
the least recently used one not in the current call ("continuous batching": a finished
episode's slot goes to the next episode at once).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrefine_jax.inference.engine import (
    PREFILL_BLOCK,
    CancelFn,
    Generation,
    Layers,
    StopFn,
    Stops,
    batch_bucket,
    bucket,
    decode_rows,
    gather_rows,
    head_weight,
    layer_weights,
    row_programs,
    scatter_rows,
    validate_request,
)
from agentrefine_jax.models.llama import Transformer, init_cache


@dataclasses.dataclass
class _Slot:
    key: Hashable | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)  # the row's tokens, in order
    columns: list[int] = dataclasses.field(default_factory=list)  # cache column of each token
    last_used: int = -1


def _extend(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    layers: Layers,
    cache: dict,
    ids: jax.Array,
    pos: jax.Array,
    seg: jax.Array,
    last: jax.Array,
    end: jax.Array,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Write a block of left-aligned tokens at the cache's index; next-token logits of each row's
    column `last[row]`. The index then moves to `end` (past the longest row's tokens), so the
    next writes reuse the block's all-padding tail instead of leaving it dead in every row.

    With `rows` (distinct cache rows) the block runs on those rows only: they are gathered out of
    the cache and their columns written back, the other rows' untouched; logits [len(rows), vocab].
    """
    if rows is not None:
        logits, sub = _extend(graphdef, state, layers, gather_rows(cache, rows), ids, pos, seg, last, end)
        return logits, scatter_rows(cache, sub, rows)  # the index moves to `end` with `sub`'s
    model = nnx.merge(graphdef, state)
    if ids.shape[1] > PREFILL_BLOCK and not model.plan.attention_block_size:
        model.plan = dataclasses.replace(model.plan, attention_block_size=query_block(ids.shape[1]))
    hidden, cache = model.forward(ids, pos, seg, cache, layers=layers)
    hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
    return model.logits(hidden)[:, 0], {**cache, "index": end}


# A block's width is rounded up in steps of BLOCK_STEP (powers of two below it), not engine.bucket's 512:
# a first turn of 517 tokens ran as 1,024 columns per row (2x the prefill), and its cache then took
# 2,048 columns that every decode step of the episode read (~1.7x slower steps than at 1,024, SmolLM2
# at batch 4). Each width is one more compile (seconds); an episode's prefill and decode cost more.
BLOCK_STEP = 64
# The cache's lengths: 2^k or 1.5 x 2^k columns (from MIN_COLUMNS). Every decode step reads every
# column, so a cache at most 1.33x (not 2x) longer than needed; one compile per length reached.
MIN_COLUMNS = 256


def block_width(n: int) -> int:
    """The bucketed width of a block of `n` new tokens per row."""
    return bucket(n, step=BLOCK_STEP)


def cache_columns(need: int) -> int:
    """The cache length for `need` columns: the least 2^k or 3 x 2^(k-1) >= need, >= MIN_COLUMNS."""
    size = MIN_COLUMNS
    while size < need:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def query_block(width: int) -> int:
    """Prefill's attention query block for a block wider than PREFILL_BLOCK: the largest multiple of
    BLOCK_STEP <= PREFILL_BLOCK that divides `width`, so the scores never span the whole block."""
    b = PREFILL_BLOCK
    while width % b:
        b -= BLOCK_STEP
    return b


# A new conversation whose prompt starts with at least this many tokens another row holds (an episode
# of the same task: the system prompt and the task's instructions, 100-330 tokens for demo_world and
# BabyAI) copies that row instead of prefilling them; new conversations with such a prefix in common
# and no row to copy it from have it prefilled once, on one of their rows.
FORK_MIN = 32


@dataclasses.dataclass
class _Share:
    """How one call's rows come by what they hold before their block (`_share_plan`)."""

    kept: list[int]  # per request: tokens its row holds when its block is written
    forks: dict[int, tuple[int, int]]  # request index -> (donor cache row, tokens copied from it)
    seed: tuple[int, int, int] | None  # (request index, from, to): a shared prefix written on its row


def _share_plan(
    held: Sequence[Sequence[int]], rows: Sequence[int], prompts: Sequence[Sequence[int]]
) -> _Share:
    """Which requests copy a prefix from another cache row (`held`: each row's tokens, already cut to
    the common prefix with its own prompt), and which shared prefix is prefilled once first. A row
    that is copied from is never itself replaced in the same call, nor the other way round."""
    kept = [len(held[r]) for r in rows]
    forks: dict[int, tuple[int, int]] = {}
    donors: set[int] = set()
    forked = set()
    lonely = []
    for i, (r, p) in enumerate(zip(rows, prompts, strict=True)):
        if len(p) - kept[i] < 2 * FORK_MIN or r in donors:
            continue
        best, best_n = -1, kept[i] + FORK_MIN - 1
        for d, toks in enumerate(held):
            if d == r or d in forked or len(toks) <= best_n:
                continue
            n = min(_common_prefix(toks, p), len(p) - 1)
            if n > best_n:
                best, best_n = d, n
        if best < 0:
            lonely.append(i)
        else:
            forks[i], kept[i] = (best, best_n), best_n
            donors.add(best)
            forked.add(r)
    lonely = [i for i in lonely if rows[i] not in donors]
    seed = None
    if len(lonely) > 1:
        first = prompts[lonely[0]]
        n = min(min(_common_prefix(first, prompts[i]), len(prompts[i]) - 1) for i in lonely)
        if n - max(kept[i] for i in lonely) >= FORK_MIN:
            seed = (lonely[0], kept[lonely[0]], n)
            kept[lonely[0]] = n
            for i in lonely[1:]:
                forks[i], kept[i] = (rows[lonely[0]], n), n
    return _Share(kept, forks, seed)


def _long_rows(widths: Sequence[int], batch: int) -> list[int]:
    """Indices of `widths` (new tokens per row of a call) to extend in a block of their own, or [].

    Cost model: a block costs (cache rows it runs on) x (its bucketed width) -- the projections, the
    MLP and attention over the cache all scale so. One block: batch x width(max). Split: batch x
    width(longest short row) + pow2(long rows) x width(longest long row). Split only where that
    at least halves the cost (each split shape is one more compile).
    """
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    one = batch * block_width(widths[order[-1]])
    best, best_cost = [], one
    for n_long in range(1, len(order)):
        sub = batch_bucket(n_long)
        if sub >= batch:
            break
        short, long_ = order[:-n_long], order[-n_long:]
        cost = batch * block_width(widths[short[-1]]) + sub * block_width(widths[long_[-1]])
        if 2 * cost <= one and cost < best_cost:
            best, best_cost = long_, cost
    return sorted(best)


def _keep(segment_ids: jax.Array, keep: jax.Array) -> jax.Array:
    """Segment 0 (never attended) for every column where `keep` is False.

    Why the segment ids alone: a program given the whole cache returns a copy of every K and V it
    passes through (jit does not forward undonated inputs), so each call held two caches at once -- 2x
    the cache's bytes per turn (SmolLM2 in float32, 16 episodes at ~12k columns: 9 GB each) -- and
    copied them all."""
    return jnp.where(keep, segment_ids, 0)


def _fit(a: jax.Array, columns: int, axis: int) -> jax.Array:
    """`a`'s first `columns` entries along `axis`, padded with zeros (segment 0: empty) where shorter."""
    if a.shape[axis] >= columns:
        return jax.lax.slice_in_dim(a, 0, columns, axis=axis)
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, columns - a.shape[axis])
    return jnp.pad(a, widths)


def _take(a: jax.Array, src: jax.Array, axis: int) -> jax.Array:
    """Column j of row r (rows on axis 0, columns on `axis`) becomes old column src[r, j]."""
    shape = [1] * a.ndim
    shape[0], shape[axis] = src.shape
    return jnp.take_along_axis(a, src.reshape(shape), axis=axis)


def _each_kv(cache: dict, f: Callable[[jax.Array], jax.Array]) -> dict:
    """`cache` with `f` applied to each layer's K and V ([batch, kv_heads, columns, head_dim]), one
    array at a time; `cache` is consumed (its K and V entries are emptied).

    Why one at a time: one program over the whole cache holds the old and the new cache at once, twice
    the cache's bytes at the peak of every resize and compaction (SmolLM2-135M in float32, 32 episodes
    at ~6k columns: a 9 GB cache, 18 GB at the peak). Per array, each old layer is released as soon as
    its replacement exists (nothing else refers to it), so the peak is the cache plus one layer. A
    stacked cache ([layers, ...] arrays: the TPU layout) has one array per K and V: `f` is vmapped
    over its layers, as one program."""
    out = dict(cache)
    for name in ("k", "v"):
        layers, cache[name], out[name] = out[name], None, None
        if not isinstance(layers, tuple):
            out[name] = jax.vmap(f)(layers)
            continue
        new = list(layers)
        del layers
        for i in range(len(new)):
            new[i] = f(new[i])  # the old array's last reference goes with this assignment
        out[name] = tuple(new)
    return out


def _resize(cache: dict, columns: int) -> dict:
    """The first `columns` columns, padded with empty ones (segment 0) where the cache is shorter;
    `cache` is consumed (`_each_kv`)."""
    fit = _programs()[2]
    return {
        **_each_kv(cache, lambda a: fit(a, columns, 2)),
        "segment_ids": fit(cache["segment_ids"], columns, 1),
        "positions": fit(cache["positions"], columns, 1),
    }


def _compact(cache: dict, src: jax.Array, valid: jax.Array, index: jax.Array) -> dict:
    """Column j of row r becomes old column src[r, j] where `valid`, else empty (segment 0); `cache` is
    consumed (`_each_kv`)."""
    take = _programs()[3]
    return {
        **_each_kv(cache, lambda a: take(a, src, 2)),
        "segment_ids": jnp.where(valid, take(cache["segment_ids"], src, 1), 0),
        "positions": jnp.where(valid, take(cache["positions"], src, 1), 0),
        "index": index,
    }


@functools.cache
def _programs() -> tuple:
    # The cache is donated to the extension (every caller replaces it with the returned one), so
    # the new columns are written in place rather than into a fresh copy of the whole cache.
    return (
        jax.jit(_extend, static_argnums=0, donate_argnums=3),
        jax.jit(_keep),
        jax.jit(_fit, static_argnums=(1, 2)),  # per array (`_each_kv`)
        jax.jit(_take, static_argnums=2),
        jax.jit(gather_rows, donate_argnums=0),
        *row_programs(),  # a gather of rows (the cache kept: they are scattered back), the scatter
    )


class SessionCache:
    """Generation for keyed conversations that keeps each one's KV cache between calls.

    `slots`: conversations held at once (the cache's batch); more requests in one call are
    served `slots` at a time. `max_columns`: cache length at which every row starts over
    (default: 4x the model's context). `stats` counts prefilled tokens (real ones) and resets.
    """

    def __init__(self, model: Transformer, slots: int = 8, *, max_columns: int | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model = model
        self.graphdef, self.state = nnx.split(model)
        self.layers = layer_weights(model)
        self.head = head_weight(model)
        self.slots = [_Slot() for _ in range(slots)]
        self.max_columns = max_columns or 4 * model.cfg.max_position_embeddings
        self.cache: dict | None = None
        self.index = 0  # host copy of cache["index"]
        self.calls = 0
        counters = (
            "prefill_tokens",
            "reused_tokens",
            "resets",
            "compactions",
            "split_calls",
            "forked_rows",
            "narrow_calls",
        )
        self.stats = dict.fromkeys(counters, 0)

    # ------------------------------------------------------------------ API

    def generate(
        self,
        keys: Sequence[Hashable],
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int = 0,
        should_stop: StopFn | None = None,
        cancelled: CancelFn | None = None,
    ) -> list[Generation]:
        """Like `engine.generate`, for the conversations named by `keys` (distinct)."""
        if len(keys) != len(prompts) or len(set(keys)) != len(keys):
            raise ValueError("generate needs one distinct key per prompt")
        validate_request(self.model, prompts, max_new_tokens, temperature, top_p)
        if max_new_tokens == 0:
            return [Generation([], "length") for _ in prompts]
        cfg = self.model.cfg
        stops_ids = tuple(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
        out: list[Generation] = []
        n = len(self.slots)
        for lo in range(0, len(prompts), n):
            part = list(range(lo, min(lo + n, len(prompts))))
            row_to_req: dict[int, int] = {}  # cache row -> index into `prompts` (filled by _call)

            def stop_fn(row: int, ids: list[int], m: dict[int, int] = row_to_req) -> bool:
                return should_stop(m[row], ids)  # type: ignore[misc]

            stops = Stops(stops_ids, stop_fn if should_stop is not None else None, cancelled)
            out += self._call(
                [keys[i] for i in part], [list(prompts[i]) for i in part], part, row_to_req,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stops=stops, seed=seed,
            )  # fmt: skip
        return out

    def forget(self, key: Hashable) -> None:
        """Free the slot of a finished conversation (its columns are masked on the next call)."""
        for slot in self.slots:
            if slot.key == key:
                slot.key, slot.tokens, slot.columns, slot.last_used = None, [], [], -1
        if not any(slot.columns for slot in self.slots):
            self.index = 0  # nothing live: the next call writes from the first column (and is masked)

    # ------------------------------------------------------------------ one batch

    def _assign(self, keys: Sequence[Hashable]) -> list[int]:
        by_key = {s.key: i for i, s in enumerate(self.slots) if s.key is not None}
        taken = {by_key[k] for k in keys if k in by_key}
        rows = []
        for k in keys:
            if k in by_key:
                rows.append(by_key[k])
                continue
            free = [i for i, s in enumerate(self.slots) if i not in taken]
            i = min(free, key=lambda j: (self.slots[j].key is not None, self.slots[j].last_used))
            self.slots[i] = _Slot(key=k)
            taken.add(i)
            rows.append(i)
        return rows

    def _reset(self) -> None:
        for slot in self.slots:
            slot.tokens, slot.columns = [], []
        self.cache, self.index = None, 0
        self.stats["resets"] += 1

    def _call(
        self,
        keys: list[Hashable],
        prompts: list[list[int]],
        req_ids: list[int],
        row_to_req: dict[int, int],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stops: Stops,
        seed: int,
    ) -> list[Generation]:
        self.calls += 1
        rows = self._assign(keys)
        row_to_req.update({r: q for r, q in zip(rows, req_ids, strict=True)})
        b = len(self.slots)
        for _ in range(2):  # at most one reset: a fresh cache always has room
            for r, prompt in zip(rows, prompts, strict=True):
                slot = self.slots[r]
                common = _common_prefix(slot.tokens, prompt)
                common = min(common, len(prompt) - 1)  # feed at least one token for its logits
                del slot.tokens[common:], slot.columns[common:]
            share = _share_plan([self.slots[r].tokens for r in range(b)], rows, prompts)
            widths = [len(p) - share.kept[i] for i, p in enumerate(prompts)]
            long_ = _long_rows(widths, b)
            groups = [[i for i in range(len(rows)) if i not in long_]] + ([long_] if long_ else [])
            blocks = sum(block_width(max(widths[i] for i in g)) for g in groups)
            if share.seed is not None:
                blocks += block_width(share.seed[2] - share.seed[1])
            need = self.index + blocks + bucket(max_new_tokens)
            if self.cache is not None and need > self.cache["segment_ids"].shape[1]:
                self._compact()  # before growing: the dead columns are usually most of the cache
                need = self.index + blocks + bucket(max_new_tokens)
            if need <= self.max_columns:
                break
            self._reset()
        size = cache_columns(need)
        if self.cache is None:
            self.cache = init_cache(self.model.cfg, b, size, per_layer=self.model.plan.cpu_layout)
        elif self.cache["segment_ids"].shape[1] != size:
            # Every live column lies before `index`, so the cache is cut to the bucket this call needs
            # (after a compaction it shrinks): prefill and each decode step attend over (and copy) every
            # column, and a cache twice as long as needed made each decode step up to ~2x slower.
            self.cache = self._consumed(_resize, size)
        # Mask what no row holds any more before anything attends: columns after a common
        # prefix, an evicted conversation's, and filler written by the previous call's decode.
        self._mask_dead(jnp.int32(self.index))
        end = self.index
        prefilled = self.stats["prefill_tokens"]
        decode = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stops=stops, seed=seed
        )
        if share.seed is not None:  # the shared prefix, once, on one row (its logits unused)
            i, lo, hi = share.seed
            end = self._extend_rows([(rows[i], prompts[i][lo:hi])], end, full=False)[1]
        if share.forks:
            self._fork(share.forks, rows, prompts)
        suffixes = [p[len(self.slots[r].tokens) :] for r, p in zip(rows, prompts, strict=True)]
        n = batch_bucket(len(rows))
        if n >= b:
            return self._blocks_and_decode(rows, prompts, suffixes, groups, end, prefilled, decode)
        # Fewer conversations than cache rows (the last episodes of a run, a short call): the blocks and
        # every decode step run on a gathered sub-batch of their rows (plus filler up to a power of two),
        # not on every row of the cache -- each decode step reads every row's K/V, ~46 KB per row and
        # column for SmolLM2 -- and the rows are scattered back after.
        gather, scatter = _programs()[5:7]
        pick = rows + [r for r in range(b) if r not in rows][: n - len(rows)]
        row_to_req.clear()  # text-level stops are asked by the sub-batch's row
        row_to_req.update(dict(enumerate(req_ids)))
        self.stats["narrow_calls"] += 1
        full, slots = self.cache, self.slots
        self.cache, self.slots = gather(full, jnp.asarray(pick, jnp.int32)), [slots[r] for r in pick]
        try:
            out = self._blocks_and_decode(
                list(range(len(rows))), prompts, suffixes, groups, end, prefilled, decode
            )
            self.cache = scatter(full, self.cache, jnp.asarray(pick, jnp.int32))
        except BaseException:
            self.slots = slots
            self._reset()  # the cache's rows are not where the slots say
            raise
        self.slots = slots
        return out

    def _blocks_and_decode(
        self,
        rows: list[int],
        prompts: list[list[int]],
        suffixes: list[list[int]],
        groups: list[list[int]],
        end: int,
        prefilled: int,
        decode: dict,
    ) -> list[Generation]:
        """Each group's block, then the decode steps, on the cache's rows (`rows`: each request's)."""
        logits: jax.Array | None = None
        for g, group in enumerate(groups):
            out, end = self._extend_rows([(rows[i], suffixes[i]) for i in group], end, full=g == 0)
            if g == 0:
                logits = out
            else:
                sub = jnp.asarray([rows[i] for i in group], jnp.int32)
                logits = logits.at[sub].set(out[: len(group)])
                self.stats["split_calls"] += 1
        # What was not prefilled came from a kept cache: the row's own or a copied prefix.
        self.stats["reused_tokens"] += sum(map(len, prompts)) - (self.stats["prefill_tokens"] - prefilled)
        positions = [len(s.tokens) for s in self.slots]
        weights = {"layers": self.layers, "head": self.head}
        gens, self.cache, steps = decode_rows(
            self.graphdef, self.state, self.cache, logits, positions, rows, **weights, **decode
        )
        self.index = end + steps
        for r in rows:  # every sampled token was fed: the row now holds prompt + reply
            tokens = gens[r].tokens
            self.slots[r].tokens += tokens
            self.slots[r].columns += range(end, end + len(tokens))
        return [gens[r] for r in rows]

    def _extend_rows(self, entries: list[tuple[int, list[int]]], start: int, *, full: bool) -> tuple:
        """Write each (cache row, new tokens) of `entries` as one block at column `start`: on every
        cache row (`full`; rows not named are filler) or on the named rows plus distinct filler rows up
        to a power of two (one compile per such size). Returns (logits [rows run, vocab], the end)."""
        extend = _programs()[0]
        b = len(self.slots)
        cache_rows = [r for r, _ in entries]
        if not full:
            filler = [r for r in range(b) if r not in cache_rows]
            cache_rows += filler[: batch_bucket(len(entries)) - len(entries)]
        n = b if full else len(cache_rows)
        width = block_width(max(len(t) for _, t in entries))
        ids = np.zeros((n, width), np.int32)
        pos = np.zeros((n, width), np.int32)
        seg = np.zeros((n, width), np.int32)
        last = np.zeros(n, np.int32)  # filler rows: any column (their logits are unused)
        for at, (r, new) in enumerate(entries):
            slot, k, at = self.slots[r], len(new), r if full else at
            ids[at, :k] = new
            pos[at, :k] = np.arange(len(slot.tokens), len(slot.tokens) + k)
            seg[at, :k] = 1
            last[at] = k - 1
            slot.tokens += new
            slot.columns += range(start, start + k)
            slot.last_used = self.calls
            self.stats["prefill_tokens"] += k
        end = start + max(len(t) for _, t in entries)
        sub = None if full else jnp.asarray(cache_rows, jnp.int32)
        out, self.cache = extend(
            self.graphdef, self.state, self.layers, self.cache, ids, pos, seg, last, jnp.int32(end), sub
        )
        return out, end

    def _fork(self, forks: dict[int, tuple[int, int]], rows: list[int], prompts: list[list[int]]) -> None:
        """Each forked row (index into `rows`: (donor cache row, shared tokens)) becomes a copy of its
        donor's row holding the donor's first tokens; the donor's other columns are masked after."""
        src = np.arange(len(self.slots), dtype=np.int32)
        for i, (d, n) in forks.items():
            r, donor = rows[i], self.slots[d]
            assert donor.tokens[:n] == prompts[i][:n]
            src[r] = d
            slot = self.slots[r]
            slot.tokens, slot.columns = list(donor.tokens[:n]), list(donor.columns[:n])
            self.stats["forked_rows"] += 1
        self.cache = _programs()[4](self.cache, jnp.asarray(src))
        self._mask_dead(self.cache["index"])

    def _mask_dead(self, index: jax.Array) -> None:
        """Mask every column no slot holds (see `_keep`); K and V are left as they are."""
        assert self.cache is not None
        live = jnp.asarray(self._live_columns())
        self.cache = {
            **self.cache,
            "segment_ids": _programs()[1](self.cache["segment_ids"], live),
            "index": index,
        }

    def _consumed(self, f: Callable[..., dict], *args: object) -> dict:
        """`f(cache, *args)` for a function that consumes the cache (`_each_kv`): `self` lets go of it
        first, so each old array is released as its replacement is made; if `f` fails part way, every
        row starts over rather than keep a half-replaced cache."""
        cache, self.cache = self.cache, None
        try:
            return f(cache, *args)
        except BaseException:
            self._reset()
            raise

    def _compact(self) -> None:
        assert self.cache is not None
        src = np.zeros(self.cache["segment_ids"].shape, np.int32)
        valid = np.zeros(src.shape, bool)
        for r, slot in enumerate(self.slots):
            n = len(slot.columns)
            src[r, :n], valid[r, :n] = slot.columns, True
            slot.columns = list(range(n))
        self.index = max(len(slot.columns) for slot in self.slots)
        self.cache = self._consumed(_compact, jnp.asarray(src), jnp.asarray(valid), jnp.int32(self.index))
        self.stats["compactions"] += 1

    def _live_columns(self) -> np.ndarray:
        live = np.zeros(self.cache["segment_ids"].shape, bool)
        for r, slot in enumerate(self.slots):
            live[r, slot.columns] = True
        return live


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
