"""Table 2 ablation (Llama-3-8B): erroneous turns are trained too."""

from agentrefine_jax.config import Config, ablation


def config() -> Config:
    return ablation("llama3_8b", "erroneous_loss", loss_on=("correct", "refinement", "erroneous"))
