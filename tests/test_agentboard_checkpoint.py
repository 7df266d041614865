"""The AgentBoard protocol with a real (tiny, random-weight) checkpoint: every prompt is AgentBoard's single
user message under the checkpoint's chat template, fits `context_length - 100` tokens after dropping the
oldest history lines, and every reply is the greedy 100-token continuation the generator gives for it."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from agentboard_fixture import make_checkout
from flax import nnx
from test_eval_checkpoint import save_random_checkpoint

from agentrefine_jax.checkpoint import save_model
from agentrefine_jax.eval.agentboard.checkout import Checkout
from agentrefine_jax.eval.agentboard.protocol import (
    MAX_NEW_TOKENS,
    load_prompt_set,
    parse_action,
    prompt_head,
    user_prompt,
)
from agentrefine_jax.eval.agentboard.runner import checkpoint_model, run
from agentrefine_jax.eval.agentboard.tasks.pddl import PddlTask
from agentrefine_jax.eval.cli import main
from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.models import llama
from agentrefine_jax.models.config import preset

pytest.importorskip("pddlgym")
CFG = preset("tiny", max_position_embeddings=2048)
CONTEXT = 700  # small enough that the history must be cut after a few random replies


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "run", CFG, seed=1)


@pytest.mark.slow
def test_prompts_fit_the_context_and_replies_are_the_models(checkpoint, tmp_path):
    co = Checkout(make_checkout(tmp_path / "ab"))
    system = "You plan.Answer with one action. "  # prompt file's system_msg + the checkout's vLLM sentence
    task = PddlTask()
    env = task.make_env(co, task.episodes(co)[0])
    first_obs = env.reset()
    head = prompt_head(
        load_prompt_set(co, task.prompt_file, "gripper"), env.goal, "check valid actions", False
    )
    first_prompt = user_prompt(head, [f"Observation: {first_obs}"])
    # The context holds the first prompt and 100 new tokens with 5 tokens to spare: from the second step on,
    # history must be dropped.
    model = checkpoint_model(checkpoint, None, 4096)
    model.context_length = model.num_tokens(system, first_prompt) + MAX_NEW_TOKENS + 5
    prompts: list[tuple[str, str]] = []
    replies: list[str] = []
    generate = model.generate

    def recording(batch, keys=None):
        prompts.extend(batch)
        out = generate(batch, keys)  # keyed: each episode's KV cache kept between its turns
        replies.extend(out)
        return out

    model.generate = recording
    logs = tmp_path / "logs"
    doc = run(
        co,
        EvalConfig(tasks=("pddl",), source="agentboard", max_steps=2, batch_size=2, log_dir=str(logs)),
        model=model,
    )
    assert doc["agent"].startswith("checkpoint:") and doc["tasks"]["pddl"]["episodes"] == 2
    assert len(prompts) == 4 and all(s == system for s, _ in prompts)
    assert prompts[0] == (system, first_prompt)
    for s, user in prompts:
        assert user.startswith(head.split("You should perform")[0]) and user.endswith("\nAction: ")
        assert model.num_tokens(s, user) <= model.context_length - MAX_NEW_TOKENS
    records = [
        json.JSONDecoder().raw_decode(x)[0] for x in _objects((logs / "logs" / "pddl.jsonl").read_text())
    ]
    first_episode = next(r for r in records if r["id"] == 0)
    assert first_episode["history_items_dropped"] > 0
    # Greedy decoding, 100 new tokens, no stop string: the generator gives the same replies again, here
    # prefilling every prompt whole (no keys).
    assert generate(prompts) == replies
    # The actions taken are the parser's reading of the replies.
    taken = [t["Action"] for r in records for t in r["trajectory"].values()]
    assert sorted(taken) == sorted(parse_action(x) for x in replies)


@pytest.mark.slow
def test_all_checkpoints_of_a_run_dir_are_evaluated_and_the_best_reported(checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    graphdef, state = nnx.split(llama.abstract(CFG))
    for step, scale in ((1, 0.1), (2, 0.2)):
        rng = np.random.default_rng(step)

        def draw(path, leaf, rng=rng, scale=scale):
            noise = rng.standard_normal(leaf.shape)
            value = 1.0 + scale * noise if str(path[-1].key).endswith("norm") else scale * noise
            return jax.device_put(np.asarray(value, leaf.dtype), jax.devices()[0])

        nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
        save_model(
            run_dir / "checkpoints",
            nnx.merge(graphdef, state),
            CFG,
            step=step,
            tokenizer="llama3",
            template="llama3",
        )
    co = make_checkout(tmp_path / "ab")
    out = tmp_path / "r.json"
    args = ["--protocol", "agentboard", "--agentboard-dir", str(co), "--tasks", "pddl", "--episodes", "1"]
    args += [
        "--max-steps",
        "1",
        "--checkpoint",
        str(run_dir),
        "--all-checkpoints",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert [r["step"] for r in doc["checkpoints"]] == [1, 2]
    best = max(doc["checkpoints"], key=lambda r: (r["score"], -r["step"]))
    assert doc["best_step"] == best["step"]
    for r in doc["checkpoints"]:
        assert r["result"]["agent"] == f"checkpoint:{run_dir / 'checkpoints' / str(r['step'])}"
        assert r["score"] == [
            r["result"]["tasks"]["pddl"]["success_rate"],
            r["result"]["tasks"]["pddl"]["progress_rate"],
        ]
    assert (
        main(
            [
                "--protocol",
                "agentboard",
                "--agentboard-dir",
                str(co),
                "--policy",
                "random",
                "--all-checkpoints",
            ]
        )
        == 2
    )


def _objects(text: str) -> list[str]:
    """Split a file of concatenated indent=2 JSON objects (AgentBoard's log format)."""
    out, dec, i = [], json.JSONDecoder(), 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text):
            _, j = dec.raw_decode(text, i)
            out.append(text[i:j])
            i = j
    return out
