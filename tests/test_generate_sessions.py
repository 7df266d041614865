"""KV-cache reuse across turns (inference/sessions.py): greedy replies equal fresh prefills of the
same prompts, turn after turn, while only the tokens after the common prefix are prefilled; a
history rewritten earlier (truncation), eviction by a new conversation, more conversations
than slots, fewer than slots (a gathered sub-batch) and shared prefixes all keep the equality."""

from __future__ import annotations

import numpy as np
import pytest
from hf_fixtures import make_checkpoint

from agentrefine_jax.hf.io import load_hf_model
from agentrefine_jax.inference.engine import generate
from agentrefine_jax.inference.sessions import SessionCache

NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_hf_model(make_checkpoint(tmp_path_factory.mktemp("hf"), "llama", seed=3), dtype="float32")[1]


def _turns(model, sessions: SessionCache, keys: list[str], prompts: dict[str, list[int]], rng, turns: int):
    """Play `turns` agent turns for `keys`: reply, then append reply + a fresh 'observation'."""
    vocab = model.cfg.vocab_size
    fresh_tokens = 0
    for _ in range(turns):
        batch = [prompts[k] for k in keys]
        fresh = generate(model, batch, max_new_tokens=NEW, stop_token_ids=())
        reused = sessions.generate(keys, batch, max_new_tokens=NEW, stop_token_ids=())
        assert [g.tokens for g in reused] == [g.tokens for g in fresh]
        fresh_tokens += sum(len(p) for p in batch)
        for k, g in zip(keys, fresh, strict=True):
            prompts[k] = prompts[k] + g.tokens + rng.integers(1, vocab, int(rng.integers(3, 20))).tolist()
    return fresh_tokens


def test_greedy_replies_equal_fresh_prefills_and_prefill_only_new_tokens(model) -> None:
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    sessions = SessionCache(model, slots=4)
    prompts = {k: rng.integers(1, vocab, int(rng.integers(20, 60))).tolist() for k in "abc"}
    fresh_tokens = _turns(model, sessions, list("abc"), prompts, rng, turns=3)
    # Turn 1 prefills the prompts; later turns only the reply tail and the observation.
    assert sessions.stats["prefill_tokens"] < fresh_tokens / 2
    assert sessions.stats["reused_tokens"] > 0 and sessions.stats["resets"] == 0

    # A history rewritten near its start (AgentBoard-style truncation) shares a short prefix only.
    prompts["a"] = prompts["a"][:5] + prompts["a"][25:]
    before = sessions.stats["prefill_tokens"]
    _turns(model, sessions, ["a", "b"], prompts, rng, turns=1)
    assert sessions.stats["prefill_tokens"] - before >= len(prompts["a"]) - 5 - 40  # 'a' re-prefilled
    assert sessions.stats["narrow_calls"] == 1  # 2 of 4 rows: run on those 2, c's row left as it was

    # More conversations than slots: served 4 at a time, new keys evict the least recently used.
    prompts.update({k: rng.integers(1, vocab, int(rng.integers(10, 30))).tolist() for k in "defgh"})
    _turns(model, sessions, list("cdefgh"), prompts, rng, turns=2)


def test_a_long_new_prompt_beside_short_tails_is_extended_on_its_own_rows(model) -> None:
    """Continuous batching: a new episode's whole prompt joins rows that add one turn each. The call
    writes the short tails for the batch and the long prompt on a gathered sub-batch; replies still
    equal fresh prefills, for the joining row, the continuing ones and every later turn."""
    from agentrefine_jax.inference.sessions import _long_rows

    assert _long_rows([20, 25, 30, 300], 4) == [3]  # 4 x 32 + 1 x 320 <= half of 4 x 320
    assert _long_rows([20, 25, 300, 310], 8) == [2, 3]  # 8 x 32 + 2 x 320 vs 8 x 320
    assert _long_rows([200, 250, 300, 310], 4) == []  # not worth a second block
    assert _long_rows([20, 300, 300, 310], 4) == []  # 3 long rows pad to the whole batch
    rng = np.random.default_rng(2)
    vocab = model.cfg.vocab_size
    sessions = SessionCache(model, slots=4)
    prompts = {k: rng.integers(1, vocab, int(rng.integers(20, 40))).tolist() for k in "abc"}
    _turns(model, sessions, list("abc"), prompts, rng, turns=2)
    assert sessions.stats["split_calls"] == 0
    prompts["d"] = rng.integers(1, vocab, 300).tolist()
    _turns(model, sessions, list("abcd"), prompts, rng, turns=1)
    assert sessions.stats["split_calls"] == 1
    prompts["e"] = rng.integers(1, vocab, 280).tolist()  # evicts the least recently used slot
    _turns(model, sessions, list("abde"), prompts, rng, turns=1)
    assert sessions.stats["split_calls"] == 2
    _turns(model, sessions, list("abde"), prompts, rng, turns=2)


