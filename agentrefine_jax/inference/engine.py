"""Batched autoregressive generation with a KV cache.

One jitted prefill consumes the whole left-padded batch and returns the next-token logits;
then a jitted chunk of decode steps (a `lax.while_loop`: sample, feed the token, one
forward step) runs until every row has stopped or the chunk is used up. Control returns to
Python between chunks only so that text-level stop conditions (stop strings) can end rows
early. Sampling exists only in the decode program, so greedy and sampled generation share
one prefill program.

Compiles are bounded by bucketing: the batch is padded to a power of two, the prompt
length and the number of new tokens to a few sizes, and `temperature`/`top_p`/step counts
are traced values. Left padding is expressed with segment id 0 (never attended by real
tokens) and per-row positions that start at 0 at the first real token, so every row
computes exactly what it would compute alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrefine_jax.inference.sampling import row_keys, sample
from agentrefine_jax.models import cpu_layout, params
from agentrefine_jax.models.llama import Transformer, flat_heads, init_cache, map_kv, unflat_heads

DEFAULT_CHUNK = 16
# Long prompts are prefilled in query blocks of this many tokens (exact), so the attention
# scores never exist as one [batch, heads, prompt, cache] array.
PREFILL_BLOCK = 512
_NO_STOP = -1  # pads the stop-id array (never matches a token)
_STOP_SLOTS = 8  # stop-id arrays are padded to a multiple of this: no recompile per stop list

# should_stop(row, generated_ids) -> True to end that row now (e.g. a stop string appeared).
StopFn = Callable[[int, list[int]], bool]
# cancelled() -> True to end every row now (the server's client went away, or it is stopping).
CancelFn = Callable[[], bool]
CANCELLED = "cancelled"  # the finish_reason of rows ended by `cancelled`


@dataclasses.dataclass
class Generation:
    """One row's output. `tokens` includes the stop token that ended the row, if any; `logprobs[i]` is
    the model's log-probability of `tokens[i]` (log-softmax of its raw logits: temperature 1, no top-p,
    whatever the sampling settings were), what a policy-gradient or KL term needs."""

    tokens: list[int]
    finish_reason: str  # "stop" (stop token or should_stop) | "length" | CANCELLED
    logprobs: list[float] = dataclasses.field(default_factory=list)


def bucket(n: int, minimum: int = 16, step: int = 512) -> int:
    """Round up to a power of two (at least `minimum`), then to multiples of `step`."""
    b = minimum
    while b < n and b < step:
        b *= 2
    return b if b >= n else -(-n // step) * step


def batch_bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def validate_request(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    vocab = model.cfg.vocab_size
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; generation needs at least one token to condition on")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab})"
            )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    longest = max(len(p) for p in prompts)
    limit = model.cfg.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's context "
            f"of {limit} tokens"
        )


def left_pad(
    prompts: Sequence[Sequence[int]], length: int, batch: int, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, segment_ids), each [batch, length] int32, prompts right-aligned.

    Rows beyond len(prompts) are filler: one real token so the row is well defined.
    """
    ids = np.full((batch, length), pad_id, np.int32)
    pos = np.zeros((batch, length), np.int32)
    seg = np.zeros((batch, length), np.int32)
    for r in range(batch):
        p = prompts[r] if r < len(prompts) else [pad_id]
        n = len(p)
        ids[r, length - n :] = p
        pos[r, length - n :] = np.arange(n)
        seg[r, length - n :] = 1
    return ids, pos, seg


# Per-layer weights of each loaded model (`layer_weights`), with the ids of the stacked arrays they
# view: a model whose parameters were replaced gets new ones. The views keep those arrays alive, so
# an id cannot be reused while its entry exists.
_LAYER_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

Layers = tuple[dict[str, jax.Array], ...] | None


