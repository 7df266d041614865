"""Sampling: reproducible per seed, top_p -> 0 is greedy, samples stay in the nucleus and follow
the renormalised distribution; compiles are reused across prompt lengths; bad input is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrefine_jax.inference import engine
from agentrefine_jax.inference.engine import generate_ids
from agentrefine_jax.inference.sampling import row_keys, sample
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import ModelConfig

CFG = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=256,
    initializer_range=0.05,  # moderately peaked next-token distributions: top-p actually prunes
    param_dtype="float32",
    dtype="float32",
    eos_token_ids=(2,),
)
PROMPTS = [[5, 9, 200, 31, 7, 7, 400, 12, 3], [100, 101, 102, 103]]


def numpy_model(cfg: ModelConfig, seed: int, std: float) -> llama.Transformer:
    """Random weights drawn on the host: no per-op compiles, unlike eager initialisation."""
    graphdef, state = nnx.split(llama.abstract(cfg))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape)
        value = 1.0 + 0.1 * noise if str(path[-1].key).endswith("norm") else std * noise
        # Committed to device 0 like a loaded checkpoint, so both share compiled programs.
        return jax.device_put(np.asarray(value, leaf.dtype), jax.devices()[0])

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def model():
    return numpy_model(CFG, seed=1, std=0.05)


def _sampled(model, seed, top_p=0.9, temperature=1.0):
    return generate_ids(
        model, PROMPTS, max_new_tokens=20, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=()
    )


def test_sampling_is_reproducible_per_seed(model):
    a, b, c = _sampled(model, 1), _sampled(model, 1), _sampled(model, 2)
    assert a == b
    assert a != c
    assert a[0] != a[1]  # rows draw from different keys
    # A row's samples depend on its seed and index, not on what else shares the batch.
    other = generate_ids(
        model,
        [PROMPTS[0], [300, 301]],
        max_new_tokens=20,
        temperature=1.0,
        top_p=0.9,
        seed=1,
        stop_token_ids=(),
    )
    assert other[0] == a[0] and other[1] != a[1]


def test_tiny_top_p_equals_greedy(model):
    greedy = generate_ids(model, PROMPTS, max_new_tokens=20, stop_token_ids=())
    assert _sampled(model, 3, top_p=1e-6) == greedy
    assert _sampled(model, 3, top_p=1.0) != greedy  # and sampling does sample


def test_samples_stay_in_the_nucleus(model):
    """Re-score every sampled sequence with a cache-free forward pass: each sampled token must be
    in the top-p set of the temperature-scaled distribution at its step."""
    top_p, temperature = 0.6, 0.8
    outs = _sampled(model, 4, top_p=top_p, temperature=temperature)
    graphdef, state = nnx.split(model)
    full_forward = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))
    pruned = 0
    for prompt, gen in zip(PROMPTS, outs, strict=True):
        seq = jnp.asarray([prompt + gen])
        logits = np.asarray(full_forward(state, seq))[0, len(prompt) - 1 : -1] / temperature
        for step, tok in enumerate(gen):
            probs = np.exp(logits[step] - logits[step].max())
            probs /= probs.sum()
            mass_above = probs[probs > probs[tok]].sum()
            assert mass_above < top_p + 1e-5, (step, tok, mass_above)
            desc = np.sort(probs)[::-1]
            pruned += int(((np.cumsum(desc) - desc) < top_p).sum() < len(probs))
    assert pruned > 0  # the nucleus was smaller than the vocabulary, so the check had teeth


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
    generate_ids(model, PROMPTS, max_new_tokens=20, stop_token_ids=())
    sizes = prefill._cache_size(), decode._cache_size()
    generate_ids(model, [[7] * 13, [8, 9]], max_new_tokens=30, stop_token_ids=(2,))
    assert (prefill._cache_size(), decode._cache_size()) == sizes


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "no prompts"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1, 512]], {}, "outside the vocabulary"),
        ([[1, -1]], {}, "outside the vocabulary"),
        ([[1] * 250], {"max_new_tokens": 10}, "exceeds the model's context"),
        ([[1]], {"top_p": 0.0}, "top_p"),
        ([[1]], {"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_input_is_refused(model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_ids(model, prompts, **{"max_new_tokens": 4, **kwargs})
