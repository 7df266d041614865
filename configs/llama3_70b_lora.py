"""LoRA refinement tuning of Llama-3-70B-Instruct on a v5e-64 / v6e-64: the paper's data and
loss (AgentRefine §4.1: refinement masks, global batch 64, max length 4096, cosine, no warm-up,
10 epochs) on a frozen bfloat16 base with rank-16 adapters on every projection.

Why these numbers: rank 16 on all linear layers (q, k, v, o, gate, up, down) — QLoRA (Dettmers
et al. 2023) found all-layer adapters necessary to match full fine-tuning and rank beyond that
of little further use; alpha = 2 x rank. Learning rate 1e-4: QLoRA's value for its 33B/65B
models, half the 8B config's, as larger models take smaller LoRA steps stably. Full fine-tuning
of this model needs a v5p-256 (docs/scale.md); here the base is frozen in bfloat16 (2 bytes
per weight, no gradients or Adam moments for it) and only ~207M adapter weights train.
Mesh fsdp=8 x tensor=8 (a v5e/v6e-64 is an 8x8 torus, so tensor=4 does not map onto it);
micro-batches of 8 rows (one per fsdp shard) accumulate to the paper's 64.
Start from the HF checkpoint: `--set train.init_from_hf=/path/to/Meta-Llama-3-70B-Instruct`."""

import dataclasses

from agentrefine_jax.config import Config, LoraConfig, MeshConfig, load_config


def config() -> Config:
    cfg = load_config("llama3_70b")
    return dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, learning_rate=1e-4),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=8),
        train=dataclasses.replace(
            cfg.train,
            run_dir="runs/llama3_70b_lora",
            micro_batch_size=8,
            # A bfloat16 base, not the model's float32 param_dtype (base_dtype's default "auto"): half
            # the frozen base's memory (docs/lora.md's table). Meta's Llama 3 weights are stored in
            # bfloat16, so nothing is rounded; a float32 init_from_hf would be, and the checkpoint
            # records it (the exports merge into the stored weights; `export verify` reports the gap).
            lora=LoraConfig(rank=16, alpha=32.0, dropout=0.05, base_dtype="bfloat16"),
        ),
    )
