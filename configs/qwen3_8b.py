"""Paper setting (lr 5e-6, cosine, no warm-up, batch 64, 10 epochs) for Qwen3-8B, a family without
a vendor encoder: the tokenizer and chat template come from the model's own Hugging Face directory
(data.template=hf), and the weights from the same directory.

    python -m agentrefine_jax.train --config qwen3_8b \
        --set train.init_from_hf=PATH --set data.tokenizer=PATH --set data.train_files=...

PATH is a local download of Qwen/Qwen3-8B (nothing is downloaded at run time). Other sizes: the
`qwen3_*` presets in models/config.py.
"""

import dataclasses

from agentrefine_jax.config import Config, paper_setting
from agentrefine_jax.models import preset

HF_DIR = "models/Qwen3-8B"


def config() -> Config:
    model = preset("qwen3_8b", param_dtype="float32", dtype="bfloat16", remat_policy="full")
    cfg = paper_setting(model, tokenizer=HF_DIR, max_length=8192, run_dir="runs/qwen3_8b")
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, template="hf"),
        train=dataclasses.replace(cfg.train, init_from_hf=HF_DIR),
    )
