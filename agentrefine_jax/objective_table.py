"""The training objectives (`train.objective`): each declared once, here.

An entry says what an objective is to every stage that asks: its name (config validation), the
data it trains on (data/pipeline.py), whether its loss compares with a frozen reference policy
(the parameter mode: full fine-tuning then holds a copy; train/param_mode.py, train/planner.py),
the `train.*` knobs weighting its terms (config validation), the metrics its step logs and its
loss (train/step.py's one step body), and its name in the paper's tables (analyze/tables.py).

This module sits at the config layer (docs/architecture.md), below data and train, and imports
nothing: the loss is named here — an attribute of train/objectives.py, resolved there by
`objectives.loss_of` — not imported. Adding an objective is one entry in `TABLE` (and, for new
maths, its loss in train/objectives.py). tests/test_objective_table.py fails if an objective's
name is written anywhere else in the package.
"""

from __future__ import annotations

import dataclasses

# What a pair objective's step logs beside loss, loss_tokens, tokens and grad_norm (means over the
# global batch's pairs; sft_loss over its SFT tokens, 0 when the objective has no SFT term).
PAIR_METRICS = ("pair_loss", "sft_loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy", "pairs")


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str  # train.objective's value
    examples: bool  # trains on the split's SFT examples (the refinement-masked token loss)
    pairs: bool  # trains on the split's preference pairs (data/preference.py)
    reference: bool  # its loss compares with the frozen starting policy
    loss: str  # its loss: the name of a `Loss` in train/objectives.py
    metrics: tuple[str, ...] = ()  # logged beside loss, loss_tokens, tokens and grad_norm
    weights: tuple[str, ...] = ()  # the train.* knobs weighting its terms (all 0: nothing to train)
    label: str = ""  # appended to a run's name in analyze's tables ("" for plain refinement tuning)


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
