"""Reading and writing Hugging Face checkpoints (agentrefine_jax.hf.io) against transformers."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import hf_fixtures as F
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from agentrefine_jax.hf import io as hf_io
from agentrefine_jax.models import RopeScaling
from agentrefine_jax.sharding import make_mesh

forward = nnx.jit(lambda m, ids: m(ids))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return F.make_checkpoint(tmp_path_factory.mktemp("hfio") / "llama", "llama")


def _config_only(
    tmp: pathlib.Path, name: str, config: transformers.PretrainedConfig, layout: str
) -> pathlib.Path:
    d = tmp / name
    config.save_pretrained(d)
    if layout == "tf4":
        F.to_tf4_config(d / "config.json")
    return d


def _edit_config(d: pathlib.Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_reads_transformers4_and_transformers5_layouts(tmp_path: pathlib.Path) -> None:
    for family, make in (("llama", F.llama_config), ("mistral", F.mistral_config)):
        tf5 = hf_io.read_hf_config(_config_only(tmp_path, f"{family}5", make(), "tf5"))
        tf4_dir = _config_only(tmp_path, f"{family}4", make(), "tf4")
        raw = json.loads((tf4_dir / "config.json").read_text())
        assert "rope_parameters" not in raw and "rope_theta" in raw and "rope_scaling" in raw
        assert hf_io.read_hf_config(tf4_dir) == tf5
    llama = hf_io.read_hf_config(tmp_path / "llama5")
    assert llama.family == "llama" and llama.rope_theta == 500000.0
    assert llama.rope_scaling == RopeScaling(original_max_position_embeddings=64)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert llama.eos_token_ids == (2, 3) and llama.sliding_window is None
    mistral = hf_io.read_hf_config(tmp_path / "mistral5")
    assert mistral.family == "mistral" and mistral.rope_scaling is None and mistral.sliding_window == 8
    assert mistral.rope_theta == 1e6 and mistral.num_kv_heads == 1


def test_unsupported_or_inconsistent_configs_are_refused(tmp_path: pathlib.Path) -> None:
    cases = [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None},
            "unsupported rope type 'yarn'",
        ),
        ({"rope_theta": 10000.0}, "disagree"),
        ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]
    for i, (changes, message) in enumerate(cases):
        d = _config_only(tmp_path, f"bad{i}", F.llama_config(), "tf5")
        _edit_config(d, **changes)
        with pytest.raises(ValueError, match=message):
            hf_io.read_hf_config(d)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_io.read_hf_config(tmp_path / "nowhere")


def test_written_config_reads_back_in_both_layouts(tmp_path: pathlib.Path) -> None:
    for family, make in (("llama", F.llama_config), ("mistral", F.mistral_config)):
        cfg = hf_io.read_hf_config(_config_only(tmp_path, f"src_{family}", make(), "tf5"))
        out = tmp_path / f"out_{family}"
        out.mkdir()
        (out / "config.json").write_text(json.dumps(hf_io.hf_config_dict(cfg, "bfloat16")))
        theirs = transformers.AutoConfig.from_pretrained(out)
        ref = make()
        assert theirs.rope_parameters == ref.rope_parameters
        assert getattr(theirs, "sliding_window", None) == getattr(ref, "sliding_window", None)
        assert hf_io.read_hf_config(out) == cfg
        # What a transformers-4 reader uses: the top-level keys alone describe the same model.
        raw = json.loads((out / "config.json").read_text())
        del raw["rope_parameters"]
        (out / "config.json").write_text(json.dumps(raw))
        assert hf_io.read_hf_config(out) == cfg
        assert transformers.AutoConfig.from_pretrained(out).rope_parameters == ref.rope_parameters


def test_pickle_weights_are_refused(tmp_path: pathlib.Path) -> None:
    d = _config_only(tmp_path, "pickled", F.llama_config(), "tf5")
    torch.save({"model.norm.weight": torch.ones(64)}, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle-based weights.*refused"):
        hf_io.load_hf_model(d)


def _rewrite(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_misshaped_or_unknown_tensors_are_rejected(
    llama_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    d = _rewrite(llama_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors: \['model.layers.1.mlp.up_proj.weight'\]"):
        hf_io.load_hf_model(d)

    def shrink(t: dict) -> None:
        t["model.layers.2.self_attn.k_proj.weight"] = t["model.layers.2.self_attn.k_proj.weight"][:-1]

    d = _rewrite(llama_dir, tmp_path / "misshaped", shrink)
    with pytest.raises(
        ValueError, match=r"k_proj.weight has shape \(31, 64\), config.json implies \(32, 64\)"
    ):
        hf_io.load_hf_model(d)

    d = _rewrite(
        llama_dir, tmp_path / "unknown", lambda t: t.update({"model.layers.0.mlp.bias": np.zeros(3)})
    )
    with pytest.raises(ValueError, match="unexpected tensor in HF checkpoint: model.layers.0.mlp.bias"):
        hf_io.load_hf_model(d)

    d = _rewrite(
        llama_dir,
        tmp_path / "rotary",
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}),
    )
    skipped: list[str] = []
    hf_io.load_hf_model(d, log=skipped.append)
    assert any("skip model.layers.0.self_attn.rotary_emb.inv_freq" in line for line in skipped)


def test_sharded_load_on_eight_devices_matches_transformers(llama_dir: pathlib.Path) -> None:
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    cfg, model = hf_io.load_hf_model(llama_dir, mesh=mesh, dtype="float32")
    for arr in (model.layers.wq[...], model.embed[...], model.lm_head[...]):
        assert len(arr.sharding.device_set) == 8
        assert arr.addressable_shards[0].data.size < arr.size
    ids = F.random_ids(np.random.default_rng(0), cfg.vocab_size, 2, 24)
    ref = F.hf_logits(llama_dir, ids)
    assert float(np.abs(np.asarray(forward(model, jnp.asarray(ids, jnp.int32))) - ref).max()) <= 1e-4


def test_tied_embeddings_round_trip(tmp_path: pathlib.Path) -> None:
    src = F.make_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    cfg, model = hf_io.load_hf_model(src, dtype="float32")
    assert cfg.tie_embeddings and not hasattr(model, "lm_head")
    hf_io.save_hf(model, cfg, tmp_path / "out", dtype="float32")
    with safe_open(tmp_path / "out" / "model.safetensors", framework="numpy") as f:
        assert "lm_head.weight" not in f.keys()
    ids = F.random_ids(np.random.default_rng(1), cfg.vocab_size, 1, 20)
    np.testing.assert_array_equal(F.hf_logits(tmp_path / "out", ids), F.hf_logits(src, ids))


# Run in a fresh interpreter: tracemalloc counts every thread's allocations and every object whose
# collection a worker's history delays, so in a worker that ran other test files first the same
# save once measured the whole model (a full-suite CI run, never in isolation).
_MEMORY_PROBE = """
import gc, json, sys, tracemalloc
import jax
from flax import nnx
from agentrefine_jax.hf import io as hf_io
from agentrefine_jax.sharding import make_mesh

src, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
mesh = make_mesh(data=1, fsdp=4, tensor=2)
hf_io.load_hf_model(src, mesh=mesh)  # compile everything once; compilation is not what we measure
gc.collect()
tracemalloc.start()
cfg, model = hf_io.load_hf_model(src, mesh=mesh)
jax.block_until_ready(nnx.state(model))
_, load_peak = tracemalloc.get_traced_memory()
gc.collect()
before, _ = tracemalloc.get_traced_memory()
tracemalloc.reset_peak()
hf_io.save_hf(model, cfg, out, dtype="float32", max_shard_bytes=shard)
after, save_peak = tracemalloc.get_traced_memory()
print(json.dumps({"load_peak": load_peak, "before": before, "save_peak": save_peak, "after": after}))
"""


def test_host_memory_stays_near_one_tensor(tmp_path: pathlib.Path) -> None:
    """Python-heap peak (numpy buffers included) while streaming in and out, vs the model size; and
    an export leaves no host copy of the model behind (jax caches one on every sharded array it
    copies to the host, for as long as the array lives)."""
    src = F.make_checkpoint(
        tmp_path / "big",
        "llama",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        init_std=0.05,
    )
    total = sum(t.nbytes for _, t in hf_io.iter_hf_tensors(src))
    largest = max(t.nbytes for _, t in hf_io.iter_hf_tensors(src))
    assert total > 6 * largest
    shard = 6 * 10**6
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(src), str(out), str(shard)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["load_peak"] < 2.5 * largest, (m, largest, total)
    assert m["save_peak"] - m["before"] < shard + 2 * largest, (m, shard, largest, total)
    # The unstacked parameters alone (embedding and LM head) are 2 x largest: none may stay cached.
    assert m["after"] - m["before"] < largest // 4, (m, largest)
    assert len(list(out.glob("model-*.safetensors"))) >= 4
