"""Reinforcement learning on the one episode engine (docs/rl.md): rollouts played in the trainer's
own process, each episode one token sequence whose trained ids are the ids the model sampled, and
the GRPO update. This stage sits above `eval` (it plays eval's tasks) and `train` (it runs train's
step)."""
