"""Paper Table 2 ablation on the Llama-3-8B setting: erroneous loss."""

import dataclasses
import importlib.util
import pathlib

from agentrefine_jax.config import Config

_BASE = pathlib.Path(__file__).with_name("llama3_8b.py")


def config() -> Config:
    spec = importlib.util.spec_from_file_location("llama3_8b_base", _BASE)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    cfg = base.config()
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, loss_on=("correct", "refinement", "erroneous")),
        train=dataclasses.replace(cfg.train, run_dir="runs/llama3_8b_ablation_erroneous_loss"),
    )