def test_episodes_of_one_task_prefill_their_common_prefix_once(model) -> None:
    """New conversations that start alike (one task's system prompt and instructions) prefill the shared
    prefix once on one row and copy it to the others; a conversation joining later copies it from a row
    that holds it. Replies still equal fresh prefills, turn after turn."""
    rng = np.random.default_rng(4)
    vocab = model.cfg.vocab_size
    shared = rng.integers(1, vocab, 80).tolist()
    prompts = {k: shared + rng.integers(1, vocab, int(rng.integers(5, 30))).tolist() for k in "abcd"}
    sessions = SessionCache(model, slots=4)
    tails = sum(len(prompts[k]) - len(shared) for k in "abc")
    sent = _turns(model, sessions, list("abc"), prompts, rng, turns=1)
    assert sessions.stats["forked_rows"] == 2
    assert sessions.stats["prefill_tokens"] == len(shared) + tails  # the shared 80 tokens once
    sent += _turns(model, sessions, list("abc"), prompts, rng, turns=1)
    assert sessions.stats["forked_rows"] == 2  # continuing rows keep their own cache
    before = sessions.stats["prefill_tokens"]
    sent += _turns(model, sessions, list("abcd"), prompts, rng, turns=2)
    assert sessions.stats["forked_rows"] == 3  # d copies a, b or c's first 80 tokens
    assert sessions.stats["prefill_tokens"] - before < sum(len(prompts[k]) for k in "abcd") / 2
    assert sessions.stats["prefill_tokens"] + sessions.stats["reused_tokens"] == sent  # each token once


def test_cache_compacts_then_restarts_at_its_limit(model) -> None:
    rng = np.random.default_rng(1)
    vocab = model.cfg.vocab_size
    sessions = SessionCache(model, slots=2, max_columns=256)
    prompts = {k: rng.integers(1, vocab, 100).tolist() for k in "xy"}
    _turns(model, sessions, ["x", "y"], prompts, rng, turns=2)
    # A rewritten history leaves x's old columns dead; once the columns run out they are packed away
    # instead of a restart.
    prompts["x"] = prompts["x"][:100] + prompts["x"][120:]
    for _ in range(6):
        _turns(model, sessions, ["x", "y"], prompts, rng, turns=1)
        if sessions.stats["compactions"]:
            break
    assert sessions.stats["compactions"] >= 1 and sessions.stats["resets"] == 0
    assert sessions.cache["segment_ids"].shape[1] == 256
    _turns(model, sessions, ["x", "y"], prompts, rng, turns=4)  # the rows alone outgrow the limit
    assert sessions.stats["resets"] >= 1


def test_bad_keys_are_refused(model) -> None:
    sessions = SessionCache(model, slots=2)
    with pytest.raises(ValueError, match="distinct key"):
        sessions.generate(["a", "a"], [[1, 2], [3, 4]], max_new_tokens=2)


