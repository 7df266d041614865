"""Paper setting for Mistral-7B-Instruct-v0.3: lr 5e-6, cosine, no warm-up, batch 64,
max length 8192, 10 epochs, with the Mistral v0.3 tokenizer and [INST] template."""

from agentrefine_jax.config import Config, paper_setting
from agentrefine_jax.models import preset


def config() -> Config:
    model = preset(
        "mistral_7b_v0.3",
        param_dtype="float32",
        dtype="bfloat16",
        remat_policy="full",
        attention_block_size=1024,
    )
    return paper_setting(model, tokenizer="mistral", max_length=8192, run_dir="runs/mistral_7b")
