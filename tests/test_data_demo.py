"""The shipped demo data: reproducible from its generator, with real errors and recoveries."""

import json

import numpy as np

from agentrefine_jax.data import DEMO_EVAL, DEMO_TRAIN, demo_world
from agentrefine_jax.data.schema import assistant_categories, validate_messages
from agentrefine_jax.data.templates import get_template
from agentrefine_jax.data.tokenizers import load_tokenizer


def test_generator_reproduces_the_shipped_files(tmp_path):
    from agentrefine_jax.data.cli import main

    assert main(["demo-world", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "train.jsonl").read_bytes() == DEMO_TRAIN.read_bytes()
    assert (tmp_path / "eval.jsonl").read_bytes() == DEMO_EVAL.read_bytes()


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_errors_are_real_simulator_errors_and_tasks_complete():
    rows = _rows(DEMO_TRAIN) + _rows(DEMO_EVAL)
    assert len(rows) == 440
    cats_total = {"correct": 0, "refinement": 0, "erroneous": 0}
    for row in rows:
        messages = validate_messages(row["messages"])
        assert messages[0]["role"] == "system" and "Actions:" in messages[0]["content"]
        assistants = [m for m in messages if m["role"] == "assistant"]
        steps = demo_world.replay(row)
        # An erroneous turn is exactly an action the simulator rejects; every other one works.
        assert [valid for _, _, valid in steps] == [m["loss"] for m in assistants], row["id"]
        observations = [m["content"] for m in messages if m["role"] == "user"][1:]
        assert [f"Observation: {obs}" for _, obs, _ in steps[:-1]] == observations, row["id"]
        assert steps[-1][1].endswith("Task completed!")
        assert all(m["content"].startswith("Thought: ") and "\nAction: " in m["content"] for m in assistants)
        for c in assistant_categories(messages):
            if c:
                cats_total[c] += 1
    assert all(n > 100 for n in cats_total.values()), cats_total


def test_trajectories_are_mostly_short():
    tmpl = get_template("llama3", load_tokenizer("llama3"))
    lengths = np.array(
        [len(ids) for ids, _, _ in tmpl.encode_batch([r["messages"] for r in _rows(DEMO_TRAIN)])]
    )
    assert (lengths < 512).mean() > 0.6 and lengths.max() < 1024