def _live_bytes() -> int:
    import jax

    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_growing_and_compacting_hold_one_cache_not_two(model, monkeypatch) -> None:
    """A resize or compaction replaces the cache one layer's K or V at a time and lets go of each old
    array as its replacement exists: at no point between arrays are the old and the new cache both
    alive (one program over the whole cache held both: 2x the cache's bytes at every growth)."""
    from agentrefine_jax.inference import sessions as sessions_mod

    assert model.plan.cpu_layout  # a per-layer cache: K and V are tuples of one array per layer
    fit, take = sessions_mod._programs()[2:4]
    seen: dict[str, list[int]] = {"resize": [], "compact": []}
    entry: dict[str, int] = {}
    calls = {"resize": 0, "compact": 0}
    grew = {"resize": 0, "compact": 0}

    def watched(name: str, program):
        def call(*args):
            seen[name].append(_live_bytes() - entry[name])
            return program(*args)

        return call

    def entered(name: str, original):
        def call(cache, *args):
            calls[name] += 1
            entry[name] = _live_bytes()
            kv = sum(a.nbytes for a in (*cache["k"], *cache["v"]))
            out = original(cache, *args)
            grown = sum(a.nbytes for a in (*out["k"], *out["v"])) - kv
            layer = max(a.nbytes for a in out["k"])
            # Before each array's program: at most the growth so far above the entry (never a second cache).
            assert max(seen[name]) <= max(grown, 0) + layer // 4, (name, seen[name], kv, grown)
            seen[name].clear()
            grew[name] += grown > 0
            return out

        return call

    programs = list(sessions_mod._programs())
    programs[2], programs[3] = watched("resize", fit), watched("compact", take)
    monkeypatch.setattr(sessions_mod, "_programs", lambda: tuple(programs))
    monkeypatch.setattr(sessions_mod, "_resize", entered("resize", sessions_mod._resize))
    monkeypatch.setattr(sessions_mod, "_compact", entered("compact", sessions_mod._compact))

    rng = np.random.default_rng(1)
    vocab = model.cfg.vocab_size
    sessions = SessionCache(model, slots=2, max_columns=512)
    prompts = {k: rng.integers(1, vocab, 100).tolist() for k in "xy"}
    _turns(model, sessions, ["x", "y"], prompts, rng, turns=2)
    prompts["x"] = prompts["x"][:100] + prompts["x"][120:]  # dead columns, for a compaction
    for _ in range(8):
        _turns(model, sessions, ["x", "y"], prompts, rng, turns=1)
        if sessions.stats["compactions"] and grew["resize"]:
            break
    assert grew["resize"] >= 1 and calls["compact"] >= 1, (calls, grew, sessions.stats)
    assert sessions.stats["resets"] == 0


def test_masking_dead_columns_never_copies_k_or_v(model, monkeypatch) -> None:
    """Each call masks the columns no conversation holds; the program that does it is given the
    segment ids only. Given the whole cache it returned a copy of every K and V (jit does not forward
    an undonated input): two caches alive at once on every turn, and the episodes a host can hold in
    flight halved (a 24 GB host was OOM-killed at 16 SmolLM2 episodes)."""
    import jax

    from agentrefine_jax.inference import sessions as sessions_mod

    programs = list(sessions_mod._programs())
    given: list[int] = []

    def mask(*args):
        given.append(sum(a.nbytes for a in jax.tree.leaves(args)))
        return programs[1](*args)

    monkeypatch.setattr(sessions_mod, "_programs", lambda: (*programs[:1], mask, *programs[2:]))
    rng = np.random.default_rng(4)
    vocab = model.cfg.vocab_size
    sessions = SessionCache(model, slots=4)
    shared = rng.integers(1, vocab, 80).tolist()  # shared prefixes: forked rows, masked after the fork
    prompts = {k: shared + rng.integers(1, vocab, int(rng.integers(5, 30))).tolist() for k in "abcd"}
    _turns(model, sessions, list("abcd"), prompts, rng, turns=3)
    assert sessions.stats["forked_rows"] > 0 and len(given) > 3
    columns = sessions.cache["segment_ids"]
    kv = sum(a.nbytes for a in (*sessions.cache["k"], *sessions.cache["v"]))
    assert max(given) <= 2 * columns.size * 4 < kv / 10, (given, kv)  # ids + a bool mask, never K/V
