"""The one evaluation config: the same fields under both episode sources, each source's defaults resolved
by `validate`, one-line errors for what a source cannot do, and the results file's `config` keeping the
names schema /1 files always had."""

from __future__ import annotations

import json

import pytest

from agentrefine_jax.eval.cli import main
from agentrefine_jax.eval.config import EvalConfig
from agentrefine_jax.eval.registry import default_tasks


def test_each_source_resolves_its_own_defaults():
    builtin = EvalConfig(workdir="/nonexistent-is-fine-until-run")
    builtin.validate()
    assert builtin.tasks == default_tasks("builtin")
    assert (builtin.episodes, builtin.max_steps) == (10, None)  # None: each task's own step limit
    ab = EvalConfig(source="agentboard", tasks=("alfworld", "pddl"))
    ab.validate()
    assert (ab.episodes, ab.max_steps) == (None, 30)  # all of AgentBoard's episodes, its 30 steps
    aliased = EvalConfig(tasks=("jericho",), workdir="w")
    aliased.validate()
    assert aliased.tasks == ("textworld",)  # the built-in source's stand-in for Jericho


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"source": "elsewhere"}, "source must be one of"),
        ({"episodes": 0}, "--episodes must be >= 1"),
        ({"max_steps": 0}, "--max-steps must be >= 1"),
        ({"perturbations": -1}, "--num-perturbations must be >= 0"),
        ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
        ({"tasks": ("nosuchtask",)}, "nosuchtask"),
        ({"workdir": ""}, "workdir is required"),
        ({"log_dir": "logs"}, "--log-dir .* needs the agentboard source"),
        ({"source": "agentboard", "best_of": 2}, "needs --temperature > 0"),
        ({"source": "agentboard", "tasks": ("pddl",), "perturbations": 5}, "ALFWorld's only"),
        ({"source": "agentboard", "tasks": ("alfworld",), "perturbations": 6}, "defines 5 perturbations"),
        ({"source": "agentboard", "task_options": {"pddl": {"a": "b"}}}, "built-in episode sources only"),
        ({"source": "agentboard", "prompt_style": "agentboard"}, "AgentBoard's episodes use its prompts"),
    ],
)
def test_what_a_source_cannot_do_is_one_line_error(kw, message):
    config = EvalConfig(**({"workdir": "w"} | kw))
    with pytest.raises(ValueError, match=message) as err:
        config.validate()
    assert "\n" not in str(err.value)


def test_results_config_keeps_the_schema_1_names():
    builtin = EvalConfig(tasks=("pddl",), perturbations=3, workdir="w")
    builtin.validate()
    doc = builtin.to_json()
    assert "workdir" not in doc
    assert (doc["perturbations"], doc["perturb"], doc["num_perturbations"]) == (3, True, 3)
    ab = EvalConfig(source="agentboard", tasks=("pddl",), episodes=4)
    ab.validate()
    assert (ab.to_json()["episodes"], ab.to_json()["limit"]) == (4, 4)


def test_cli_num_perturbations_without_perturb_is_refused(capsys):
    assert main(["--policy", "random", "--tasks", "pddl", "--num-perturbations", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["[eval] error: --num-perturbations needs --perturb"]


def test_cli_perturb_runs_what_the_task_defines_up_to_the_papers_five(tmp_path, capsys):
    argv = ["--policy", "oracle", "--tasks", "pddl", "--episodes", "1", "--max-steps", "2", "--perturb"]
    assert main([*argv, "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert sorted(doc["variants"]) == ["original", "perturbation_1", "perturbation_2", "perturbation_3"]
    assert doc["config"]["perturbations"] == 5
    assert "pddl: the task defines 3 perturbations; running those" in capsys.readouterr().err
