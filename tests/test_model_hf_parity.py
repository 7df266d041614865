"""The project forward pass against transformers' PyTorch Llama / Mistral (random tiny models).

Oracle: transformers' own float32 forward on the same weights. Every test also checks
that the feature under test changes the output, so agreement cannot be vacuous.
"""

from __future__ import annotations

import dataclasses

import hf_fixtures as F
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrefine_jax.hf.io import load_hf_model
from agentrefine_jax.models import llama

ATOL = 1e-4
SEQ = 40


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hf_parity")
    return {
        "llama": F.make_checkpoint(root / "llama", "llama", config_layout="tf4"),
        "mistral": F.make_checkpoint(root / "mistral", "mistral"),
    }


@pytest.fixture(scope="module")
def loaded(hf_dirs: dict[str, object]) -> dict[str, tuple[object, llama.Transformer, object]]:
    out = {}
    for family, d in hf_dirs.items():
        cfg, model = load_hf_model(d, dtype="float32")
        out[family] = (cfg, model, F.load_hf(d))
    return out


def with_config(model: llama.Transformer, **changes: object) -> llama.Transformer:
    """The same weights under a different (shape-compatible) config."""
    graphdef, _ = nnx.split(llama.abstract(dataclasses.replace(model.cfg, **changes)))
    return nnx.merge(graphdef, nnx.state(model))


@nnx.jit
def forward(m: llama.Transformer, ids: jax.Array, pos: jax.Array | None = None, seg: jax.Array | None = None):
    return m(ids, pos, seg)


def _max_diff(a: object, b: object) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_forward_matches_transformers(family: str, loaded: dict) -> None:
    cfg, model, hf = loaded[family]
    ids = F.random_ids(np.random.default_rng(1), cfg.vocab_size, 2, SEQ)
    ref = F.hf_logits(hf, ids)
    assert ref.std() > 0.5, "logits too small for the comparison to mean anything"
    ours = forward(model, jnp.asarray(ids, jnp.int32))
    assert ours.dtype == jnp.float32
    assert _max_diff(ours, ref) <= ATOL

    # The family-specific feature is live at this length: removing it breaks agreement.
    if family == "llama":
        assert cfg.rope_scaling is not None and cfg.num_kv_heads < cfg.num_heads
        plain = with_config(model, rope_scaling=None)
    else:
        assert cfg.sliding_window is not None and cfg.sliding_window < SEQ
        plain = with_config(model, sliding_window=None)
    assert _max_diff(forward(plain, jnp.asarray(ids, jnp.int32)), ref) > 1e-2


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_segments_equal_separate_runs(family: str, loaded: dict) -> None:
    cfg, model, hf = loaded[family]
    rng = np.random.default_rng(2)
    a = F.random_ids(rng, cfg.vocab_size, 23)
    b = F.random_ids(rng, cfg.vocab_size, 13)
    pad = 4
    ids = np.concatenate([a, b, rng.integers(0, cfg.vocab_size, pad)])[None]
    seg = np.concatenate([np.full(23, 1), np.full(13, 2), np.zeros(pad)]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(23), np.arange(13), np.zeros(pad)]).astype(np.int32)[None]
    packed = np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg)))[0]
    ref_a, ref_b = F.hf_logits(hf, a[None])[0], F.hf_logits(hf, b[None])[0]
    assert _max_diff(packed[:23], ref_a) <= ATOL
    assert _max_diff(packed[23:36], ref_b) <= ATOL
    # Without segment ids the second document would see the first.
    unmasked = np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(pos)))[0]
    assert _max_diff(unmasked[23:36], ref_b) > 1e-2


def test_scan_remat_and_blocked_attention_agree(loaded: dict) -> None:
    """Same logits and same gradients for every execution strategy over the same weights."""
    cfg, model, hf = loaded["llama"]
    ids = jnp.asarray(F.random_ids(np.random.default_rng(3), cfg.vocab_size, 2, 32), jnp.int32)

    def loss(m: llama.Transformer) -> jax.Array:
        logits = m(ids)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    @nnx.jit
    def run(m: llama.Transformer) -> tuple[jax.Array, nnx.State]:
        return m(ids), nnx.grad(loss)(m)

    # Baseline: the TPU layout (explicitly: "auto" picks the CPU layout here), scanned layers, no
    # remat, one attention block. The variant changes all three (each compile of forward+backward
    # costs seconds on 2 cores, so one variant carries them).
    model = with_config(model, cpu_layout=False)
    base_logits, base_grads = run(model)
    assert _max_diff(base_logits, F.hf_logits(hf, np.asarray(ids))) <= ATOL
    variant = with_config(model, scan_layers=False, remat_policy="full", attention_block_size=8)
    assert variant.cfg.cpu_layout is False
    logits, grads = run(variant)
    assert _max_diff(logits, base_logits) <= 1e-5
    leaves, base_leaves = jax.tree.leaves(grads), jax.tree.leaves(base_grads)
    assert len(leaves) == 9 + 3 and all(float(jnp.abs(g).max()) > 0 for g in base_leaves)
    for g, g0 in zip(leaves, base_leaves, strict=True):
        assert _max_diff(g, g0) <= 1e-4 * float(jnp.abs(g0).max())


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_kv_cache_decode_equals_full_forward(family: str, loaded: dict) -> None:
    """Prefill then one-token decode steps reproduce the full forward (incl. the sliding window)."""
    cfg, model, _ = loaded[family]
    total, prompt = 24, 10
    ids = jnp.asarray(F.random_ids(np.random.default_rng(4), cfg.vocab_size, 1, total), jnp.int32)
    full = np.asarray(forward(model, ids))[0]

    @nnx.jit
    def step(m: llama.Transformer, tok: jax.Array, pos: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        hidden, cache = m.forward(tok, pos, jnp.ones_like(tok), cache)
        return m.logits(hidden), cache

    cache = llama.init_cache(cfg, batch=1, max_len=32)
    logits, cache = step(model, ids[:, :prompt], jnp.arange(prompt, dtype=jnp.int32)[None], cache)
    outs = [np.asarray(logits)[0]]
    for t in range(prompt, total):
        logits, cache = step(model, ids[:, t : t + 1], jnp.full((1, 1), t, jnp.int32), cache)
        outs.append(np.asarray(logits)[0])
    assert int(cache["index"]) == total
    assert _max_diff(np.concatenate(outs), full) <= ATOL
