"""Paper setting for Llama-3-70B-Instruct: as 8B but max length 4096 (AgentRefine §4.1).
Needs a pod: see docs/scale.md (v5p-256) and `python -m agentrefine_jax.plan --config llama3_70b`."""

from agentrefine_jax.config import Config, paper_setting
from agentrefine_jax.models import preset


def config() -> Config:
    model = preset(
        "llama3_70b", param_dtype="float32", dtype="bfloat16", remat_policy="full", attention_block_size=1024
    )
    return paper_setting(model, tokenizer="llama3", max_length=4096, run_dir="runs/llama3_70b", tensor=4)
