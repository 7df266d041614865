"""Sampling: the blocked greedy argmax picks jnp.argmax's index; reproducible per seed,
top_p -> 0 is greedy, samples stay in the nucleus and follow the renormalised distribution;
compiles are reused across prompt lengths; bad input is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import make_checkpoint
from test_generate_hf_parity import random_prompts

from agentrefine_jax.hf.io import load_hf_model
from agentrefine_jax.inference import engine
from agentrefine_jax.inference.engine import generate_ids, left_pad
from agentrefine_jax.inference.sampling import argmax, row_keys, sample

NEW = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The Llama oracle of test_generate_hf_parity (same config and prompt shapes: shared compiles)."""
    return load_hf_model(make_checkpoint(tmp_path_factory.mktemp("hf"), "llama", seed=3), dtype="float32")[1]


PROMPTS = random_prompts(512, [5, 41, 19], [2, 3], seed=7)


def _sampled(model, seed, top_p=0.9, temperature=1.0):
    return generate_ids(
        model, PROMPTS, max_new_tokens=NEW, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=()
    )


def test_sampling_is_reproducible_per_seed(model):
    a, b, c = _sampled(model, 1), _sampled(model, 1), _sampled(model, 2)
    assert a == b
    assert a != c
    assert a[0] != a[1]  # rows draw from different keys
    # A row's samples depend on its seed and index, not on what else shares the batch.
    other = generate_ids(
        model,
        [PROMPTS[0], [300, 301], PROMPTS[2]],
        max_new_tokens=NEW,
        temperature=1.0,
        top_p=0.9,
        seed=1,
        stop_token_ids=(),
    )
    assert other[0] == a[0] and other[1] != a[1] and other[2] == a[2]


def test_tiny_top_p_equals_greedy(model):
    greedy = generate_ids(model, PROMPTS, max_new_tokens=NEW, stop_token_ids=())
    assert _sampled(model, 3, top_p=1e-6) == greedy
    assert _sampled(model, 3, top_p=1.0) != greedy  # and sampling does sample


def test_samples_stay_in_the_nucleus(model):
    """Re-score every sampled sequence with a cache-free forward pass: each sampled token must be
    in the top-p set of the temperature-scaled distribution at its step."""
    top_p, temperature = 0.6, 0.8
    outs = _sampled(model, 4, top_p=top_p, temperature=temperature)
    graphdef, state = nnx.split(model)
    full_forward = jax.jit(lambda s, *batch: nnx.merge(graphdef, s)(*batch))
    seqs = [p + g for p, g in zip(PROMPTS, outs, strict=True)]
    width = max(map(len, seqs))
    ids, pos, seg = left_pad(seqs, width, len(seqs))  # one left-padded batch, no cache
    all_logits = np.asarray(full_forward(state, ids, pos, seg)) / temperature
    pruned = 0
    for r, gen in enumerate(outs):
        logits = all_logits[r, width - len(gen) - 1 : -1]
        for step, tok in enumerate(gen):
            probs = np.exp(logits[step] - logits[step].max())
            probs /= probs.sum()
            mass_above = probs[probs > probs[tok]].sum()
            assert mass_above < top_p + 1e-5, (step, tok, mass_above)
            desc = np.sort(probs)[::-1]
            pruned += int(((np.cumsum(desc) - desc) < top_p).sum() < len(probs))
    assert pruned > 0  # the nucleus was smaller than the vocabulary, so the check had teeth


@pytest.mark.parametrize("vocab", [7, 512, 1000, 128256, 1187 * 7])  # no blocks, divisors, padding
def test_blocked_argmax_is_jnp_argmax(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, (6, vocab)).astype(np.float32)  # many ties: the first maximum must win
    x[1, rng.integers(vocab, size=2)] = np.nan  # NaN ranks above everything (first one)
    x[2] = -np.inf
    x[3, -1] = 100.0  # the maximum in the last (possibly padded) block
    x[4, 0] = 100.0
    x[5] = rng.standard_normal(vocab)
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32


def test_sample_follows_the_renormalised_nucleus_distribution():
    logits = jnp.asarray([2.0, 1.5, 1.0, 0.2, -1.0, -3.0, 0.9, 1.4])
    temperature, top_p, n = 0.7, 0.8, 20000
    keys = row_keys(jax.random.key(0), jnp.arange(n), jnp.int32(0))
    draws = jax.jit(lambda k: sample(jnp.broadcast_to(logits, (n, 8)), k, temperature, top_p, greedy=False))(
        keys
    )
    counts = np.bincount(np.asarray(draws), minlength=8)

    p = np.asarray(jax.nn.softmax(logits / temperature))
    order = np.argsort(-p)
    keep = np.zeros(8, bool)
    keep[order[(np.cumsum(p[order]) - p[order]) < top_p]] = True
    assert 1 < keep.sum() < 8
    expected = np.where(keep, p, 0) / p[keep].sum()
    assert counts[~keep].sum() == 0
    sigma = np.sqrt(n * expected * (1 - expected))
    assert np.all(np.abs(counts - n * expected) <= 5 * sigma + 1)


def test_prompt_lengths_and_budgets_within_a_bucket_reuse_compiles(model):
    prefill, decode = engine._compiled()
    generate_ids(model, PROMPTS, max_new_tokens=NEW, stop_token_ids=())
    sizes = prefill._cache_size(), decode._cache_size()
    generate_ids(model, [[7] * 40, [8, 9], [10] * 60], max_new_tokens=30, stop_token_ids=(2,))
    assert (prefill._cache_size(), decode._cache_size()) == sizes


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "no prompts"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 512]], {}, "outside the vocabulary"),
        ([[1, -1]], {}, "outside the vocabulary"),
        ([[1] * 1020], {"max_new_tokens": 10}, "exceeds the model's context"),
        ([[1]], {"top_p": 0.0}, "top_p"),
        ([[1]], {"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_input_is_refused(model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_ids(model, prompts, **{"max_new_tokens": 4, **kwargs})
