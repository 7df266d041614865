"""The one registry of evaluation tasks: names, aliases, the paper's weights, and each task's episode sources.

A task is one name with up to two *episode sources*:

- ``builtin(workdir, **options) -> EvalTask`` (`eval/envs/base.py`): episodes generated locally from the
  PyPI simulators, for users without an AgentBoard checkout and for tests. The environment is a `TextEnv`
  (`reset() -> (goal, observation)`, `step(command) -> StepResult`, `valid_actions()`,
  `oracle_action()`); the episodes run under our chat-style ReAct layout. `options` come from the CLI's
  ``--task-option NAME.KEY=VALUE`` (strings) and from `EvalConfig.task_options`.
- ``agentboard(strict: bool) -> AgentBoardTask`` (`eval/agentboard/tasks/base.py`): AgentBoard's episodes and
  rules read from the user's checkout (``--agentboard-dir``; the default source whenever it is given).
  `strict` is True for a model run (every protocol file required), False for oracle/random runs.

How a task (built into this package, or a plug-in loaded with ``--plugin MODULE``) registers::

    from agentrefine_jax.eval import register_task

    def _make(workdir: str, **options: str) -> EvalTask:  # import inside: unused tasks cost nothing
        from mypkg.hotpot import HotpotTask
        return HotpotTask(workdir, **options)

    register_task("hotpotqa", _make, display_name="HotpotQA", metric_names=("EM", "F1"))

``weight`` is the task's problem count in the paper's held-out average (None: reported, not averaged);
``metric_names`` relabels success/progress in tables (e.g. exact match / token F1: an env reports EM as
`success` and F1 as `progress`, so Best-of-N, perturbations and every report apply unchanged);
``aliases`` are other accepted names; ``builtin_name`` / ``builtin_display`` are the name and table label
results of the built-in source carry when it stands in for another benchmark (TextWorld games for Jericho).
A name registered again replaces the entry (a plug-in may override a built-in task). This package's own
tasks register at the bottom of this module (`_register_builtins`), with `_lazy("module", "Class")` factories
so a task's simulator is imported only when it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# The paper's held-out evaluation (AgentBoard): problems per task, written here only. The four held-out
# tasks' counts (282 in all) weight the held-out average; ALFWorld (134) is the held-in task.
AGENTBOARD_EPISODES: dict[str, int] = {
    "alfworld": 134,
    "babyai": 112,
    "sciworld": 90,
    "pddl": 60,
    "jericho": 20,
}
HELD_OUT_TASKS = ("babyai", "sciworld", "pddl", "jericho")
# The built-in source reports TextWorld games (Jericho's stand-in) as textworld, with Jericho's weight.
JERICHO_STAND_IN = "textworld"
PAPER_WEIGHTS: dict[str, int] = {
    (JERICHO_STAND_IN if t == "jericho" else t): AGENTBOARD_EPISODES[t] for t in HELD_OUT_TASKS
}

SOURCES = ("builtin", "agentboard")


def weights_label() -> str:
    """The held-out weights as the paper states them, e.g. for table footers."""
    return ", ".join(f"{display_name(t)} {AGENTBOARD_EPISODES[t]}" for t in HELD_OUT_TASKS)


@dataclasses.dataclass(frozen=True)
class TaskEntry:
    name: str
    display_name: str
    weight: int | None
    builtin: Callable[..., Any] | None = None
    agentboard: Callable[[bool], Any] | None = None
    aliases: tuple[str, ...] = ()
    builtin_name: str = ""
    builtin_display: str = ""
    metric_names: tuple[str, str] = ("success", "progress")

    def factory(self, source: str) -> Callable[..., Any] | None:
        return self.builtin if source == "builtin" else self.agentboard

    def result_name(self, source: str) -> str:
        """The name this task's results carry for `source`."""
        return (self.builtin_name or self.name) if source == "builtin" else self.name


_REGISTRY: dict[str, TaskEntry] = {}


def register_task(
    name: str,
    builtin: Callable[..., Any] | None = None,
    *,
    display_name: str,
    weight: int | None = None,
    agentboard: Callable[[bool], Any] | None = None,
    aliases: tuple[str, ...] = (),
    builtin_name: str = "",
    builtin_display: str = "",
    metric_names: tuple[str, str] = ("success", "progress"),
) -> None:
    """Make a task available to the runner and the CLI (see the module docstring for the contract)."""
    for n in (name, *aliases):
        if not n or "," in n or n != n.strip():
            raise ValueError(f"bad task name {n!r}")
    if builtin is None and agentboard is None:
        raise ValueError(f"task {name!r}: give a builtin and/or an agentboard episode source")
    _REGISTRY[name] = TaskEntry(
        name,
        display_name,
        weight,
        builtin,
        agentboard,
        tuple(aliases),
        builtin_name,
        builtin_display,
        metric_names,
    )


