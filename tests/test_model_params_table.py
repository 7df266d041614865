"""The parameter table against transformers' own modules: names, shapes and layouts.

Oracle: the state dict of transformers' Llama / Mistral / Qwen3 (tied and untied) built from
the same config; our model's parameters are created from the table, so both sides are checked.
"""

from __future__ import annotations

import hf_fixtures as F
import numpy as np
import pytest
from flax import nnx

from agentrefine_jax.hf.io import read_hf_config
from agentrefine_jax.models import llama, params
from agentrefine_jax.train import flops

CASES = [("llama", False), ("llama", True), ("mistral", False), ("qwen3", False), ("qwen3", True)]
MAKE = {"llama": F.llama_config, "mistral": F.mistral_config, "qwen3": F.qwen3_config}
Q_NORM = "model.layers.0.self_attn.q_norm.weight"


@pytest.mark.parametrize(("family", "tied"), CASES, ids=["llama", "tied", "mistral", "qwen3", "qwen3_tied"])
def test_table_matches_transformers_state_dict(family: str, tied: bool, tmp_path) -> None:
    make = MAKE[family]
    hf_model = F.build_model(make(tie_word_embeddings=tied))
    hf_model.save_pretrained(tmp_path)  # config.json is all read_hf_config needs
    cfg = read_hf_config(tmp_path)
    state = {k: v.numpy() for k, v in hf_model.state_dict().items() if "rotary" not in k}
    if tied:
        state.pop("lm_head.weight")  # transformers lists the tied alias; it is not a tensor of its own
    assert params.expected_hf_names(cfg) == set(state)
    ours = nnx.to_pure_dict(nnx.state(llama.abstract(cfg), nnx.Param))
    for name, tensor in state.items():
        assert params.hf_shape(name, cfg) == tensor.shape, name
        path, layer, array = params.hf_to_ours(name, tensor, cfg)
        row = params.BY_PATH[path]
        node = ours
        for key in path:
            node = node[key]
        assert tuple(node.shape) == params.shape(row, cfg)
        assert array.shape == params.shape(row, cfg, stacked=False)
        back_name, back = params.ours_to_hf(row, array, layer)
        assert back_name == name and np.array_equal(back, tensor)
    with pytest.raises(KeyError, match="unexpected tensor"):
        params.lookup_hf("model.layers.0.self_attn.qkv_proj.weight")
    if family != "qwen3":  # a q_norm is a tensor of the table, but not of a Llama/Mistral model
        with pytest.raises(KeyError, match="unexpected tensor"):
            params.hf_shape(Q_NORM, cfg)
    else:
        assert params.hf_shape(Q_NORM, cfg) == (cfg.head_dim,)
    # FLOP convention: every linear weight once, the output projection counted even when tied.
    linear = sum(t.size for k, t in state.items() if "proj" in k or k == "lm_head.weight")
    assert flops.matmul_params(cfg) == linear + (cfg.vocab_size * cfg.hidden_size if tied else 0)
