"""Data stage: trajectory schema, vendor-exact chat templates with refinement loss masks, and
the Grain packing pipeline. See docs/data.md.

Public entry points (import the submodules directly; this package import stays light):

* `agentrefine_jax.data.tokenizers.load_tokenizer(name_or_path)`
* `agentrefine_jax.data.templates.get_template(name, tokenizer)`
* `agentrefine_jax.data.react_tools.react_to_tool_row(row)` / `tool_row_to_react(row)`
* `agentrefine_jax.data.pipeline.make_pipeline(cfg, split=..., global_batch_size=..., num_epochs=...)`
"""

import pathlib

DEMO_DIR = pathlib.Path(__file__).resolve().parent / "demo"
DEMO_TRAIN = DEMO_DIR / "train.jsonl"
DEMO_EVAL = DEMO_DIR / "eval.jsonl"
