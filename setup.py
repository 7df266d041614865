"""Package layout that pyproject.toml cannot express: `configs/` stays at the repository root
(plain Python a user reads and edits) and ships inside the wheel as `agentrefine_jax.configs`,
so `--config llama3_8b` resolves after a regular, non-editable install too."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["agentrefine_jax", "agentrefine_jax.*"]), "agentrefine_jax.configs"],
    package_dir={"agentrefine_jax.configs": "configs"},
)