def layer_weights(model: Transformer) -> Layers:
    """The model's layer weights as one dict of arrays per layer, made once per loaded model, for
    programs that unroll the layers (the CPU layout); None where the stacked arrays serve as they are.

    Sharing memory with the parameters (`cpu_layout.layer_views`), they spare every prefill and
    every decode step the copy XLA:CPU makes of each layer's slice of a stacked weight.
    """
    if not model.plan.cpu_layout:
        return None
    stacked = {name: getattr(model.layers, name)[...] for name in params.layer_names(model.cfg)}
    ids = tuple(id(a) for a in jax.tree.leaves(stacked))
    held = _LAYER_WEIGHTS.get(model)
    if held is None or held[0] != ids:
        held = (ids, cpu_layout.layer_views(stacked, model.cfg.num_layers))
        _LAYER_WEIGHTS[model] = held
    return held[1]


# The transposed tied head of each loaded model (`head_weight`), with a weak reference to the embedding it
# copies: a replaced embedding (an RL trainer's next phase) is freed, not kept alive by its copy, and a
# dead reference never matches a new array (an id could be reused).
_HEAD_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_weight(model: Transformer) -> jax.Array | None:
    """A tied embedding transposed once to [hidden, vocab], for the decode step's output projection;
    None where the stored head serves as it is (an untied `lm_head` is stored [hidden, vocab] already,
    and the TPU layout keeps its own path).

    Why: XLA:CPU's dot of a few rows against a [vocab, hidden] table contracted on its last axis ran
    1.2-1.3x slower than against the same table stored [hidden, vocab] (SmolLM2-135M, batch 8: the
    head is ~1/5 of a decode step; docs/inference.md, "The decode step at batch 8"). It costs one
    copy of the embedding (vocab x hidden, 113 MB for SmolLM2), made once per loaded model and
    re-made if its parameters are replaced (an RL trainer's rollout phases), not a copy of the model.
    """
    if not (model.plan.cpu_layout and model.cfg.tie_embeddings):
        return None
    embed = model.embed[...]
    held = _HEAD_WEIGHTS.get(model)
    if held is None or held[0]() is not embed:
        held = (weakref.ref(embed), jnp.transpose(embed))  # eager: materialised row-major, once
        _HEAD_WEIGHTS[model] = held
    return held[1]


