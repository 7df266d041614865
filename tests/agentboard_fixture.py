"""Small AgentBoard-layout checkouts written by the tests themselves (no AgentBoard code or data).

Everything here is our own text in AgentBoard's file layout: prompt JSONs, an eval config, Python files
holding the literals the protocol reads with `ast`, `data/<task>/test.jsonl` lines, a tiny gripper domain.
"""

from __future__ import annotations

import json
import pathlib

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "agentboard"
PDDL_DIR = "agentboard/environment/pddl_env/pddlgym/pddl"

CONFIG = """\
run:
  max_num_steps: 30
agent:
  name: VanillaAgent
  memory_size: 100
  need_goal: True
env:
  pddl:
    name: pddl
    game_name: [gripper]
    env_num_per_task: 20
    check_actions: "check valid actions"
    init_prompt_path: ${PROJECT_PATH}/agentboard/prompts/VanillaAgent/pddl_vanilla_prompt.json
    label_path: ${PROJECT_PATH}/data/pddl/test.jsonl
  scienceworld:
    name: scienceworld
    envStepLimit: 30
    check_inventory: True
    check_actions: check valid actions
"""

PDDL_PROMPT = {
    "gripper": {
        "instruction": "Move balls with a two-armed robot.",
        "examples": ["Goal: ball in b\nAction: move a b"],
        "system_msg": "You plan.",
    }
}
SCIWORLD_PROMPT = {
    "instruction": "Do science.",
    "examples": "ACTION: look around",
    "system_msg": "Be careful.",
}

# Our own rendering table (pddl_env.py's `predicate_map` has this shape); `free` twice: the last one wins.
PDDL_ENV = """\
def step_text(kind):
    if kind:
        return "The action is not valid and therefore takes no effect. Remember the restriction of actions."
    return "The action is not valid and therefore takes no effect. Ask for the valid actions."

predicate_map = {
    "at-robby": "Robby is in {}.",
    "at": "{} lies in {}.",
    "free": "hand {} empty.",
    "carry": "{} is held by {}.",
    "free": "{} is free.",
    "pick": "pick {} from {} with {}",
}
"""
TASK_PY = 'Num_Problems = {"gripper": 2, "blockworld": 10}\n'
VLLM_PY = """\
class VLLM:
    def make_prompt(self, system_message, prompt):
        system_message += "Answer with one action. "
        return system_message + prompt
"""

GRIPPER_DOMAIN = """\
(define (domain gripper-strips)
  (:predicates (room ?r) (ball ?b) (gripper ?g) (at-robby ?r) (at ?b ?r) (free ?g) (carry ?o ?g))
  (:action move
    :parameters (?from ?to)
    :precondition (and (room ?from) (room ?to) (at-robby ?from))
    :effect (and (at-robby ?to) (not (at-robby ?from))))
  (:action pick
    :parameters (?obj ?room ?gripper)
    :precondition (and (ball ?obj) (room ?room) (gripper ?gripper) (at ?obj ?room) (at-robby ?room)
                       (free ?gripper))
    :effect (and (carry ?obj ?gripper) (not (at ?obj ?room)) (not (free ?gripper))))
  (:action drop
    :parameters (?obj ?room ?gripper)
    :precondition (and (ball ?obj) (room ?room) (gripper ?gripper) (carry ?obj ?gripper) (at-robby ?room))
    :effect (and (at ?obj ?room) (free ?gripper) (not (carry ?obj ?gripper)))))
"""


def gripper_problem(name: str, balls: int) -> str:
    ids = " ".join(f"ball{i}" for i in range(1, balls + 1))
    init = " ".join(f"(ball ball{i}) (at ball{i} rooma)" for i in range(1, balls + 1))
    goal = " ".join(f"(at ball{i} roomb)" for i in range(1, balls + 1))
    return (
        f"(define (problem {name}) (:domain gripper-strips)\n"
        f"  (:objects rooma roomb {ids} left right)\n"
        f"  (:init (room rooma) (room roomb) {init} (gripper left) (gripper right) (at-robby rooma)\n"
        f"         (free left) (free right))\n"
        f"  (:goal (and {goal})))\n"
    )


def write(root: pathlib.Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def make_checkout(
    root: pathlib.Path, *, pddl: bool = True, sciworld_lines: list[dict] | None = None
) -> pathlib.Path:
    """A checkout with the config, prompt files, literal-holding Python files and (optionally) task data."""
    write(root, "eval_configs/main_results_all_tasks.yaml", CONFIG)
    write(root, "agentboard/llm/vllm.py", VLLM_PY)
    write(root, "agentboard/prompts/VanillaAgent/pddl_vanilla_prompt.json", json.dumps(PDDL_PROMPT))
    write(root, "agentboard/prompts/VanillaAgent/scienceworld_base.json", json.dumps(SCIWORLD_PROMPT))
    if pddl:
        write(root, "agentboard/environment/pddl_env/pddl_env.py", PDDL_ENV)
        write(root, "agentboard/tasks/pddl.py", TASK_PY)
        write(root, f"{PDDL_DIR}/gripper.pddl", GRIPPER_DOMAIN)
        # String order puts p10 before p2: AgentBoard's problem index 1 is p10 here.
        write(root, f"{PDDL_DIR}/gripper/p10.pddl", gripper_problem("p10", 2))
        write(root, f"{PDDL_DIR}/gripper/p2.pddl", gripper_problem("p2", 1))
        write(root, f"{PDDL_DIR}/gripper/p9.pddl", gripper_problem("p9", 1))
        write(root, "data/pddl/test.jsonl", '{"difficulty": "easy"}\n{"difficulty": "hard"}\n')
    if sciworld_lines is not None:
        write(root, "data/scienceworld/test.jsonl", "".join(json.dumps(x) + "\n" for x in sciworld_lines))
    return root


SHARED_GAMES = {"gripper": 20, "blockworld": 10, "barman": 20, "tyreworld": 10}


def make_shared_pddl_checkout(root: pathlib.Path, source: pathlib.Path = SHARED) -> pathlib.Path:
    """AgentBoard's 60 PDDL problems (`source`: ../shared/agentboard, its real files) beside our own protocol
    texts: the layout a model run needs (config, prompt file, vLLM sentence, text tables, labels)."""
    import shutil

    make_checkout(root)
    games = ", ".join(SHARED_GAMES)
    write(root, "eval_configs/main_results_all_tasks.yaml", CONFIG.replace("[gripper]", f"[{games}]"))
    write(root, "agentboard/tasks/pddl.py", f"Num_Problems = {SHARED_GAMES!r}\n")
    prompts = {g: {**PDDL_PROMPT["gripper"], "instruction": f"Solve the {g} problem."} for g in SHARED_GAMES}
    write(root, "agentboard/prompts/VanillaAgent/pddl_vanilla_prompt.json", json.dumps(prompts))
    n = sum(SHARED_GAMES.values())
    write(root, "data/pddl/test.jsonl", "".join(json.dumps({"difficulty": "easy"}) + "\n" for _ in range(n)))
    shutil.rmtree(root / PDDL_DIR)
    shutil.copytree(source / PDDL_DIR, root / PDDL_DIR)
    return root
