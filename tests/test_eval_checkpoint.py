"""`--checkpoint`: the agent loop on a real (tiny, random-weight) checkpoint through ChatGenerator.

Every assistant turn in the saved transcript must be exactly what the generator produces for the
conversation before it, so the loop feeds the model the right messages and records its replies."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from agentrefine_jax.checkpoint import save_model
from agentrefine_jax.eval.cli import main
from agentrefine_jax.eval.policies import DEFAULT_STOP
from agentrefine_jax.inference.chat import ChatGenerator
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import preset

CFG = preset("tiny", max_position_embeddings=2048)


def save_random_checkpoint(root, cfg, seed: int) -> str:
    """A model of `cfg` with random weights away from init (norms near 1) saved as a checkpoint at `root`."""
    graphdef, state = nnx.split(llama.abstract(cfg))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape)
        value = 1.0 + 0.1 * noise if str(path[-1].key).endswith("norm") else 0.1 * noise
        return jax.device_put(np.asarray(value, leaf.dtype), jax.devices()[0])

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    save_model(root, nnx.merge(graphdef, state), cfg, step=1, tokenizer="llama3", template="llama3")
    return str(root)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "run", CFG, seed=0)


def test_checkpoint_backend_runs_episodes_and_records_model_replies(checkpoint, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = main(
        [
            "--checkpoint",
            checkpoint,
            "--tasks",
            "pddl",
            "--episodes",
            "2",
            "--max-steps",
            "2",
            "--max-new-tokens",
            "12",
            "--batch-size",
            "2",
            "--workdir",
            str(tmp_path / "w"),
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    assert "PDDL" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["policy"].startswith("checkpoint:")
    eps = doc["episodes"]
    assert len(eps) == 2 and all(e["steps"] == 2 and e["termination"] == "max_steps" for e in eps)
    gen = ChatGenerator.from_checkpoint(checkpoint)
    for e in eps:
        msgs = e["messages"]
        for i in (2, 4):  # the two assistant turns
            assert msgs[i]["role"] == "assistant"
            (expected,) = gen.chat([msgs[:i]], max_new_tokens=12, temperature=0.0, stop=list(DEFAULT_STOP))
            assert msgs[i]["content"] == expected
        # A random model does not follow the format: the loop answered with the error feedback.
        assert e["format_errors"] + e["invalid_actions"] >= 1
