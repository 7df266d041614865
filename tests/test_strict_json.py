"""Strict JSON everywhere: every JSON the package writes goes through `outputs.json_dumps` (no NaN/Infinity,
RFC 8259), and the eval results carry `null` plus the reason where a number does not exist."""

from __future__ import annotations

import ast
import json
import math
import pathlib

import pytest

from agentrefine_jax import outputs
from agentrefine_jax.eval.core import EpisodeResult
from agentrefine_jax.eval.metrics import HELD_OUT, summarize
from agentrefine_jax.eval.perturb import summary

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "agentrefine_jax"
# Network payloads, not files: request bodies and server replies (their bytes are the peers' protocol).
NOT_FILES = {
    # Renders tool definitions, calls and results in each vendor's own JSON text (their
    # separators and indentation): model input, not a file or a reply we write.
    "data/templates.py",
    "http_client.py",
    "inference/api_errors.py",
    "inference/server.py",
    "synth/replay_server.py",
}


def _strict_load(text: str):
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_every_json_writer_goes_through_the_strict_helper():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "outputs.py" or rel in NOT_FILES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("dump", "dumps")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "json"
            ):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == [], "use agentrefine_jax.outputs.json_dumps (strict) instead of json.dump(s)"


def test_the_helper_refuses_nan_and_infinity(tmp_path):
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            outputs.json_dumps({"x": [bad]})
        with pytest.raises(ValueError):
            outputs.write_json(tmp_path / "r.json", {"x": bad})
    assert not (tmp_path / "r.json").exists()  # nothing half-written


def _result(task: str, variant: str, success: bool) -> EpisodeResult:
    return EpisodeResult(
        task, variant, 0, 0, {}, success, float(success), 3, "max_steps", None, 0, 0, 0.1, [], []
    )


def test_eval_results_without_a_held_out_task_are_strict_json(tmp_path):
    """A run of tasks none of which has a held-out weight (plug-ins, HotpotQA): the held-out average is
    null with the reason, also across perturbations, and the file parses with a strict parser."""
    results = [_result("plugin", v, s) for v, s in (("original", True), ("perturbation_1", False))]
    doc = summarize(results, weights={})
    held = doc["variants"]["original"][HELD_OUT]
    assert held["success_rate"] is None and held["progress_rate"] is None and held["missing"]
    spread = doc["perturbation_summary"]
    assert spread["plugin"]["success_rate"]["mean"] == 0.0
    assert spread[HELD_OUT]["success_rate"]["mean"] is None and spread[HELD_OUT]["success_rate"]["missing"]
    outputs.write_json(tmp_path / "r.json", doc)
    back = _strict_load((tmp_path / "r.json").read_text())
    assert back["variants"]["original"][HELD_OUT]["success_rate"] is None


def test_perturbation_summary_without_variants_is_null_with_reason():
    out = summary(0.5, [])
    assert (out["mean"], out["std"], out["original"]) == (None, None, 0.5) and out["missing"]
    assert summary(0.5, [0.25, 0.75]) == {
        "original": 0.5,
        "perturbations": [0.25, 0.75],
        "mean": 0.5,
        "std": 0.25,
    }
