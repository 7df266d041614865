"""One held-out chat turn, answered by a run's starting model and by its trained export.

What the demo shows a new user in a few seconds: the same conversation (the first assistant turn
of a held-out row of the run's eval data) answered greedily before and after refinement tuning.
The starting model is the run's `train.init_from_hf` directory; the trained one is the run's
end-of-run export (`train.export_hf_at_end`), or the run's latest checkpoint without one.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from agentrefine_jax.paths import as_path, join


class BeforeAfterError(ValueError):
    """The run cannot be compared (no starting directory, no eval row, no export): one line."""


@dataclasses.dataclass(frozen=True)
class Turn:
    prompt: list[dict[str, Any]]  # the conversation up to the assistant turn
    reference: str  # what the data's assistant said there
    before: str
    after: str


def run_sources(run_dir: str) -> tuple[str, str, list[str]]:
    """(starting HF dir, trained model path, eval files) as the run's config.json records them."""
    config_path = as_path(run_dir) / "config.json"
    if not config_path.exists():
        raise BeforeAfterError(f"{run_dir} is not a training run directory (no config.json)")
    cfg = json.loads(config_path.read_text())
    start = cfg.get("train", {}).get("init_from_hf")
    if not start:
        raise BeforeAfterError(f"the run {run_dir} did not start from an HF directory (train.init_from_hf)")
    export = cfg.get("train", {}).get("export_hf_at_end")
    trained = join(run_dir, export) if export and export != "none" else run_dir
    if not as_path(trained).exists():
        raise BeforeAfterError(f"the run's trained model {trained} does not exist (did the run finish?)")
    files = list(cfg.get("data", {}).get("eval_files") or ())
    if not files:
        raise BeforeAfterError(f"the run {run_dir} has no data.eval_files to take a held-out turn from")
    return str(start), str(trained), files


def first_turn(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], str] | None:
    """The conversation up to its first assistant turn, and that turn's content."""
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            prompt = [{"role": x["role"], "content": x["content"]} for x in messages[:i]]
            return prompt, str(m.get("content", ""))
    return None


def held_out_turn(eval_file: str, row: int) -> tuple[list[dict[str, Any]], str]:
    with pathlib.Path(eval_file).open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == row:
                found = first_turn(json.loads(line).get("messages", []))
                if found is None:
                    raise BeforeAfterError(f"{eval_file} row {row} has no assistant turn")
                return found
    raise BeforeAfterError(f"{eval_file} has no row {row}")


def compare(run_dir: str, *, row: int = 0, max_new_tokens: int = 64, dtype: str | None = None) -> Turn:
    """Greedy replies of the starting and the trained model to one held-out turn."""
    from agentrefine_jax.inference.chat import ChatGenerator

    start, trained, files = run_sources(run_dir)
    prompt, reference = held_out_turn(files[0], row)
    replies = []
    for path in (start, trained):
        gen = ChatGenerator.from_checkpoint(path, dtype=dtype)
        (done,) = gen.complete([prompt], max_new_tokens=max_new_tokens)
        replies.append(done.text.strip())
        del gen  # one model in memory at a time
    return Turn(prompt, reference, replies[0], replies[1])


def format_turn(turn: Turn) -> str:
    last = turn.prompt[-1]["content"] if turn.prompt else ""
    lines = [
        "held-out turn (the last message the model sees):",
        *("  " + line for line in last.splitlines()),
        "",
        "before tuning:",
        *("  " + line for line in (turn.before or "(empty)").splitlines()),
        "",
        "after tuning:",
        *("  " + line for line in (turn.after or "(empty)").splitlines()),
        "",
        "the data's answer:",
        *("  " + line for line in turn.reference.splitlines()),
    ]
    return "\n".join(lines)
