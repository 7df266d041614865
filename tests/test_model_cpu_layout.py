"""model.cpu_layout computes the same numbers as the TPU layout (which is HF-checked), and "auto"
(the default) is the CPU layout on CPU devices."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrefine_jax.models import create, preset
from agentrefine_jax.train.step import loss_sums

CFG = preset("tiny", vocab_size=500, num_layers=2)


def test_cpu_layout_matches_default_loss_and_gradients_on_packed_rows():
    rng = np.random.RandomState(0)
    seg = np.array([[1] * 20 + [2] * 9 + [0] * 3, [1] * 32])
    pos = np.array([list(range(20)) + list(range(9)) + [0] * 3, list(range(32))])
    batch = {
        "input_ids": jnp.asarray(rng.randint(0, 500, (2, 32)), jnp.int32),
        "loss_mask": jnp.asarray(seg > 0, jnp.int32),
        "segment_ids": jnp.asarray(seg, jnp.int32),
        "positions": jnp.asarray(pos, jnp.int32),
    }
    out = {}
    for name, cfg in {
        "default": dataclasses.replace(CFG, cpu_layout=False),
        "cpu": dataclasses.replace(CFG, cpu_layout=True),
        "auto": CFG,
    }.items():
        model = create(cfg, seed=2)
        graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
        grad = jax.jit(
            jax.value_and_grad(lambda p, g=graphdef: loss_sums(g, p, batch, 8, "fused"), has_aux=True)
        )
        logits = model(batch["input_ids"], batch["positions"], batch["segment_ids"])
        out[name] = (logits, *grad(params))
    assert CFG.cpu_layout == "auto"
    for a, b in zip(jax.tree.leaves(out["auto"]), jax.tree.leaves(out["cpu"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # auto on CPU = the CPU layout
    (l_d, (s_d, n_d), g_d), (l_c, (s_c, n_c), g_c) = out["default"], out["cpu"]
    np.testing.assert_allclose(np.asarray(l_c), np.asarray(l_d), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(s_c), float(s_d), rtol=1e-6)
    assert float(n_c) == float(n_d) > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_c), jax.tree.leaves(g_d), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=str(path))


def test_cpu_layout_is_ignored_when_decoding_with_a_cache():
    from agentrefine_jax.models.llama import init_cache

    model = create(dataclasses.replace(CFG, cpu_layout=True), seed=1)
    ref = create(dataclasses.replace(CFG, cpu_layout=False), seed=1)
    ids = jnp.asarray(np.random.RandomState(1).randint(0, 500, (1, 6)), jnp.int32)
    h1, _ = model.forward(ids, cache=init_cache(model.cfg, 1, 8))
    h2, _ = ref.forward(ids, cache=init_cache(ref.cfg, 1, 8))
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))


def test_cpu_layout_with_remat_scans_the_layers_and_keeps_the_numbers():
    """Remat in the CPU layout runs over scanned layers: unrolled, XLA:CPU scheduled the
    recomputation early and kept every layer's activations anyway (docs/scale.md, "CPU memory of a
    real model"). Same loss and gradients as the unrolled layout without remat."""
    from agentrefine_jax.models.execution import resolve

    unrolled = dataclasses.replace(CFG, cpu_layout=True, remat_policy="none")
    assert not resolve(unrolled, "cpu").scan_full_sequence
    assert resolve(dataclasses.replace(CFG, cpu_layout=True, remat_policy="full"), "cpu").scan_full_sequence
    # The default ("auto"): the projections' outputs saved over the scanned layers on CPU, no remat on TPU.
    on_cpu, on_tpu = resolve(CFG, "cpu"), resolve(CFG, "tpu")
    assert (on_cpu.remat_policy, on_cpu.scan_full_sequence) == ("dots_no_batch", True)
    assert on_tpu.remat_policy == "none"
    rng = np.random.RandomState(3)
    seg = np.array([[1] * 20 + [2] * 12, [1] * 32])
    batch = {
        "input_ids": jnp.asarray(rng.randint(0, 500, (2, 32)), jnp.int32),
        "loss_mask": jnp.asarray(seg > 0, jnp.int32),
        "segment_ids": jnp.asarray(seg, jnp.int32),
        "positions": jnp.asarray(np.array([list(range(20)) + list(range(12)), list(range(32))]), jnp.int32),
    }
    out = []
    for remat in ("none", "full"):
        model = create(dataclasses.replace(CFG, cpu_layout=True, remat_policy=remat), seed=2)
        graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
        fn = jax.value_and_grad(lambda p, g=graphdef: loss_sums(g, p, batch, 8, "fused"), has_aux=True)
        out.append(jax.jit(fn)(params))
    ((s_u, n_u), g_u), ((s_r, n_r), g_r) = out
    np.testing.assert_allclose(float(s_r), float(s_u), rtol=1e-6)
    assert float(n_r) == float(n_u) > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_r), jax.tree.leaves(g_u), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=str(path))


