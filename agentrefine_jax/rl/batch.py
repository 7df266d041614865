"""A rollout phase's records and the arrays the train step reads from them.

The contract between the rollout collector (rl/rollout.py) and the GRPO loss (the objective table's
`grpo` entry; train/objectives.py): an episode is one token sequence, exactly as the policy saw it —
the first prompt, then each turn's sampled ids followed by the environment's answer and the chat
template's scaffolding. Only sampled ids are trainable; their log-probabilities are the ones the
engine computed while sampling (at temperature 1), so the trainer never re-tokenizes text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# The arrays `to_arrays` returns, all [rows, seq_len], aligned with the tokens (index t is token t):
# input_ids, positions, segment_ids (1 on an episode's tokens, 0 on padding), loss_mask (1 where the
# token was sampled by the policy), old_logprobs (its sampling log-probability, 0 elsewhere) and
# advantages (its episode's advantage, 0 elsewhere). The step scores target t (token t predicted from
# the tokens before it) with loss_mask[t], like the SFT batch.
ARRAY_KEYS = ("input_ids", "positions", "segment_ids", "loss_mask", "old_logprobs", "advantages")


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One sampled episode of one world."""

    world: int  # the world's seed (a training seed of the task)
    sample: int  # its index within the world's group (0 .. group_size - 1)
    token_ids: tuple[int, ...]  # the whole sequence, first prompt included
    trainable: tuple[bool, ...]  # per token: sampled by the policy
    logprobs: tuple[float, ...]  # per token: the sampling log-probability of a trainable token, else 0.0
    turn_rewards: tuple[float, ...]  # the environment's reward after each action
    success: bool
    progress: float  # in [0, 1]: the task's progress rate at the episode's end
    turns: int  # actions taken

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.trainable) != n or len(self.logprobs) != n:
            raise ValueError(
                f"rollout of world {self.world}: {n} tokens but {len(self.trainable)} trainable flags "
                f"and {len(self.logprobs)} log-probabilities"
            )

    def reward(self, kind: str, progress_weight: float) -> float:
        """The episode's scalar reward: success (0/1), or success + progress_weight * progress."""
        if kind == "success":
            return float(self.success)
        if kind == "progress":
            return float(self.success) + progress_weight * float(self.progress)
        raise ValueError(f"reward must be 'success' or 'progress', got {kind!r}")


def group_advantages(rewards: Sequence[float], groups: Sequence[int], norm: str = "std") -> np.ndarray:
    """GRPO's advantages: each reward minus its group's mean, divided by the group's standard deviation
    (population std, + 1e-6) when `norm` is "std"; "none" keeps the mean-centred reward (Dr. GRPO).
    A group whose rewards are all equal gets advantage 0 (nothing to learn from it)."""
    if norm not in ("std", "none"):
        raise ValueError(f"advantage_norm must be 'std' or 'none', got {norm!r}")
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(groups)
    if r.shape != g.shape:
        raise ValueError(f"{r.size} rewards for {g.size} group labels")
    out = np.zeros_like(r)
    for label in np.unique(g):
        idx = g == label
        centred = r[idx] - r[idx].mean()
        out[idx] = centred / (r[idx].std() + 1e-6) if norm == "std" else centred
    return out.astype(np.float32)


def to_arrays(
    rollouts: Sequence[Rollout], advantages: Sequence[float], seq_len: int
) -> tuple[dict[str, np.ndarray], int]:
    """One row per rollout, right-padded to `seq_len` (ARRAY_KEYS), and how many rollouts were cut at
    `seq_len` (their tokens past it are dropped, so none of them is trained on)."""
    if len(rollouts) != len(advantages):
        raise ValueError(f"{len(advantages)} advantages for {len(rollouts)} rollouts")
    b = len(rollouts)
    out = {
        "input_ids": np.zeros((b, seq_len), np.int32),
        "positions": np.zeros((b, seq_len), np.int32),
        "segment_ids": np.zeros((b, seq_len), np.int32),
        "loss_mask": np.zeros((b, seq_len), np.int32),
        "old_logprobs": np.zeros((b, seq_len), np.float32),
        "advantages": np.zeros((b, seq_len), np.float32),
    }
    cut = 0
    for i, (ro, adv) in enumerate(zip(rollouts, advantages, strict=True)):
        n = min(len(ro.token_ids), seq_len)
        cut += len(ro.token_ids) > seq_len
        mask = np.asarray(ro.trainable[:n], np.int32)
        out["input_ids"][i, :n] = ro.token_ids[:n]
        out["positions"][i, :n] = np.arange(n)
        out["segment_ids"][i, :n] = 1
        out["loss_mask"][i, :n] = mask
        out["old_logprobs"][i, :n] = np.asarray(ro.logprobs[:n], np.float32) * mask
        out["advantages"][i, :n] = np.float32(adv) * mask
    return out, cut
