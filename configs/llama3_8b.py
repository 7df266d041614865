"""Paper setting for Llama-3-8B-Instruct (AgentRefine §4.1): lr 5e-6, cosine, no warm-up,
global batch 64, max length 8192, 10 epochs. Start from the HF checkpoint with
`--set train.init_from_hf=/path/to/Meta-Llama-3-8B-Instruct`."""

import dataclasses

from agentrefine_jax.config import Config, paper_setting
from agentrefine_jax.models import preset


def config() -> Config:
    # MLP in 1024-token chunks and 512-token loss chunks: the layer backward's and the loss's
    # working sets (docs/scale.md, "Where the 8B step's memory goes").
    model = preset(
        "llama3_8b",
        param_dtype="float32",
        dtype="bfloat16",
        remat_policy="full",
        attention_block_size=1024,
        mlp_chunk_size=1024,
    )
    cfg = paper_setting(model, tokenizer="llama3", max_length=8192, run_dir="runs/llama3_8b")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk_size=512))