def entries() -> tuple[TaskEntry, ...]:
    return tuple(_REGISTRY.values())


def lookup(name: str, source: str | None = None) -> TaskEntry:
    """The entry for `name` (or an alias, or a built-in result name); with `source`, one that has it."""
    matches = [
        e
        for e in _REGISTRY.values()
        if name in (e.name, *e.aliases, e.builtin_name) and (source is None or e.factory(source) is not None)
    ]
    exact = [e for e in matches if e.name == name]
    if exact or matches:
        return (exact or matches)[0]
    names = ", ".join(available_tasks(source))
    where = f" with the {source} episode source" if source else ""
    raise ValueError(f"unknown task {name!r}{where}; choose from {names}")


def available_tasks(source: str | None = None) -> tuple[str, ...]:
    """Task names as reported for `source` (built-in: TextWorld for Jericho), in registration order."""
    out = []
    for e in _REGISTRY.values():
        if source is None:
            out.append(e.name)
        elif e.factory(source) is not None:
            out.append(e.result_name(source))
    return tuple(out)


def default_tasks(source: str) -> tuple[str, ...]:
    """What a run without --tasks evaluates: every registered task of `source` that has a paper weight
    (plus ALFWorld under AgentBoard's protocol, the paper's held-in task)."""
    return tuple(
        e.result_name(source)
        for e in _REGISTRY.values()
        if e.factory(source) is not None and (e.weight is not None or e.name in AGENTBOARD_EPISODES)
    )


def task_weights(source: str = "builtin") -> dict[str, int]:
    return {e.result_name(source): e.weight for e in _REGISTRY.values() if e.weight is not None}


def display_name(name: str) -> str:
    try:
        e = lookup(name)
    except ValueError:
        return name
    return e.builtin_display if name == e.builtin_name and e.builtin_display else e.display_name


def make_task(name: str, workdir: str = "", source: str = "builtin", **options: Any) -> Any:
    """Instantiate task `name` from `source`; built-in: (workdir, **options); agentboard: (strict=...)."""
    entry = lookup(name, source)
    if source == "builtin":
        return entry.builtin(workdir, **options)  # type: ignore[misc]
    return entry.agentboard(bool(options.get("strict", True)))  # type: ignore[misc]


# ----------------------------------------------------------------------------------- this package's tasks


def _lazy(module: str, cls: str, agentboard: bool = False) -> Callable[..., Any]:
    """A factory importing `module` only when the task runs (simulators are optional installs)."""

    def factory(*args: Any, **kwargs: Any) -> Any:
        import importlib

        try:
            klass = getattr(importlib.import_module(f"agentrefine_jax.eval.{module}"), cls)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("agentrefine_jax"):
                raise
            raise ImportError(f"task needs {e.name}: pip install -e '.[eval]' (see docs/eval.md)") from None
        if agentboard:
            import inspect

            strict = args[0] if args else kwargs.get("strict", True)
            return klass(strict=strict) if "strict" in inspect.signature(klass).parameters else klass()
        return klass(*args, **kwargs)

    return factory


def _register_builtins() -> None:
    # name, display name, built-in class (envs/), AgentBoard class (agentboard/tasks/) and extra settings.
    for name, display, builtin, agentboard, extra in (
        ("alfworld", "ALFWorld", None, "alfworld.ALFWorldTask", {}),
        ("babyai", "BabyAI", "envs.babyai.BabyAITask", "babyai.BabyAITask", {}),
        (
            "sciworld",
            "SciWorld",
            "envs.sciworld.SciWorldTask",
            "sciworld.SciWorldTask",
            {"aliases": ("scienceworld",)},
        ),
        ("pddl", "PDDL", "envs.pddl.PDDLTask", "pddl.PddlTask", {}),
        (
            "jericho",
            "Jericho",
            "envs.textworld.TextWorldTask",
            "jericho.JerichoTask",
            {
                "aliases": (JERICHO_STAND_IN,),
                "builtin_name": JERICHO_STAND_IN,
                "builtin_display": "TextWorld",
            },
        ),
    ):
        register_task(
            name,
            _lazy(*builtin.rsplit(".", 1)) if builtin else None,
            display_name=display,
            weight=AGENTBOARD_EPISODES[name] if name in HELD_OUT_TASKS else None,
            agentboard=_lazy(*f"agentboard.tasks.{agentboard}".rsplit(".", 1), agentboard=True),
            **extra,
        )
    # The demo generator's unseen worlds (the mini paper's in-distribution check; not in the average).
    register_task("demo_world", _lazy("envs.demo_world", "DemoWorldTask"), display_name="Demo world")
    # Figure 8 (reported on its own, not in the held-out average): EM as success, F1 as progress.
    register_task(
        "hotpotqa", _lazy("hotpotqa", "HotpotQATask"), display_name="HotpotQA", metric_names=("EM", "F1")
    )


_register_builtins()
