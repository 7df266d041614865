"""Text adventure games generated locally by TextWorld (`tw-make tw-cooking`), in the Jericho role.

Games are compiled by TextWorld's bundled Inform 7 toolchain in a subprocess whose HOME and TMPDIR
point into our work directory (Inform writes `$HOME/Inform`), and cached there by their generation
parameters. Observations and parsing are the game's own. Oracle: TextWorld's `policy_commands`
(the walkthrough from the current state). Progress: best-so-far score / max score.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from agentrefine_jax.eval.envs.base import EvalTask, StepResult, TextEnv
from agentrefine_jax.eval.perturb import Vocabulary, action_words

# Difficulty levels cycled over episodes (tw-cooking options); walkthroughs are <= ~20 commands.
DEFAULT_LEVELS: tuple[str, ...] = (
    "--recipe 1 --take 1 --go 1",
    "--recipe 1 --take 1 --go 6 --open",
    "--recipe 2 --take 2 --go 6 --open --cut",
    "--recipe 2 --take 2 --go 6 --open --cook --cut",
)

WORDS = action_words(
    """
    go | {verb} DIRECTION | move north, south, east or west
      || walk | walk north, south, east or west || head | head north, south, east or west
      || travel | travel north, south, east or west
    take | {verb} OBJ [from CONTAINER/SUPPORTER] | pick up an object
      || grab | grab an object || pick up | pick an object up || get | get an object
    put | {verb} OBJ on SUPPORTER | place an object on a supporter (table, counter, ...)
      || place | place an object on a supporter || set | set an object on a supporter
      || rest | rest an object on a supporter
    insert | {verb} OBJ into CONTAINER | put an object into a container
      || stick | stick an object into a container || slide | slide an object into a container
      || stuff | stuff an object into a container
    drop | {verb} OBJ | drop an object you carry
      || discard | discard an object you carry || let go of | let go of a carried object
      || put down | put down an object you carry
    open | {verb} OBJ | open a door or container
      || open up | open up a door or container || unfasten | unfasten a door or container
      || pull open | pull a door or container open
    close | {verb} OBJ | close a door or container
      || shut | shut a door or container || close up | close up a door or container
      || push shut | push a door or container shut
    unlock | {verb} OBJ with KEY | unlock a door or container with a key
      || unbolt | unbolt a door or container with a key || unlatch | unlatch a door or container with a key
      || undo the lock of | undo the lock of a door or container with a key
    lock | {verb} OBJ with KEY | lock a door or container with a key
      || bolt | bolt a door or container with a key || latch | latch a door or container with a key
      || secure | secure a door or container with a key
    eat | {verb} OBJ | eat something edible
      || consume | consume something edible || devour | devour something edible
      || ingest | ingest something edible
    drink | {verb} OBJ | drink something drinkable
      || sip | sip something drinkable || gulp | gulp something drinkable || quaff | quaff something drinkable
    examine | {verb} OBJ | look closely at something (e.g. read the cookbook)
      || inspect | inspect something closely || study | study something closely
      || scrutinize | scrutinize something
    look | {verb} | describe the current room
      || look around | describe the room around you || observe | observe the current room
      || survey | survey the current room
    inventory | {verb} | list what you carry
      || show inventory | show what you carry || list items | list the items you carry
      || view inventory | view what you carry
    cook | {verb} OBJ with APPLIANCE | cook food with a stove (fry), oven (roast) or BBQ (grill)
      || heat | heat food with a stove (fry), oven (roast) or BBQ (grill)
      || warm | warm food with a stove (fry), oven (roast) or BBQ (grill)
      || prepare using heat | heat food using a stove (fry), oven (roast) or BBQ (grill)
    slice | {verb} OBJ with KNIFE | slice food with a knife you hold
      || carve | carve food into slices with a knife you hold
      || shave | shave food into slices with a held knife
      || cut into slices | cut food into slices with a knife you hold
    dice | {verb} OBJ with KNIFE | dice food with a knife you hold
      || cube | cut food into cubes with a knife you hold || mince | mince food with a held knife
      || cut into cubes | cut food into cubes with a knife you hold
    chop | {verb} OBJ with KNIFE | chop food with a knife you hold
      || hack | hack food into pieces with a knife you hold || hew | hew food with a held knife
      || cut into pieces | cut food into pieces with a knife you hold
    prepare meal | {verb} | prepare the meal once all ingredients are processed (in the kitchen)
      || make meal | make the meal once the ingredients are ready (in the kitchen)
      || assemble meal | assemble the meal when the ingredients are processed (in the kitchen)
      || put together meal | put the meal together once all ingredients are ready (in the kitchen)
    """
)

_BANNER_CHARS = set(" $_|\\/<>")


def clean_feedback(text: str) -> str:
    """Drop TextWorld's ASCII-art banner and the trailing input prompt / status line."""
    lines = []
    for line in text.splitlines():
        if line.strip().startswith(">"):
            break  # the prompt; whatever follows is the status bar
        if line.strip() and set(line) <= _BANNER_CHARS:
            continue
        lines.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def game_path(workdir: str, spec: dict[str, Any]) -> str:
    key = hashlib.sha256(f"{spec['challenge']}|{spec['options']}|{spec['seed']}".encode()).hexdigest()[:16]
    return os.path.join(workdir, "textworld_games", f"{spec['challenge']}-{spec['seed']}-{key}.z8")


