"""A call's decode narrows to its unfinished rows (inference/engine.py `decode_rows`): once
the rows still writing fit a power of two at most half the decoding batch, the next chunks run on
them alone. Every row must write the same tokens, with the same log-probabilities and finish
reasons, as when the whole batch decodes to the end -- greedy and sampled -- and a conversation kept
in a session cache must go on exactly as it would have (its cache rows scattered back whole)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import make_checkpoint

from agentrefine_jax.hf.io import load_hf_model
from agentrefine_jax.inference import engine
from agentrefine_jax.inference.engine import generate
from agentrefine_jax.inference.sessions import SessionCache

# Where each of 8 rows stops (a text-level stop, so the call decodes in chunks of 16): after the first
# chunk 4 rows are unfinished (8 -> 4 rows), after the second 2 (-> 2), after the third 1 (-> 1).
STOP_AT = (2, 3, 5, 9, 17, 30, 40, 64)
NEW = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_hf_model(make_checkpoint(tmp_path_factory.mktemp("hf"), "llama", seed=5), dtype="float32")[1]


@pytest.fixture
def gathers(monkeypatch) -> list[int]:
    """The batch size of every narrowing (`engine.row_programs`' gather, as `decode_rows` calls it)."""
    gather, scatter = engine.row_programs()
    seen: list[int] = []

    def counted(cache, src):
        seen.append(int(src.shape[0]))
        return gather(cache, src)

    monkeypatch.setattr(engine, "row_programs", lambda: (counted, scatter))
    return seen


def _prompts(model, rng) -> list[list[int]]:
    vocab = model.cfg.vocab_size
    return [rng.integers(1, vocab, int(rng.integers(5, 40))).tolist() for _ in STOP_AT]


def _stop(index: int, ids: list[int]) -> bool:
    return len(ids) >= STOP_AT[index]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_narrowed_call_writes_what_the_whole_batch_writes(model, gathers, monkeypatch, temperature) -> None:
    prompts = _prompts(model, np.random.default_rng(0))
    kwargs = dict(max_new_tokens=NEW, stop_token_ids=(), should_stop=_stop, temperature=temperature, seed=7)
    narrowed = generate(model, prompts, **kwargs)
    assert gathers == [4, 2, 1]  # 4 unfinished of 8, then 2, then 1
    monkeypatch.setattr(engine, "_single_device", lambda cache: False)  # the whole batch to the end
    whole = generate(model, prompts, **kwargs)
    assert gathers == [4, 2, 1]
    # A text-level stop is asked between chunks: a row keeps the chunk it stopped in.
    assert [len(g.tokens) for g in narrowed] == [16, 16, 16, 16, 32, 32, 48, 64]
    assert [g.tokens for g in narrowed] == [g.tokens for g in whole]
    assert [g.finish_reason for g in narrowed] == [g.finish_reason for g in whole]
    for a, b in zip(narrowed, whole, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_conversations_go_on_after_a_narrowed_call_as_after_a_whole_one(model, gathers, monkeypatch) -> None:
    """Three turns of 8 conversations in a session cache, each turn's replies stopping at STOP_AT:
    the narrowed session's replies equal those of a session whose calls decode every row, and a
    fresh prefill's (the cache rows scattered back after a narrowed call hold what they should)."""
    rng = np.random.default_rng(1)
    vocab = model.cfg.vocab_size
    keys = [f"c{i}" for i in range(len(STOP_AT))]
    prompts = dict(zip(keys, _prompts(model, rng), strict=True))
    narrowed, whole = SessionCache(model, slots=8), SessionCache(model, slots=8)
    kwargs = dict(max_new_tokens=NEW, stop_token_ids=(), should_stop=_stop)
    for turn in range(3):
        batch = [prompts[k] for k in keys]
        with monkeypatch.context() as m:
            m.setattr(engine, "_single_device", lambda cache: False)
            ref = whole.generate(keys, batch, **kwargs)
            fresh = generate(model, batch, **kwargs)
        before = len(gathers)
        got = narrowed.generate(keys, batch, **kwargs)
        assert gathers[before:] == [4, 2, 1], turn
        assert [g.tokens for g in got] == [g.tokens for g in ref] == [g.tokens for g in fresh], turn
        for k, g in zip(keys, got, strict=True):
            prompts[k] = prompts[k] + g.tokens + rng.integers(1, vocab, int(rng.integers(3, 20))).tolist()
    assert narrowed.stats["resets"] == 0 and narrowed.stats["reused_tokens"] > 0


def test_a_narrowed_call_holds_the_calls_cache_and_one_sub_batch(model, monkeypatch) -> None:
    """At every narrowing the K/V alive are the call's cache alone: the batch narrowed before has been
    written back and let go (held, each narrowing would add its sub-batch: up to 1.75x the cache)."""
    import jax

    gather, scatter = engine.row_programs()
    alive: list[tuple[int, int]] = []  # (K/V bytes alive, the call's cache's K/V bytes) at each gather

    def watched(cache, src):
        kv = [*cache["k"], *cache["v"]] if isinstance(cache["k"], tuple) else [cache["k"], cache["v"]]
        shapes = {a.shape[1:] for a in kv}  # a layer's K or V, any batch size
        live = [a for a in jax.live_arrays() if a.ndim == len(kv[0].shape) and a.shape[1:] in shapes]
        alive.append((sum(a.nbytes for a in live), sum(a.nbytes for a in kv)))
        return gather(cache, src)

    monkeypatch.setattr(engine, "row_programs", lambda: (watched, scatter))
    prompts = _prompts(model, np.random.default_rng(2))
    generate(model, prompts, max_new_tokens=NEW, stop_token_ids=(), should_stop=_stop)
    assert len(alive) == 3 and all(live == full for live, full in alive), alive
