"""Deterministic generator of demo refinement trajectories in a small text world.

A household of a few rooms, containers that must be opened, and objects to move. An
expert policy solves the task, but at chosen steps it makes a real mistake (an unreachable
room, a closed container, an object it does not carry, an action outside the action list).
The mistaken action IS executed by the simulator, whose error text becomes the next
observation, and the following assistant turn recovers from it. Rows use the paper's ReAct
layout: a system prompt (environment, task format, available actions), user turns holding
observations, assistant turns "Thought: ...\\nAction: ..."; erroneous turns carry
`loss: false`.

    python -m agentrefine_jax.data demo-world --out-dir agentrefine_jax/data/demo

rewrites the shipped demo files (train.jsonl, eval.jsonl) byte for byte. Every row's id
holds its seed, and `replay(row)` re-runs its actions through the simulator.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import re
from typing import Any

from agentrefine_jax.outputs import json_dumps, open_atomic

ROOMS = ["kitchen", "hallway", "living room", "bedroom", "bathroom", "study", "garden", "pantry"]
CONTAINERS = {
    "kitchen": ["fridge", "cupboard"],
    "bedroom": ["wardrobe", "nightstand"],
    "bathroom": ["cabinet"],
    "study": ["desk drawer", "filing cabinet"],
    "living room": ["chest"],
    "pantry": ["bread bin"],
    "garden": ["shed"],
    "hallway": ["shoe rack"],
}
SURFACES = {
    "kitchen": ["counter", "table"],
    "bedroom": ["bed"],
    "bathroom": ["sink"],
    "study": ["bookshelf"],
    "living room": ["sofa", "coffee table"],
    "pantry": ["shelf"],
    "garden": ["bench"],
    "hallway": ["console table"],
}
OBJECTS = [
    "apple", "key", "book", "mug", "towel", "candle", "letter", "scarf", "lamp", "notebook",
    "spoon", "bottle", "plant pot", "remote", "umbrella", "spectacle case", "soap", "crème brûlée",
    "café mug", "pen", "battery", "photo", "wallet", "teapot",
]  # fmt: skip
ACTION_HELP = (
    "go to <adjacent room>; open <container>; take <object> from <place>; put <object> in/on <place>; look"
)
MAX_ERRORS = 2
SYSTEM_TEMPLATE = (
    "You are an agent in a text household. Rooms: {rooms}. Open containers to see inside.\n"
    "Actions: {actions}\n"
    "Answer in this format:\nThought: <reasoning>\nAction: <one action>"
)


@dataclasses.dataclass
class World:
    rooms: list[str]
    edges: dict[str, list[str]]
    places: dict[str, list[str]]  # room -> containers + surfaces
    closed: set[str]  # containers currently closed
    location: dict[str, str]  # object -> place ("agent" when carried)
    agent_room: str
    task_object: str
    task_target: str

    def room_of(self, place: str) -> str:
        return next(r for r, ps in self.places.items() if place in ps)

    def visible(self, room: str) -> list[tuple[str, str]]:
        out = []
        for place in self.places[room]:
            if place in self.closed:
                continue
            out.extend((o, place) for o, p in sorted(self.location.items()) if p == place)
        return out

    def describe(self) -> str:
        room = self.agent_room
        parts = []
        for place in self.places[room]:
            if place in self.closed:
                parts.append(f"a closed {place}")
            else:
                inside = [o for o, p in sorted(self.location.items()) if p == place]
                prep = "in" if place in _all_containers() else "on"
                stuff = _join([_a(o) for o in inside]) if inside else "nothing"
                parts.append(
                    f"a {'open ' if place in _all_containers() else ''}{place} with {stuff} {prep} it"
                )
        return f"You are in the {room}. You see {_join(parts)}. Exits: {', '.join(sorted(self.edges[room]))}."

    def step(self, action: str) -> tuple[str, bool]:
        """Execute one action; returns (observation, valid)."""
        action = action.strip()
        room = self.agent_room
        if action == "look":
            return self.describe(), True
        if action == "inventory":
            held = [o for o, p in sorted(self.location.items()) if p == "agent"]
            return (
                f"You are carrying: {', '.join(held)}." if held else "You are not carrying anything."
            ), True
        if m := re.fullmatch(r"go to (.+)", action):
            dest = m.group(1)
            if dest not in self.rooms:
                return f"Nothing happens. There is no room called '{dest}'.", False
            if dest == room:
                return f"Nothing happens. You are already in the {room}.", False
            if dest not in self.edges[room]:
                return (
                    f"Nothing happens. You cannot reach the {dest} from the {room}. "
                    f"Exits: {', '.join(sorted(self.edges[room]))}."
                ), False
            self.agent_room = dest
            return self.describe(), True
        if m := re.fullmatch(r"open (.+)", action):
            c = m.group(1)
            if c not in self.places[room] or c not in _all_containers():
                return f"Nothing happens. There is no {c} to open here.", False
            if c not in self.closed:
                return f"Nothing happens. The {c} is already open.", False
            self.closed.discard(c)
            inside = [o for o, p in sorted(self.location.items()) if p == c]
            return f"You open the {c}. Inside you see {_join([_a(o) for o in inside]) or 'nothing'}.", True
        if m := re.fullmatch(r"take (.+) from (.+)", action):
            obj, place = m.groups()
            if place not in self.places[room]:
                return f"Nothing happens. There is no {place} here.", False
            if place in self.closed:
                return f"Nothing happens. The {place} is closed.", False
            if self.location.get(obj) != place:
                return f"Nothing happens. There is no {obj} in/on the {place}.", False
            self.location[obj] = "agent"
            return f"You take the {obj} from the {place}.", True
        if m := re.fullmatch(r"put (.+) (?:in|on) (.+)", action):
            obj, place = m.groups()
            if self.location.get(obj) != "agent":
                return f"Nothing happens. You are not carrying the {obj}.", False
            if place not in self.places[room]:
                return f"Nothing happens. There is no {place} here.", False
            if place in self.closed:
                return f"Nothing happens. The {place} is closed.", False
            self.location[obj] = place
            done = obj == self.task_object and place == self.task_target
            return f"You put the {obj} {_prep(place)} the {place}." + (
                " Task completed!" if done else ""
            ), True
        return f"Error: '{action}' is not a valid action. Use one of the available actions.", False


def _all_containers() -> set[str]:
    return {c for cs in CONTAINERS.values() for c in cs}


def _prep(place: str) -> str:
    return "in" if place in _all_containers() else "on"


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _join(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def make_world(rng: random.Random) -> World:
    rooms = rng.sample(ROOMS, rng.randint(3, 4))
    # A random spanning tree plus maybe one extra edge: connected, but not fully.
    edges: dict[str, list[str]] = {r: [] for r in rooms}
    for i in range(1, len(rooms)):
        j = rng.randrange(i)
        edges[rooms[i]].append(rooms[j])
        edges[rooms[j]].append(rooms[i])
    places = {
        r: list(CONTAINERS[r][: rng.randint(1, len(CONTAINERS[r]))]) + list(SURFACES[r][:1]) for r in rooms
    }
    all_places = [p for r in rooms for p in places[r]]
    objects = rng.sample(OBJECTS, rng.randint(2, 4))
    location = {o: rng.choice(all_places) for o in objects}
    closed = {p for p in all_places if p in _all_containers()}
    task_object = objects[0]
    targets = [p for p in all_places if p != location[task_object]]
    return World(
        rooms=rooms,
        edges=edges,
        places=places,
        closed=closed,
        location=location,
        agent_room=rng.choice(rooms),
        task_object=task_object,
        task_target=rng.choice(targets),
    )


def _path(world: World, src: str, dst: str) -> list[str]:
    prev = {src: src}
    queue = [src]
    while queue:
        r = queue.pop(0)
        for n in sorted(world.edges[r]):
            if n not in prev:
                prev[n] = r
                queue.append(n)
    path = [dst]
    while path[-1] != src:
        path.append(prev[path[-1]])
    return path[::-1][1:]


def _expert_steps(world: World) -> list[tuple[str, str]]:
    """(thought, action) pairs that solve the task from the current state."""
    obj, target = world.task_object, world.task_target
    src = world.location[obj]
    dst_room = world.room_of(target)
    steps: list[tuple[str, str]] = []
    here = world.agent_room
    if src != "agent":
        src_room = world.room_of(src)
        for r in _path(world, here, src_room):
            steps.append((f"The {obj} should be in the {src_room}, so I head there.", f"go to {r}"))
        if src in world.closed:
            steps.append((f"The {src} is closed; the {obj} may be inside, so I open it.", f"open {src}"))
        steps.append((f"I can see the {obj} {_prep(src)} the {src}. I take it.", f"take {obj} from {src}"))
        here = src_room
    for r in _path(world, here, dst_room):
        steps.append((f"I carry the {obj} towards the {dst_room}, where the {target} is.", f"go to {r}"))
    if target in world.closed:
        steps.append((f"The {target} is closed, so I open it before putting the {obj} in.", f"open {target}"))
    steps.append(
        (
            f"Now I put the {obj} {_prep(target)} the {target} to finish the task.",
            f"put {obj} {_prep(target)} {target}",
        )
    )
    return steps


def _mistake(world: World, rng: random.Random, expert_action: str) -> tuple[str, str]:
    """A plausible but invalid (thought, action) for the current state."""
    room, obj, target = world.agent_room, world.task_object, world.task_target
    kinds = ["bad_verb"]
    if [r for r in world.rooms if r != room and r not in world.edges[room]]:
        kinds.append("far")
    if expert_action.startswith("open "):
        kinds.append("closed")
    if expert_action.startswith("take "):
        kinds += ["grab", "not_carrying"]
    if expert_action.startswith("put ") and [r for r in world.rooms if r != room]:
        kinds.append("elsewhere")
    kind = rng.choice(kinds)
    if kind == "far":
        dest = rng.choice(sorted(r for r in world.rooms if r != room and r not in world.edges[room]))
        return f"I will go straight to the {dest}.", f"go to {dest}"
    if kind == "closed":
        c = expert_action[len("open ") :]
        if c == target:
            return f"The {c} is where the {obj} belongs. I put it there.", f"put {obj} in {c}"
        return f"The {obj} is probably in the {c}. I take it.", f"take {obj} from {c}"
    if kind == "grab":
        return f"I see the {obj}. I will grab it.", f"grab {obj}"
    if kind == "not_carrying":
        return f"I should put the {obj} {_prep(target)} the {target}.", f"put {obj} {_prep(target)} {target}"
    if kind == "elsewhere":
        other = rng.choice(sorted(r for r in world.rooms if r != room))
        place = world.places[other][-1]
        return f"I will put the {obj} {_prep(place)} the {place}.", f"put {obj} {_prep(place)} {place}"
    # An action outside the action list, with the intent of the right one.
    verb, _, rest = expert_action.partition(" ")
    synonym = {"go": "walk", "open": "unlock", "take": "pick up", "put": "place"}[verb]
    return f"I should {synonym} {rest}.", f"{synonym} {rest}"


def _recovery_thought(obs: str) -> str:
    if "cannot reach" in obs:
        return "I cannot reach that room directly; I have to go through adjacent rooms."
    if "is closed" in obs:
        return "The container is closed, so I have to open it first."
    if "not a valid action" in obs:
        return "That action is not in the action list. I must use the exact action format."
    if "not carrying" in obs:
        return "I am not carrying it yet; I need to take it first."
    if "There is no" in obs:
        return "That is not here. Let me act on what I can actually see."
    return "My last action did not work. I will correct it."


def generate_trajectory(seed: int, error_rate: float = 0.25) -> dict[str, Any]:
    rng = random.Random(seed)
    world = make_world(rng)
    system = SYSTEM_TEMPLATE.format(rooms=", ".join(world.rooms), actions=ACTION_HELP)
    task = (
        f"Task: put the {world.task_object} {_prep(world.task_target)} the {world.task_target}.\n"
        f"Observation: {world.describe()}"
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task},
    ]
    recovering: str | None = None
    errors = 0
    for _ in range(30):
        thought, action = _expert_steps(world)[0]
        # At most MAX_ERRORS mistakes; a second one right after a first is rarer, but happens.
        if errors < MAX_ERRORS and rng.random() < (error_rate if recovering is None else error_rate / 3):
            errors += 1
            wrong_thought, wrong_action = _mistake(world, rng, action)
            obs, valid = world.step(wrong_action)
            if valid:  # an erroneous turn must be a real error of the simulator
                raise AssertionError(f"seed {seed}: mistake {wrong_action!r} was accepted by the world")
            messages.append(
                {
                    "role": "assistant",
                    "content": f"Thought: {wrong_thought}\nAction: {wrong_action}",
                    "loss": False,
                }
            )
            messages.append({"role": "user", "content": f"Observation: {obs}"})
            recovering = obs
            continue
        if recovering is not None:
            thought = _recovery_thought(recovering) + " " + thought
            recovering = None
        obs, valid = world.step(action)
        assert valid, (seed, action, obs)
        messages.append(
            {"role": "assistant", "content": f"Thought: {thought}\nAction: {action}", "loss": True}
        )
        if "Task completed!" in obs:
            break
        messages.append({"role": "user", "content": f"Observation: {obs}"})
    else:
        raise AssertionError(f"seed {seed}: task not solved in 30 steps")
    return {"id": f"demo-{seed}", "messages": messages}


def replay(row: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """Re-run a row's actions in a fresh world from its seed: (action, observation, valid)."""
    seed = int(row["id"].rsplit("-", 1)[1])
    world = make_world(random.Random(seed))
    out = []
    for m in row["messages"]:
        if m["role"] == "assistant":
            action = m["content"].split("\nAction: ", 1)[1]
            obs, valid = world.step(action)
            out.append((action, obs, valid))
    return out


def write_split(path: pathlib.Path, seeds: range, error_rate: float) -> int:
    """The trajectories of `seeds`, one JSON row each; written to a temporary sibling and renamed into
    place, so an interrupted run never leaves a half file where a complete one was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_atomic(path, newline="\n") as f:
        for s in seeds:
            f.write(json_dumps(generate_trajectory(s, error_rate), ensure_ascii=False) + "\n")
    return len(seeds)
