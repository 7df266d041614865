"""The training objectives (`train.objective`): each declared once, here.

An entry says what an objective is to every stage that asks: its name (config validation), the
data it trains on (data/pipeline.py: the split's examples or pairs; or the rollouts the RL loop
collects, rl/), whether its loss compares with a frozen reference policy (the parameter mode:
full fine-tuning then holds a copy; train/param_mode.py, train/planner.py) — always, or only
while a config knob such as rl.kl_coef is > 0 —, the `train.*` knobs weighting its terms (config
validation), the metrics its step logs and its loss (train/step.py's one step body), and its name
in the paper's tables (analyze/tables.py).

This module sits at the config layer (docs/architecture.md), below data and train, and imports
nothing: the loss is named here — an attribute of train/objectives.py, resolved there by
`objectives.loss_of` — not imported. Adding an objective is one entry in `TABLE` (and, for new
maths, its loss in train/objectives.py). tests/test_objective_table.py fails if an objective's
name is written anywhere else in the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# What a pair objective's step logs beside loss, loss_tokens, tokens, projected_tokens and grad_norm
# (means over the global batch's pairs; sft_loss over its SFT tokens, 0 when the objective has no SFT
# term).
PAIR_METRICS = ("pair_loss", "sft_loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy", "pairs")
# What a policy-gradient objective's step logs (over the global batch's trainable tokens; see
# train/objectives.py's PolicyGradient): the share of tokens whose ratio was clipped, the mean k3
# KL to the reference (0 when off), the policy's mean entropy, the mean ratio, the advantages'
# mean and std, and max |log p - old log p| (the trainer's forward vs the rollout's sampling: on a
# phase's first update, with the parameters that sampled, their mismatch alone; after, plus drift).
RL_METRICS = (
    "clip_fraction", "kl", "entropy", "ratio_mean", "advantage_mean", "advantage_std", "max_abs_logp_delta",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str  # train.objective's value
    examples: bool  # trains on the split's SFT examples (the refinement-masked token loss)
    pairs: bool  # trains on the split's preference pairs (data/preference.py)
    reference: bool  # its loss compares with the frozen starting policy (see `reference_knob`)
    loss: str  # its loss: the name of a `Loss` in train/objectives.py
    metrics: tuple[str, ...] = ()  # logged beside loss, loss_tokens, tokens, projected_tokens and grad_norm
    weights: tuple[str, ...] = ()  # the train.* knobs weighting its terms (all 0: nothing to train)
    label: str = ""  # appended to a run's name in analyze's tables ("" for plain refinement tuning)
    # Trains on the rollouts the RL loop collects (rl/batch.py's arrays), not on the split's data:
    # the data pipeline builds nothing for it.
    rollouts: bool = False
    # "section.field" of a config knob that switches the reference on (while it is > 0) and weighs
    # its term; "" when `reference` alone decides. A LoRA run's reference costs no memory either way
    # (its base, adapters off), but a full run's copy does: a knob at 0 holds none.
    reference_knob: str = ""

    @property
    def reference_field(self) -> str:
        """The reference knob's field name (its key in the step's knobs, train/step.py), or ""."""
        return self.reference_knob.rpartition(".")[2]

    def holds_reference(self, knob: float | None = None) -> bool:
        """Whether the loss compares with the reference, given the reference knob's value (None:
        its default, off). An entry without a knob: `reference`."""
        if not self.reference_knob:
            return self.reference
        return self.reference and knob is not None and knob > 0

    def reference_in(self, cfg: Any) -> bool:
        """`holds_reference` with the knob's value read from a config (config.Config)."""
        if not self.reference_knob:
            return self.reference
        section, _, field = self.reference_knob.partition(".")
        return self.holds_reference(getattr(getattr(cfg, section), field))


TABLE: tuple[Objective, ...] = (
    Objective("sft", examples=True, pairs=False, reference=False, loss="TOKEN_NLL"),
    Objective(
        "dpo", examples=False, pairs=True, reference=True, loss="SIGMOID_DPO", metrics=PAIR_METRICS,
        label="(DPO only)",
    ),
    Objective(
        "orpo", examples=False, pairs=True, reference=False, loss="ODDS_RATIO", metrics=PAIR_METRICS,
        label="(ORPO)",
    ),
    Objective(
        "sft+dpo", examples=True, pairs=True, reference=True, loss="TOKEN_NLL_AND_SIGMOID_DPO",
        metrics=PAIR_METRICS, weights=("sft_weight", "dpo_weight"), label="+ DPO",
    ),
    # Multi-turn GRPO (docs/rl.md): trains on rollouts; the k3 KL term, and with it the
    # reference, only while rl.kl_coef > 0.
    Objective(
        "grpo", examples=False, pairs=False, reference=True, loss="CLIPPED_POLICY_GRADIENT",
        metrics=RL_METRICS, label="+ GRPO", rollouts=True, reference_knob="rl.kl_coef",
    ),
)  # fmt: skip
NAMES: tuple[str, ...] = tuple(o.name for o in TABLE)
DEFAULT: str = TABLE[0].name  # train.objective's default: the paper's refinement tuning
BY_NAME: dict[str, Objective] = {o.name: o for o in TABLE}


def get(name: str) -> Objective:
    """The entry of `name`; ValueError naming the choices for any other."""
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"objective must be one of {NAMES}, got {name!r}") from None
