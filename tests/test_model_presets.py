"""Real preset shapes via jax.eval_shape: published parameter counts, no memory allocated; the
newer presets also against transformers' own model built on the meta device from the config.json
our export writes for them (no weights), and that config.json read back gives the preset."""

from __future__ import annotations

import gc
import json

import jax
import pytest
import torch
import transformers
from flax import nnx

from agentrefine_jax.hf.io import generation_config_dict, hf_config_dict, read_hf_config
from agentrefine_jax.models import llama, preset

# Published sizes: SmolLM2 135M, Llama-3.2 1.23B / 3.21B, Qwen3 0.6B ... 32.8B (their model
# cards' totals; Qwen3's non-embedding counts 0.44B ... 31.2B follow from these).
NEWER = [
    ("smollm2_135m", 134_515_008),
    ("llama3.2_1b", 1_235_814_400),
    ("llama3.2_3b", 3_212_749_824),
    ("qwen3_0.6b", 596_049_920),
    ("qwen3_1.7b", 1_720_574_976),
    ("qwen3_4b", 4_022_468_096),
    ("qwen3_8b", 8_190_735_360),
    ("qwen3_14b", 14_768_307_200),
    ("qwen3_32b", 32_762_123_264),
    # Qwen3-MoE: 30.5B (3.3B active) and 235B (22B active), their model cards' totals.
    ("qwen3_30b_a3b", 30_532_122_624),
    ("qwen3_235b_a22b", 235_093_634_560),
]


@pytest.mark.parametrize(
    "name, count",
    [
        ("llama3_8b", 8_030_261_248),
        ("llama3.1_8b", 8_030_261_248),
        ("llama3_70b", 70_553_706_496),
        ("llama3.1_70b", 70_553_706_496),
        ("mistral_7b_v0.3", 7_248_023_552),
        *NEWER,
    ],
)
def test_preset_parameter_count_without_allocation(name: str, count: int) -> None:
    # No array is allocated. By identity, not by count: an earlier test's arrays that the garbage
    # collector frees meanwhile made the count go down (CI, stop 65: 110 -> 108).
    gc.collect()
    live_before = {id(a) for a in jax.live_arrays()}
    model = llama.abstract(preset(name))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert llama.param_count(model) == count
    assert [a.shape for a in jax.live_arrays() if id(a) not in live_before] == []
    # Every parameter is named for sharding, one logical name per dimension.
    for var in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        axes = var.get_metadata().get("axes")
        assert axes is not None and len(axes) == len(var.get_value().shape)


@pytest.mark.parametrize("name, count", NEWER, ids=[n for n, _ in NEWER])
def test_preset_matches_transformers_on_meta_device(name: str, count: int, tmp_path) -> None:
    cfg = preset(name)
    config_json = hf_config_dict(cfg, "bfloat16")
    hf_config = transformers.AutoConfig.for_model(**config_json)
    with torch.device("meta"):  # shapes only: a 32B model costs nothing
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(hf_model).__name__ == config_json["architectures"][0]
    # parameters() lists a tied embedding once, as our count does.
    assert sum(p.numel() for p in hf_model.parameters()) == llama.param_count(llama.abstract(cfg)) == count
    assert hf_model.config.tie_word_embeddings == cfg.tie_embeddings
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config_dict(cfg)))
    assert read_hf_config(tmp_path) == cfg
