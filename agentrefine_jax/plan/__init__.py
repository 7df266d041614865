"""The training planner's CLI; the planner itself is `agentrefine_jax.train.planner`."""
