"""Paper setting for Llama-3-8B-Instruct (AgentRefine §4.1): lr 5e-6, cosine, no warm-up,
global batch 64, max length 8192, 10 epochs. Start from the HF checkpoint with
`--set train.init_from_hf=/path/to/Meta-Llama-3-8B-Instruct`."""

from agentrefine_jax.config import Config, DataConfig, MeshConfig, OptimConfig, TrainConfig
from agentrefine_jax.models import preset


def config() -> Config:
    return Config(
        model=preset(
            "llama3_8b",
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
            loss_on=("correct", "refinement"),
            max_length=8192,
        ),
        optim=OptimConfig(learning_rate=5e-6, schedule="cosine", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        train=TrainConfig(
            run_dir="runs/llama3_8b",
            global_batch_size=64,
            num_epochs=10,
            checkpoint_every=200,
            loss_chunk_size=1024,
        ),
    )
