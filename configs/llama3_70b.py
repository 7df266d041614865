"""Paper setting for Llama-3-70B-Instruct: as 8B but max length 4096 (AgentRefine §4.1).
Needs a pod: see README (v5p-256 example) and `python -m agentrefine_jax.plan --config llama3_70b`."""

from agentrefine_jax.config import Config, DataConfig, MeshConfig, OptimConfig, TrainConfig
from agentrefine_jax.models import preset


def config() -> Config:
    return Config(
        model=preset(
            "llama3_70b",
            param_dtype="float32",
            dtype="bfloat16",
            remat_policy="full",
            scan_layers=True,
            attention_block_size=1024,
        ),
        data=DataConfig(
            train_files=("data/agentrefine/train.jsonl",),
            tokenizer="llama3",
            template="llama3",
            max_length=4096,
        ),
        optim=OptimConfig(learning_rate=5e-6, schedule="cosine", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=4),
        train=TrainConfig(
            run_dir="runs/llama3_70b", global_batch_size=64, num_epochs=10, checkpoint_every=100
        ),
    )
