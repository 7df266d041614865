"""The paper's published numbers, transcribed from `../shared/PAPER.md` (Fu et al., ICLR 2025).

Data only: `analyze report --paper-rows` and `analyze judge-agreement --paper-rows` print these as
reference rows labelled "paper: ...", never as results of this project. Success / progress in %;
None where the paper prints "-"; `held_in` names the tasks the paper marks `*` (training data
sampled in that environment).
"""

from __future__ import annotations

import dataclasses

from agentrefine_jax.eval import registry

# The paper's task columns, in its order (the registry owns the tasks and their problem counts).
TASKS = tuple(registry.AGENTBOARD_EPISODES)
SOURCE = "Fu et al., AgentRefine (ICLR 2025, arXiv 2501.01702)"


@dataclasses.dataclass(frozen=True)
class PaperRow:
    model: str
    # task -> (success %, progress %)
    scores: dict[str, tuple[float | None, float | None]]
    held_in: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PaperPerturbRow:
    model: str
    # (success %, progress %) each
    original: tuple[float, float]
    perturbations: tuple[tuple[float, float], ...]
    average: tuple[float, float]
    std: tuple[float, float]


# Table 1 (main results).
TABLE1: tuple[PaperRow, ...] = (
    PaperRow(
        "GPT-4o",
        {
            "alfworld": (66.4, 79.9),
            "babyai": (48.2, 64.1),
            "sciworld": (40.0, 76.9),
            "pddl": (61.7, 69.8),
            "jericho": (10.0, 34.0),
        },
        held_in=(),
    ),
    PaperRow(
        "GPT-4o-mini",
        {
            "alfworld": (37.3, 65.0),
            "babyai": (36.6, 51.9),
            "sciworld": (23.3, 49.8),
            "pddl": (25.0, 49.1),
            "jericho": (10.0, 28.5),
        },
        held_in=(),
    ),
    PaperRow(
        "LLaMA-3-8B-Instruct",
        {
            "alfworld": (22.4, 46.1),
            "babyai": (45.5, 56.5),
            "sciworld": (7.8, 41.1),
            "pddl": (10.0, 38.4),
            "jericho": (0.0, 24.3),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentGen (8B)",
        {
            "alfworld": (29.1, 47.6),
            "babyai": (20.5, 35.0),
            "sciworld": (None, None),
            "pddl": (11.7, 23.0),
            "jericho": (None, None),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentGym (8B)",
        {
            "alfworld": (61.9, 76.9),
            "babyai": (47.3, 61.4),
            "sciworld": (18.9, 47.5),
            "pddl": (1.7, 16.6),
            "jericho": (0.0, 12.9),
        },
        held_in=("alfworld", "babyai", "sciworld"),
    ),
    PaperRow(
        "Agent-FLAN (8B)",
        {
            "alfworld": (67.2, 79.7),
            "babyai": (25.0, 35.3),
            "sciworld": (1.1, 10.9),
            "pddl": (8.3, 25.5),
            "jericho": (0.0, 10.1),
        },
        held_in=("alfworld",),
    ),
    PaperRow(
        "AgentRefine (8B)",
        {
            "alfworld": (44.8, 63.8),
            "babyai": (37.5, 50.4),
            "sciworld": (14.4, 42.6),
            "pddl": (16.6, 37.8),
            "jericho": (10.0, 32.3),
        },
        held_in=(),
    ),
    PaperRow(
        "Mistral-7B-Instruct-v0.3",
        {
            "alfworld": (12.4, 35.9),
            "babyai": (36.6, 45.8),
            "sciworld": (6.7, 24.7),
            "pddl": (13.3, 27.8),
            "jericho": (0.0, 17.3),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentGym (Mistral)",
        {
            "alfworld": (76.9, 86.7),
            "babyai": (40.2, 56.3),
            "sciworld": (15.6, 48.3),
            "pddl": (1.7, 7.3),
            "jericho": (0.0, 13.0),
        },
        held_in=("alfworld", "babyai", "sciworld"),
    ),
    PaperRow(
        "Agent-FLAN (Mistral)",
        {
            "alfworld": (77.6, 87.6),
            "babyai": (15.2, 21.0),
            "sciworld": (0.0, 6.7),
            "pddl": (0.0, 3.2),
            "jericho": (0.0, 0.7),
        },
        held_in=("alfworld",),
    ),
    PaperRow(
        "AgentRefine (Mistral)",
        {
            "alfworld": (51.4, 68.8),
            "babyai": (25.9, 42.4),
            "sciworld": (4.4, 22.4),
            "pddl": (11.7, 32.8),
            "jericho": (5.0, 28.8),
        },
        held_in=(),
    ),
    PaperRow(
        "LLaMA-3-70B-Instruct",
        {
            "alfworld": (67.2, 75.2),
            "babyai": (48.2, 61.8),
            "sciworld": (42.2, 75.4),
            "pddl": (55.0, 79.8),
            "jericho": (25.0, 46.4),
        },
        held_in=(),
    ),
    PaperRow(
        "Agent-FLAN (70B)",
        {
            "alfworld": (80.5, 86.8),
            "babyai": (32.1, 41.2),
            "sciworld": (5.5, 16.4),
            "pddl": (25.0, 53.7),
            "jericho": (0.0, 13.6),
        },
        held_in=("alfworld",),
    ),
    PaperRow(
        "AgentRefine (70B)",
        {
            "alfworld": (67.2, 72.1),
            "babyai": (44.6, 59.7),
            "sciworld": (17.7, 46.4),
            "pddl": (38.3, 58.6),
            "jericho": (15.0, 37.2),
        },
        held_in=(),
    ),
)

# Table 2 (ablations, 8,000 examples, LLaMA-3-8B).
TABLE2: tuple[PaperRow, ...] = (
    PaperRow(
        "AgentRefine",
        {
            "alfworld": (48.5, 61.5),
            "babyai": (37.1, 51.7),
            "sciworld": (7.7, 33.1),
            "pddl": (21.7, 37.4),
            "jericho": (5.0, 26.2),
        },
        held_in=(),
    ),
    PaperRow(
        "w/o refinement loss",
        {
            "alfworld": (40.3, 58.8),
            "babyai": (34.8, 45.6),
            "sciworld": (4.4, 22.7),
            "pddl": (20.0, 37.4),
            "jericho": (0.0, 16.1),
        },
        held_in=(),
    ),
    PaperRow(
        "w/o refinement data",
        {
            "alfworld": (49.3, 65.2),
            "babyai": (30.4, 43.1),
            "sciworld": (5.5, 21.3),
            "pddl": (11.7, 32.5),
            "jericho": (0.0, 13.8),
        },
        held_in=(),
    ),
    PaperRow(
        "w/ erroneous loss",
        {
            "alfworld": (29.9, 43.9),
            "babyai": (23.2, 31.6),
            "sciworld": (3.3, 19.0),
            "pddl": (8.3, 28.3),
            "jericho": (5.0, 18.4),
        },
        held_in=(),
    ),
)

# Table 3 (ALFWorld, original and five action-description perturbations).
TABLE3: tuple[PaperPerturbRow, ...] = (
    PaperPerturbRow(
        "LLaMA3-8B-Instruct",
        original=(22.4, 46.1),
        perturbations=((23.1, 45.6), (24.6, 45.0), (17.9, 45.1), (17.9, 45.1), (22.4, 46.1)),
        average=(21.4, 45.5),
        std=(2.68, 0.47),
    ),
    PaperPerturbRow(
        "AgentGym",
        original=(61.9, 76.9),
        perturbations=((29.1, 59.2), (49.2, 65.3), (32.8, 53.9), (38.8, 48.2), (5.9, 28.7)),
        average=(36.3, 55.4),
        std=(19.97, 16.66),
    ),
    PaperPerturbRow(
        "Agent-FLAN",
        original=(67.2, 79.7),
        perturbations=((21.6, 58.8), (51.4, 71.3), (27.6, 53.5), (52.2, 67.9), (1.5, 19.7)),
        average=(36.9, 58.5),
        std=(21.98, 22.53),
    ),
    PaperPerturbRow(
        "AgentRefine",
        original=(44.8, 63.8),
        perturbations=((50.0, 66.5), (51.5, 66.7), (54.5, 70.0), (45.5, 60.6), (44.8, 63.8)),
        average=(48.5, 65.2),
        std=(3.73, 3.56),
    ),
)

# Table 4 (greedy vs Best-of-N).
TABLE4: tuple[PaperRow, ...] = (
    PaperRow(
        "AgentGym greedy",
        {
            "alfworld": (61.9, 76.9),
            "babyai": (47.3, 61.4),
            "sciworld": (18.9, 47.5),
            "pddl": (1.7, 16.6),
            "jericho": (0.0, 12.9),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentGym BoN",
        {
            "alfworld": (99.3, 99.3),
            "babyai": (73.2, 87.2),
            "sciworld": (58.9, 85.6),
            "pddl": (16.6, 42.1),
            "jericho": (5.0, 22.2),
        },
        held_in=(),
    ),
    PaperRow(
        "Agent-FLAN greedy",
        {
            "alfworld": (67.2, 79.7),
            "babyai": (25.0, 35.3),
            "sciworld": (1.1, 10.9),
            "pddl": (8.3, 25.5),
            "jericho": (0.0, 10.1),
        },
        held_in=(),
    ),
    PaperRow(
        "Agent-FLAN BoN",
        {
            "alfworld": (85.5, 98.1),
            "babyai": (43.8, 56.7),
            "sciworld": (10.0, 33.5),
            "pddl": (11.7, 39.8),
            "jericho": (5.0, 22.2),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentRefine greedy",
        {
            "alfworld": (44.8, 63.8),
            "babyai": (37.5, 50.4),
            "sciworld": (14.4, 42.6),
            "pddl": (16.6, 37.8),
            "jericho": (10.0, 32.3),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentRefine BoN",
        {
            "alfworld": (93.3, 96.6),
            "babyai": (67.0, 81.5),
            "sciworld": (40.0, 71.0),
            "pddl": (30.0, 57.3),
            "jericho": (25.0, 52.5),
        },
        held_in=(),
    ),
)

# Table 5 (synthesis model: 4,000 examples synthesised with deepseek-v2.5 vs GPT-4o).
TABLE5: tuple[PaperRow, ...] = (
    PaperRow(
        "Agent-FLAN",
        {
            "alfworld": (67.2, 79.7),
            "babyai": (25.0, 35.3),
            "sciworld": (1.1, 10.9),
            "pddl": (8.3, 25.5),
            "jericho": (0.0, 10.1),
        },
        held_in=("alfworld",),
    ),
    PaperRow(
        "AgentRefine-DeepSeek",
        {
            "alfworld": (32.0, 44.2),
            "babyai": (36.6, 48.1),
            "sciworld": (2.2, 21.6),
            "pddl": (16.6, 36.7),
            "jericho": (5.0, 29.0),
        },
        held_in=(),
    ),
    PaperRow(
        "AgentRefine-GPT-4o",
        {
            "alfworld": (36.6, 55.9),
            "babyai": (33.9, 44.1),
            "sciworld": (11.1, 31.4),
            "pddl": (18.3, 37.9),
            "jericho": (10.0, 28.8),
        },
        held_in=(),
    ),
)

# Figure 8 (HotpotQA): model -> (EM %, F1 %).
FIGURE8: dict[str, tuple[float, float]] = {
    "LLaMA-3-8B-Instruct": (29.3, 36.6),
    "AgentGym": (28.0, 37.4),
    "Agent-FLAN": (24.6, 32.4),
    "AgentRefine": (37.0, 44.6),
}

# Figure 10 (GPT-4's refinement judgement vs a human's, 100 turns). "right" = the turn needs no
# refinement. Keys: (human, judge).
FIGURE10: dict[tuple[str, str], int] = {
    ("right", "right"): 47,
    ("right", "wrong"): 9,
    ("wrong", "right"): 3,
    ("wrong", "wrong"): 41,
}
