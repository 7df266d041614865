"""The tests' fast config: a tiny random Llama-architecture model (real Llama-3 tokenizer and
chat template) refinement-tuned on the demo trajectories. Learns visibly in about a minute on 2
CPU cores; exports to a Hugging Face directory at the end. (`configs/demo.py` is the real model.)"""

import pathlib

import agentrefine_jax
from agentrefine_jax.config import Config, DataConfig, MeshConfig, OptimConfig, TrainConfig
from agentrefine_jax.models import preset

DEMO_DATA = pathlib.Path(agentrefine_jax.__file__).parent / "data" / "demo"


def config() -> Config:
    return Config(
        model=preset("tiny"),
        data=DataConfig(
            train_files=(str(DEMO_DATA / "train.jsonl"),),
            eval_files=(str(DEMO_DATA / "eval.jsonl"),),
            tokenizer="llama3",
            template="llama3",
            loss_on=("correct", "refinement"),
            max_length=512,
            seed=0,
        ),
        optim=OptimConfig(learning_rate=3e-3, schedule="cosine", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        train=TrainConfig(
            run_dir="runs/tiny",
            global_batch_size=4,
            num_epochs=1,
            max_steps=30,
            log_every=1,
            eval_every=15,
            checkpoint_every=15,
            loss_chunk_size=128,
            export_hf_at_end="hf",
            export_dtype="float32",
            # With train.init_from_hf=DIR the model, tokenizer and chat template are DIR's.
            model_source="auto",
        ),
    )
