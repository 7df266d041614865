"""Table 2 ablation (Llama-3-8B): refinement turns stay in context but carry no loss."""

from agentrefine_jax.config import Config, ablation


def config() -> Config:
    return ablation("llama3_8b", "no_refinement_loss", loss_on=("correct",))
