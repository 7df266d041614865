"""Paper setting (lr 5e-6, cosine, no warm-up, batch 64, 10 epochs) for Qwen3-30B-A3B, the
mixture-of-experts Qwen3 (48 layers, 128 experts, top 8: 30.5B parameters, 3.3B active per token).
Like Qwen3-8B, the tokenizer, chat template and weights come from the model's own Hugging Face
directory; the experts are split over the fsdp mesh axis (sharding.py's `experts` rule), and run
expert-parallel over `tensor` when the mesh has one (models/moe.py; docs/scale.md).

    python -m agentrefine_jax.train --config qwen3_30b_a3b \\
        --set train.init_from_hf=PATH --set data.tokenizer=PATH --set data.train_files=...

PATH is a local download of Qwen/Qwen3-30B-A3B (nothing is downloaded at run time).
"""

import dataclasses

from agentrefine_jax.config import Config, paper_setting
from agentrefine_jax.models import preset

HF_DIR = "models/Qwen3-30B-A3B"


def config() -> Config:
    # attention_block_size: the XLA attention path's query blocks (CPU, GPU, `model.attention=xla`);
    # on TPU the splash kernel runs and tiles scores itself, so it changes nothing there, but the
    # planner traces the XLA path and would otherwise count whole [S, S] score matrices.
    # mlp_chunk_size: the routed experts in 1024-token chunks, each rematerialised on its own (exact:
    # routing is per token): one chunk's sorted assignments and expert activations live in the
    # backward pass, not the sequence's. v5p-32, XLA TPU compiler (libtpu 0.0.42.1): 64.92 -> 52.62
    # GiB per device (docs/scale.md).
    model = preset(
        "qwen3_30b_a3b",
        param_dtype="float32",
        dtype="bfloat16",
        remat_policy="full",
        attention_block_size=1024,
        mlp_chunk_size=1024,
    )
    cfg = paper_setting(model, tokenizer=HF_DIR, max_length=8192, run_dir="runs/qwen3_30b_a3b")
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, template="hf"),
        train=dataclasses.replace(cfg.train, init_from_hf=HF_DIR),
    )