def make_game(workdir: str, spec: dict[str, Any]) -> str:
    """Generate (once) the game for `spec` with `tw-make`; returns the .z8 path."""
    path = game_path(workdir, spec)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    home, tmp = os.path.join(workdir, "inform_home"), os.path.join(workdir, "tmp")
    os.makedirs(home, exist_ok=True)
    os.makedirs(tmp, exist_ok=True)
    env = {**os.environ, "HOME": home, "TMPDIR": tmp}
    partial = path[:-3] + ".partial.z8"
    cmd = [
        sys.executable,
        "-c",
        "import sys, runpy; sys.argv[0] = 'tw-make'; runpy.run_path(sys.argv.pop(1), run_name='__main__')",
        _tw_make_script(),
        spec["challenge"],
        *spec["options"].split(),
        "--seed",
        str(spec["seed"]),
        "--output",
        partial,
        "-f",
        "--silent",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not os.path.exists(partial):
        raise RuntimeError(f"tw-make failed for {spec}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    # tw-make writes game.z8 + game.json (+ .ni); rename all so a half-written game is never reused.
    for ext in (".json", ".ni"):
        if os.path.exists(partial[:-3] + ext):
            os.replace(partial[:-3] + ext, path[:-3] + ext)
    os.replace(partial, path)
    return path


def _tw_make_script() -> str:
    script = os.path.join(os.path.dirname(sys.executable), "tw-make")
    if not os.path.exists(script):
        raise FileNotFoundError(
            f"tw-make not found next to {sys.executable}; install the `textworld` package"
        )
    return script


class TextWorldEnv(TextEnv):
    task = "textworld"
    intro = (
        "You are playing a text adventure game. You move between rooms, open containers and doors, and "
        "handle objects. Use the object names exactly as the game describes them."
    )

    def __init__(self, spec: dict[str, Any], vocab: Vocabulary, path: str):
        super().__init__(spec, vocab)
        import textworld

        infos = textworld.EnvInfos(
            admissible_commands=True,
            policy_commands=True,
            max_score=True,
            score=True,
            won=True,
            lost=True,
            objective=True,
        )
        self._env = textworld.start(path, request_infos=infos)
        self._state: Any = None

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def _reset(self) -> tuple[str, str]:
        self._state = self._env.reset()
        return self._state.objective, clean_feedback(self._state.feedback)

    def _valid_canonical(self) -> list[str]:
        return list(self._state.admissible_commands or [])

    def _oracle_canonical(self) -> str:
        policy = self._state.policy_commands
        if policy:
            return policy[0]
        raise RuntimeError(
            f"TextWorld has no policy command left for {self.spec} (score {self._state.score})"
        )

    def _step(self, canonical: str) -> StepResult:
        accepted = canonical.lower() in {c.lower() for c in self._state.admissible_commands or []}
        self._state, _, done = self._env.step(canonical)
        s = self._state
        obs = clean_feedback(s.feedback)
        if s.lost:
            obs += "\nYou have lost the game."
        progress = (s.score / s.max_score) if s.max_score else 0.0
        return StepResult(obs, bool(done), progress, accepted, bool(s.won))


class TextWorldTask(EvalTask):
    name = "textworld"
    display_name = "TextWorld"
    # Stands in for Jericho (20 games) in the paper's held-out average.
    default_max_steps = 40
    words = WORDS

    def __init__(
        self, workdir: str, levels: tuple[str, ...] = DEFAULT_LEVELS, split: str = "test", workers: int = 2
    ):
        super().__init__(workdir)
        self.levels = levels
        self.split = split
        self.workers = workers

    def episode_specs(self, n: int, seed: int) -> list[dict[str, Any]]:
        return [
            {
                "challenge": "tw-cooking",
                "options": f"{self.levels[i % len(self.levels)]} --split {self.split}",
                "seed": seed * 10_007 + i,
            }
            for i in range(n)
        ]

    def prepare(self, specs: Sequence[dict[str, Any]]) -> None:
        missing = [s for s in specs if not os.path.exists(game_path(self.workdir, s))]
        if not missing:
            return
        logging.getLogger(__name__).info(
            f"generating {len(missing)} TextWorld game(s) with tw-make in {self.workdir} ..."
        )
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            list(pool.map(lambda s: make_game(self.workdir, s), missing))

    def make_env(self, spec: dict[str, Any], perturbation: int, *, oracle: bool = False) -> TextEnv:
        return TextWorldEnv(spec, Vocabulary(self.words, perturbation), make_game(self.workdir, spec))
