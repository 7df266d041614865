"""Table 2 ablation (Llama-3-8B): erroneous turns and their error feedback removed."""

from agentrefine_jax.config import Config, ablation


def config() -> Config:
    return ablation("llama3_8b", "no_refinement_data", drop_refinement_data=True)