def test_cpu_layout_gradient_stacks_the_layers_grads_without_padding_each():
    """The unrolled stack takes each layer's weights out of the stacked [layers, ...] arrays. Taken as one
    slice per layer, each slice's gradient was the whole stacked array zero-padded around it, and XLA:CPU
    summed the padded copies in a fusion reading every layer per element (~0.9 s of SmolLM2's 4 s train
    step, README "Benchmarks"). The compiled gradient must build each stacked gradient without a pad."""
    cfg = dataclasses.replace(CFG, cpu_layout=True, num_layers=4, remat_policy="none")  # unrolled
    model = create(cfg, seed=0)
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ids = jnp.zeros((1, 8), jnp.int32)

    def loss(p):
        hidden, _ = nnx.merge(graphdef, nnx.State(p)).forward(ids)
        return jnp.sum(hidden**2)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    stacked = {
        "f32[" + ",".join(map(str, leaf.shape)) + "]"
        for leaf in jax.tree.leaves(params)
        if leaf.ndim >= 2 and leaf.shape[0] == cfg.num_layers
    }
    assert stacked, "no stacked layer parameter found"
    padded = [
        line.strip()[:120]
        for line in hlo.splitlines()
        if " pad(" in line and any(f"= {s}" in line for s in stacked)
    ]
    assert not padded, padded


def test_layer_weights_share_the_parameters_memory_and_compute_the_same_decode_step():
    """`engine.layer_weights` (per-layer arrays for the unrolled stack, so XLA:CPU does not copy each
    layer's weight slice on every decode step) are views of the stacked parameters, not copies, and a
    forward pass with them equals one that slices the stacked arrays."""
    from agentrefine_jax.inference.engine import layer_weights
    from agentrefine_jax.models.llama import init_cache

    model = create(dataclasses.replace(CFG, cpu_layout=True), seed=3)
    layers = layer_weights(model)
    assert layers is not None and len(layers) == CFG.num_layers
    for name, view in layers[1].items():
        stacked = getattr(model.layers, name)[...]
        assert view.unsafe_buffer_pointer() == stacked.unsafe_buffer_pointer() + stacked[0].nbytes
        np.testing.assert_array_equal(np.asarray(view), np.asarray(stacked[1]))
    assert layer_weights(model) is layers  # made once per loaded model

    ids = jnp.asarray(np.random.RandomState(3).randint(0, 500, (2, 5)), jnp.int32)
    step = jnp.asarray([[7], [9]], jnp.int32)
    outs = []
    for per_layer in (None, layers):
        _, cache = model.forward(ids, cache=init_cache(model.cfg, 2, 8), layers=per_layer)
        pos = jnp.full((2, 1), 5, jnp.int32)
        outs.append(model.forward(step, pos, cache=cache, layers=per_layer))
    # Same products, float32 accumulation; the matmul kernels may round differently by buffer alignment.
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    model.layers.wq[...] = model.layers.wq[...] + 1.0  # replaced parameters get new views
    assert layer_weights(model) is not layers


def test_head_weight_is_the_tied_embedding_transposed_once_and_decodes_the_same(monkeypatch):
    """`engine.head_weight`: a tied embedding as [hidden, vocab] (the form XLA:CPU's few-row dot runs
    faster), made once per loaded model and again when the embedding is replaced; None where the stored
    head serves (untied, or not the CPU layout). Decoding with it gives the stored table's tokens and
    log-probabilities."""
    from agentrefine_jax.inference import engine

    model = create(dataclasses.replace(CFG, cpu_layout=True, tie_embeddings=True), seed=5)
    head = engine.head_weight(model)
    assert head is not None and head.shape == (CFG.hidden_size, CFG.vocab_size)
    np.testing.assert_array_equal(np.asarray(head), np.asarray(model.embed[...]).T)
    assert engine.head_weight(model) is head
    assert engine.head_weight(create(dataclasses.replace(CFG, cpu_layout=True, tie_embeddings=False))) is None
    assert engine.head_weight(create(dataclasses.replace(CFG, cpu_layout=False, tie_embeddings=True))) is None

    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    transposed = engine.generate(model, prompts, max_new_tokens=12, stop_token_ids=())
    monkeypatch.setattr(engine, "head_weight", lambda m: None)
    stored = engine.generate(model, prompts, max_new_tokens=12, stop_token_ids=())
    monkeypatch.undo()
    for a, b in zip(transposed, stored, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)

    model.embed[...] = model.embed[...] + 1.0  # replaced parameters get a new copy
    assert engine.head_weight(model) is not head