def _prefill(
    graphdef: nnx.GraphDef,
    cache_len: int,
    state: nnx.State,
    layers: Layers,
    ids: jax.Array,
    positions: jax.Array,
    segments: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Fill a fresh cache with the prompts; return next-token logits [B, V] and the cache.

    Sampling lives only in the decode program, so one prefill program serves greedy and
    sampled generation alike.
    """
    model = nnx.merge(graphdef, state)
    if ids.shape[1] > PREFILL_BLOCK and not model.plan.attention_block_size:
        model.plan = dataclasses.replace(model.plan, attention_block_size=PREFILL_BLOCK)
    cache = init_cache(model.cfg, ids.shape[0], cache_len, per_layer=model.plan.cpu_layout)
    hidden, cache = model.forward(ids, positions, segments, cache, layers=layers)
    # Left padding puts every row's last real token in the last column.
    return model.logits(hidden[:, -1:])[:, 0], cache


def _decode_chunk(
    graphdef: nnx.GraphDef,
    chunk: int,
    greedy: bool,
    state: nnx.State,
    layers: Layers,
    head: jax.Array | None,
    cache: dict[str, jax.Array],
    logits: jax.Array,
    pos: jax.Array,
    done: jax.Array,
    row_ids: jax.Array,
    step0: jax.Array,
    n_left: jax.Array,
    base_key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    stop_ids: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Up to min(chunk, n_left) steps of: sample from `logits`, feed the token, get new logits.

    Stops early once every row is done. Returns (steps taken, cache, next logits, next
    positions, done, tokens [B, chunk] of which the first `steps` columns are valid, and their
    log-probabilities [B, chunk] float32 under the raw logits). The log-probabilities are read
    off the logits the token was sampled from and never feed back, so the tokens are the same.
    `row_ids`: each row's number in the call's batch, which seeds its sampling key, so a row
    draws the same tokens when the batch has been narrowed to fewer rows (`decode_rows`).
    """
    model = nnx.merge(graphdef, state)
    b = logits.shape[0]
    rows = jnp.arange(b)
    seg = jnp.ones((b, 1), jnp.int32)
    limit = jnp.minimum(chunk, n_left)

    def cond(c: tuple) -> jax.Array:
        i, _, _, _, done, _, _ = c
        return (i < limit) & ~jnp.all(done)

    def body(c: tuple) -> tuple:
        i, cache, logits, pos, done, out, lps = c
        tok = sample(logits, row_keys(base_key, row_ids, step0 + i), temperature, top_p, greedy=greedy)
        tok = jnp.where(done, 0, tok)  # finished rows emit filler the host ignores
        out = out.at[:, i].set(tok)
        lps = lps.at[:, i].set(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[rows, tok])
        done = done | jnp.isin(tok, stop_ids)
        hidden, cache = model.forward(tok[:, None], pos[:, None], seg, cache, layers=layers)
        return i + 1, cache, model.logits(hidden, head)[:, 0], pos + 1, done, out, lps

    # CPU: a per-layer cache (`init_cache(per_layer=True)`), so a step writes its column in place
    # rather than copying every layer's cache through the layer scan (~1/3 of a tiny model's step at
    # 2k columns); carried flat ([B*KVH, T, D], a free reshape), the form attention reads
    # (`flat_heads` says why). Same layer math, unrolled.
    layered = isinstance(cache["k"], tuple)
    init = (
        jnp.int32(0),
        flat_heads(cache) if layered else cache,
        logits,
        pos,
        done,
        jnp.zeros((b, chunk), jnp.int32),
        jnp.zeros((b, chunk), jnp.float32),
    )
    steps, cache, logits, pos, done, out, lps = jax.lax.while_loop(cond, body, init)
    return steps, unflat_heads(cache, b) if layered else cache, logits, pos, done, out, lps


@functools.cache
def _compiled() -> tuple[Callable, Callable]:
    # Donating the cache lets XLA update it in place rather than allocate (and, on CPU, page in) a
    # new one per call; every caller replaces its cache with the returned one.
    prefill = jax.jit(_prefill, static_argnums=(0, 1))
    decode = jax.jit(_decode_chunk, static_argnums=(0, 1, 2), donate_argnums=(6,))
    return prefill, decode


def gather_rows(cache: dict, src: jax.Array) -> dict:
    """Cache row r becomes a copy of row src[r] (K, V, segments and positions)."""
    return {
        **map_kv(cache, lambda a: a[src]),
        "segment_ids": cache["segment_ids"][src],
        "positions": cache["positions"][src],
        "index": cache["index"],
    }


def scatter_rows(cache: dict, sub: dict, rows: jax.Array) -> dict:
    """`cache` with its rows `rows` replaced by `sub`'s (a `gather_rows` sub-batch, written on since)."""

    def put(a: jax.Array | tuple, b: jax.Array | tuple) -> jax.Array | tuple:
        if isinstance(a, tuple):  # one array per layer
            return tuple(x.at[rows].set(y) for x, y in zip(a, b, strict=True))
        return jax.vmap(lambda x, y: x.at[rows].set(y))(a, b)  # stacked [layers, ...]

    return {
        "k": put(cache["k"], sub["k"]),
        "v": put(cache["v"], sub["v"]),
        "segment_ids": cache["segment_ids"].at[rows].set(sub["segment_ids"]),
        "positions": cache["positions"].at[rows].set(sub["positions"]),
        "index": sub["index"],
    }


@functools.cache
def row_programs() -> tuple[Callable, Callable]:
    """(gather, scatter): a sub-batch of the cache's rows (the cache kept, to scatter them back into),
    and the scatter, which donates the cache it writes into."""
    return jax.jit(gather_rows), jax.jit(scatter_rows, donate_argnums=0)


def _single_device(cache: dict) -> bool:
    return len(cache["segment_ids"].sharding.device_set) == 1


@dataclasses.dataclass
class Stops:
    """When a row ends: a stop token id (kept as the row's last token) or `should_stop`; every
    row ends at once when `cancelled()` says so (checked before each decode chunk)."""

    ids: tuple[int, ...]
    should_stop: StopFn | None = None
    cancelled: CancelFn | None = None

    @functools.cached_property
    def array(self) -> jax.Array:
        slots = max(1, -(-len(self.ids) // _STOP_SLOTS)) * _STOP_SLOTS
        return jnp.asarray(self.ids + (_NO_STOP,) * (slots - len(self.ids)), jnp.int32)


def decode_rows(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: dict[str, jax.Array],
    logits: jax.Array,
    positions: Sequence[int],
    live: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stops: Stops,
    seed: int,
    chunk_size: int = DEFAULT_CHUNK,
    layers: Layers = None,
    head: jax.Array | None = None,
) -> tuple[dict[int, Generation], dict[str, jax.Array], int]:
    """Sample up to `max_new_tokens` tokens for the cache rows in `live` from their next-token
    `logits`; every row's next token goes at `positions[row]`. Rows not in `live` run as filler
    (their tokens are never read). Returns ({row: Generation}, cache, decode steps taken).

    Every sampled token is fed to the model, so afterwards a live row's cache holds its prompt
    followed by all of its generated tokens (filler rows and steps after a row ended hold
    tokens in segment 1 that a cache kept across calls must mask: see `inference/sessions.py`).
    `layers`: the model's `layer_weights` (None: the decode loop slices the stacked weights). The
    cache is donated: use the returned one.

    Narrowing (when the cache is on one device): between chunks, once the unfinished rows fit
    a power of two at most half the rows decoding, the next chunks run on those rows alone (gathered
    with filler up to that power of two; scattered back at the end). A call decodes until its longest
    reply ends, and each step reads every decoding row's K/V (~46 KB per row and column for
    SmolLM2): when one row of 32 writes 128 tokens and the rest stop after ~40, the last ~90 steps
    ran all 32 rows. Each row computes the same tokens either way (its own logits; sampling keys
    follow its row number in the call, `row_ids`).
    """
    batch = logits.shape[0]
    host_done = np.ones(batch, bool)
    host_done[list(live)] = False
    stop_set = set(stops.ids)
    out: dict[int, list[int]] = {r: [] for r in live}
    logp: dict[int, list[float]] = {r: [] for r in live}
    reason = dict.fromkeys(live, "length")
    # Stop tokens end rows inside the loop; only a text-level check or a cancellation needs the host
    # between chunks, so without one a call is a single chunk (one host round trip, not ~7).
    chunk = (
        bucket(max_new_tokens)
        if stops.should_stop is None and stops.cancelled is None
        else max(1, min(chunk_size, bucket(max_new_tokens)))
    )
    _, decode = _compiled()
    base_key, temp, tp = jax.random.key(seed), jnp.float32(temperature), jnp.float32(top_p)
    cur_pos = jnp.asarray(positions, jnp.int32)
    narrow = _single_device(cache)
    decoding = np.arange(batch)  # the call's row held by each row of the decoding batch
    row_ids = jnp.asarray(decoding, jnp.int32)  # the same, on the device
    at = {r: r for r in range(batch)}  # the call's row -> its row in the decoding batch
    full: dict[str, jax.Array] | None = None  # the call's cache while a narrowed batch decodes
    steps = 0
    while steps < max_new_tokens and not host_done.all():
        if stops.cancelled is not None and stops.cancelled():
            for r in live:
                if not host_done[r]:
                    host_done[r], reason[r] = True, CANCELLED
            break
        unfinished = [int(r) for r in decoding if not host_done[r]]
        if narrow and batch_bucket(len(unfinished)) < len(decoding):
            gather, scatter = row_programs()
            if full is None:
                full, cache = cache, None
            else:  # a batch narrowed before goes back first, and is let go before the next gather
                full, cache = scatter(full, cache, row_ids), None
            decoding = _narrowed(decoding, unfinished)
            local = jnp.asarray([at[int(r)] for r in decoding], jnp.int32)
            logits, cur_pos = logits[local], cur_pos[local]
            row_ids, at = jnp.asarray(decoding, jnp.int32), {int(r): i for i, r in enumerate(decoding)}
            cache = gather(full, row_ids)
        n, cache, logits, cur_pos, _, new, new_lp = decode(
            graphdef, chunk, temperature == 0.0, state, layers, head, cache, logits, cur_pos,
            jnp.asarray(host_done[decoding]), row_ids, jnp.int32(steps),
            jnp.int32(max_new_tokens - steps), base_key, temp, tp, stops.array,
        )  # fmt: skip
        n, new, new_lp = int(n), np.asarray(new), np.asarray(new_lp)
        for r in live:  # append this chunk's tokens; a stop token ends the row (and is kept)
            if host_done[r]:
                continue
            for t, lp in zip(new[at[r], :n].tolist(), new_lp[at[r], :n].tolist(), strict=True):
                out[r].append(t)
                logp[r].append(lp)
                if t in stop_set:
                    host_done[r], reason[r] = True, "stop"
                    break
            if not host_done[r] and stops.should_stop is not None and stops.should_stop(r, out[r]):
                host_done[r], reason[r] = True, "stop"
        steps += n
    if full is not None:
        cache = row_programs()[1](full, cache, row_ids)
    return {r: Generation(out[r], reason[r], logp[r]) for r in live}, cache, steps


def _narrowed(decoding: np.ndarray, unfinished: list[int]) -> np.ndarray:
    """The call's rows of the decoding batch cut to `unfinished` plus finished rows as filler, up to a
    power of two."""
    n, keep = batch_bucket(len(unfinished)), set(unfinished)
    filler = [int(r) for r in decoding if int(r) not in keep][: n - len(unfinished)]
    return np.asarray(unfinished + filler)


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    should_stop: StopFn | None = None,
    cancelled: CancelFn | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    timings: dict[str, float] | None = None,
) -> list[Generation]:
    """Generate continuations of token-id prompts (batched, left-padded, KV-cached).

    stop_token_ids: ids that end a row (kept as its last token); None = the model config's
      eos ids, () = never stop early.
    should_stop: checked on each live row between decode chunks (text-level stops).
    cancelled: checked before each decode chunk; once True, every unfinished row ends with
      finish_reason CANCELLED (what it generated so far is kept).
    timings: if given, filled with prefill_s / decode_s wall time, decode_steps (tokens
      sampled per row, the first one included) and prefill_tokens (real prompt tokens).
    """
    validate_request(model, prompts, max_new_tokens, temperature, top_p)
    n_rows = len(prompts)
    if max_new_tokens == 0:
        return [Generation([], "length") for _ in range(n_rows)]
    cfg = model.cfg
    stops = Stops(
        tuple(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids), should_stop, cancelled
    )
    batch = batch_bucket(n_rows)
    plen = bucket(max(len(p) for p in prompts))
    new_len = bucket(max_new_tokens)
    ids, pos, seg = left_pad(prompts, plen, batch, cfg.pad_token_id or 0)
    graphdef, state = nnx.split(model)
    layers = layer_weights(model)
    prefill, _ = _compiled()

    t0 = time.perf_counter()
    logits, cache = prefill(graphdef, plen + new_len, state, layers, ids, pos, seg)
    logits.block_until_ready()
    t1 = time.perf_counter()
    positions = [len(p) for p in prompts] + [1] * (batch - n_rows)
    gens, _, steps = decode_rows(
        graphdef, state, cache, logits, positions, range(n_rows), max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, stops=stops, seed=seed, chunk_size=chunk_size, layers=layers,
        head=head_weight(model),
    )  # fmt: skip
    if timings is not None:
        timings.update(
            prefill_s=t1 - t0,
            decode_s=time.perf_counter() - t1,
            decode_steps=steps,
            prefill_tokens=sum(len(p) for p in prompts),
        )
    return [gens[r] for r in range(n_rows)]


def generate_ids(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Generated ids per prompt (the stop token that ended a row included). See `generate`."""
    gens = generate(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=stop_token_ids,
        seed=seed,
    )
    return [g.tokens for g in gens]
