"""Real preset shapes via jax.eval_shape: published parameter counts, no memory allocated."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from agentrefine_jax.models import llama, preset


@pytest.mark.parametrize(
    "name, count",
    [
        ("llama3_8b", 8_030_261_248),
        ("llama3.1_8b", 8_030_261_248),
        ("llama3_70b", 70_553_706_496),
        ("llama3.1_70b", 70_553_706_496),
        ("mistral_7b_v0.3", 7_248_023_552),
    ],
)
def test_preset_parameter_count_without_allocation(name: str, count: int) -> None:
    live_before = len(jax.live_arrays())
    model = llama.abstract(preset(name))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert llama.param_count(model) == count
    assert len(jax.live_arrays()) == live_before
    # Every parameter is named for sharding, one logical name per dimension.
    for var in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        axes = var.get_metadata().get("axes")
        assert axes is not None and len(axes) == len(var.get_value().shape)