def test_decode_loop_writes_the_per_layer_cache_in_place():
    """On the CPU layout the KV cache is one array per layer from prefill through decode, and the compiled
    decode program neither copies a layer's K/V inside its step loop (XLA:CPU copied each four times per
    step when the column write fed two shapes) nor splits or re-stacks the cache around it."""
    import re

    from agentrefine_jax.inference import engine

    model = create(dataclasses.replace(CFG, cpu_layout=True), seed=4)
    graphdef, state = nnx.split(model)
    layers = engine.layer_weights(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    ids, pos, seg = engine.left_pad(prompts, 8, 4)
    prefill, decode = engine._compiled()
    logits, cache = prefill(graphdef, 24, state, layers, ids, pos, seg)
    assert isinstance(cache["k"], tuple) and len(cache["k"]) == CFG.num_layers
    assert cache["k"][0].shape == (4, CFG.num_kv_heads, 24, CFG.head_dim)
    head = engine.head_weight(model)
    args = (graphdef, 16, True, state, layers, head, cache, logits, jnp.asarray([3, 5, 1, 1], jnp.int32),
            jnp.asarray([False, False, True, True]), jnp.arange(4, dtype=jnp.int32), jnp.int32(0),
            jnp.int32(16), jax.random.key(0), jnp.float32(0), jnp.float32(1),
            engine.Stops(()).array)  # fmt: skip
    hlo = decode.lower(*args).compile().as_text()
    body = re.search(r"while\(%[\w.\-]+\), condition=%[\w.\-]+, body=%([\w.\-]+)", hlo).group(1)
    start = hlo.index(f"%{body} (")
    loop = hlo[start : hlo.index("\n}\n", start)]
    entry = hlo[hlo.index("\nENTRY ") :]
    flat_kv = f"f32[{4 * CFG.num_kv_heads},24,{CFG.head_dim}]"
    flat_k = f"f32[{4 * CFG.num_kv_heads},{CFG.head_dim},24]"  # K carried transposed (`flat_heads`)
    kv = f"f32[4,{CFG.num_kv_heads},24,{CFG.head_dim}]"
    copied = re.findall(r"= (f32\[[\d,]+\])\S* copy\(", loop)
    assert flat_kv not in copied and flat_k not in copied and kv not in copied, copied
    assert " concatenate(" not in entry  # no re-stack after the loop
    steps, out, *_ = decode(*args)  # the per-layer cache comes back per layer, in its own shape
    assert int(steps) == 16 and isinstance(out["k"], tuple)
    assert out["k"][0].shape == (4, CFG.num_kv_heads, 24, CFG.head_dim)


def _dot_result_types(hlo: str) -> list[tuple[str, str]]:
    """(operand element types, result element type) of every dot_general in a StableHLO text."""
    found = []
    for line in hlo.splitlines():
        if "stablehlo.dot_general" in line:
            sig = line.rsplit(":", 1)[1]  # `(tensor<..xbf16>, tensor<..xbf16>) -> tensor<..xf32>`
            args, result = sig.split("->")
            types = [re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", part) for part in (args, result)]
            found.append((",".join(sorted(set(types[0]))), types[1][0]))
    return found


def test_bfloat16_projections_with_a_cache_on_cpu_ask_for_float32():
    """A 16-bit model's projections with a KV cache (prefill, decode) on CPU are bfloat16 x bfloat16
    -> float32 dots, rounded once after: XLA:CPU's kernels for that form are 1.9-3.1x faster at 8-32
    rows than bfloat16-output dots (README, Intel Xeon with AMX). Training passes keep theirs."""
    from agentrefine_jax.models.llama import init_cache

    cfg = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16", cpu_layout=True)
    model = create(cfg, seed=1)
    graphdef, params = nnx.graphdef(model), nnx.state(model)

    def decode(p, cache):
        return nnx.merge(graphdef, p).forward(jnp.zeros((8, 1), jnp.int32), cache=cache)

    def full(p):
        return nnx.merge(graphdef, p)(jnp.zeros((2, 16), jnp.int32))

    def widened(hlo: str) -> int:
        return sum(ops == "bf16" and r == "f32" for ops, r in _dot_result_types(hlo))

    hlo = jax.jit(decode).lower(params, init_cache(cfg, 8, 16)).as_text()
    # q, k, v, o, gate, up and down, and the attention scores (always float32), in the layer's body
    # (once where the layers are scanned)
    assert widened(hlo) >= 7 + 1, _dot_result_types(hlo)
    hlo = jax.jit(full).lower(params).as_text()
    assert widened(hlo) <= 2, _dot_result_types(hlo)  # the scores only
