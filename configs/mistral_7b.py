"""Paper setting for Mistral-7B-Instruct-v0.3: lr 5e-6, cosine, no warm-up, batch 64,
max length 8192, 10 epochs, with the Mistral v0.3 tokenizer and [INST] template."""

from agentrefine_jax.config import Config, DataConfig, MeshConfig, OptimConfig, TrainConfig
from agentrefine_jax.models import preset


def config() -> Config:
    return Config(
        model=preset(
            "mistral_7b_v0.3",
            param_dtype="float32",
            dtype="bfloat16",
            remat_policy="full",
            scan_layers=True,
            attention_block_size=1024,
        ),
        data=DataConfig(
            train_files=("data/agentrefine/train.jsonl",),
            tokenizer="mistral",
            template="mistral",
            max_length=8192,
        ),
        optim=OptimConfig(learning_rate=5e-6, schedule="cosine", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        train=TrainConfig(
            run_dir="runs/mistral_7b", global_batch_size=64, num_epochs=10, checkpoint_every=200
        ),
    )
