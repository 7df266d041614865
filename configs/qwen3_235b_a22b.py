"""Paper setting (lr 5e-6, cosine, no warm-up, batch 64, 10 epochs) for Qwen3-235B-A22B, the large
mixture-of-experts Qwen3 (94 layers, 128 experts, top 8: 235B parameters, 22B active per token), for
the planner first: `python -m agentrefine_jax.plan --config qwen3_235b_a22b --topology v5p-128`.
As `configs/qwen3_30b_a3b.py` but for the preset; the tokenizer, chat template and weights come
from the model's own Hugging Face directory. With a `tensor` mesh axis (which divides the 128
experts) the experts run expert-parallel over it (models/moe.py; docs/scale.md).

    python -m agentrefine_jax.train --config qwen3_235b_a22b \\
        --set train.init_from_hf=PATH --set data.tokenizer=PATH --set data.train_files=...

PATH is a local download of Qwen/Qwen3-235B-A22B (nothing is downloaded at run time).
"""

import dataclasses

from agentrefine_jax.config import Config, paper_setting
from agentrefine_jax.models import preset

HF_DIR = "models/Qwen3-235B-A22B"


def config() -> Config:
    # The 30B-A3B config's settings (see there): XLA attention in 1024-query blocks where splash
    # does not run, the routed experts in 1024-token chunks, each rematerialised on its own.
    model = preset(
        "qwen3_235b_a22b",
        param_dtype="float32",
        dtype="bfloat16",
        remat_policy="full",
        attention_block_size=1024,
        mlp_chunk_size=1024,
    )
    cfg = paper_setting(model, tokenizer=HF_DIR, max_length=8192, run_dir="runs/qwen3_235b_a22b")
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, template="hf"),
        train=dataclasses.replace(cfg.train, init_from_hf=HF_DIR),
    )
