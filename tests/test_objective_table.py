"""The objective table (agentrefine_jax/objective_table.py): each training objective declared once.

* no objective name is written in the package outside the table (an AST scan of every string
  constant; a planted one is found);
* every stage reads the table: config validation accepts exactly its names, the data pipeline
  builds the data an entry declares (none for one trained on rollouts), the parameter mode holds a
  reference copy exactly where an entry says so (with its reference knob, only while it is on),
  and the one train step logs exactly the metrics an entry declares, from the loss the entry
  names (resolved in train/objectives.py, every loss there named by some entry).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import typing

import jax
import optax
import pytest

from agentrefine_jax import config_checks, objective_table
from agentrefine_jax import sharding as shd
from agentrefine_jax.config import ConfigError, DataConfig, TrainConfig, load_config
from agentrefine_jax.data.pipeline import DataError, build_data
from agentrefine_jax.data.preference import CHOSEN
from agentrefine_jax.models import lora, preset
from agentrefine_jax.train import objectives
from agentrefine_jax.train.param_mode import ParamMode
from agentrefine_jax.train.step import build_steps

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "agentrefine_jax"
TABLE_FILE = "agentrefine_jax/objective_table.py"
DEMO_TRAIN = PACKAGE / "data" / "demo" / "train.jsonl"
# Where an objective's name may still be written as a string outside the table ("file:line" ->
# why). Empty: everything asks the table (a name from a config is looked up, never compared).
ALLOWED: dict[str, str] = {}
STEP_METRICS = {"loss", "loss_tokens", "tokens", "projected_tokens", "grad_norm"}


def stray_objective_names(root: pathlib.Path, names: set[str]) -> list[str]:
    """`file:line: 'name'` of every string constant equal to an objective name, outside the table
    (f-string parts and docstrings included; a longer string that merely mentions one is not)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        if rel == TABLE_FILE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                where = f"{rel}:{node.lineno}"
                if where not in ALLOWED:
                    bad.append(f"{where}: {node.value!r}")
    return bad


def test_objective_names_live_only_in_the_table():
    assert stray_objective_names(PACKAGE, set(objective_table.NAMES)) == []


def test_the_scan_finds_a_planted_name(tmp_path):
    pkg = tmp_path / "agentrefine_jax"
    (pkg / "train").mkdir(parents=True)
    (pkg / "objective_table.py").write_text('NAMES = ("sft", "dpo")\n')
    (pkg / "train" / "step.py").write_text(
        'def f(objective="sft"):\n    """dpo"""\n    return objective in ("dpo", "x") or "sft+dpo: said"\n'
    )
    assert stray_objective_names(pkg, {"sft", "dpo"}) == [
        "agentrefine_jax/train/step.py:1: 'sft'",
        "agentrefine_jax/train/step.py:2: 'dpo'",
        "agentrefine_jax/train/step.py:3: 'dpo'",
    ]


def test_entries_are_whole():
    assert len(set(objective_table.NAMES)) == len(objective_table.TABLE)
    assert objective_table.DEFAULT in objective_table.NAMES
    for entry in objective_table.TABLE:
        assert entry.examples or entry.pairs or entry.rollouts, f"{entry.name}: trains on no data"
        assert not (entry.rollouts and (entry.examples or entry.pairs)), f"{entry.name}: rollouts or data"
        assert not entry.reference_knob or entry.reference, f"{entry.name}: a knob for no reference"
        assert isinstance(objectives.loss_of(entry), objectives.Loss)
        assert set(entry.weights) <= {f.name for f in dataclasses.fields(TrainConfig)}
    # Every loss in train/objectives.py is some entry's (a loss no entry names is dead code).
    losses = {k for k, v in vars(objectives).items() if isinstance(v, objectives.Loss)}
    assert losses == {e.loss for e in objective_table.TABLE}
    with pytest.raises(ValueError, match="objective must be one of"):
        objective_table.get("ppo")


def test_config_validation_accepts_exactly_the_table():
    hint = typing.get_type_hints(TrainConfig)["objective"]
    assert typing.get_args(hint) == objective_table.NAMES
    assert TrainConfig().objective == objective_table.DEFAULT
    for name in objective_table.NAMES:
        assert load_config("tiny", [f"train.objective={name}"]).train.objective == name
        assert config_checks.RULES["train.objective"].ok(name)
    choices = "train.objective=ppo: must be one of " + ", ".join(objective_table.NAMES)
    with pytest.raises(ConfigError, match=re.escape(choices)):
        load_config("tiny", ["train.objective=ppo"])
    for entry in objective_table.TABLE:
        sets = [f"train.objective={entry.name}", *(f"train.{w}=0" for w in entry.weights)]
        if entry.weights:  # all its weights 0: nothing to train
            with pytest.raises(ConfigError, match="nothing to train"):
                load_config("tiny", sets)
        else:
            load_config("tiny", sets)
        dropped = [f"train.objective={entry.name}", "data.drop_refinement_data=true"]
        if entry.pairs:  # pairs come from the errors drop_refinement_data drops
            with pytest.raises(ConfigError, match="drops the errors pairs come from"):
                load_config("tiny", dropped)
        else:
            load_config("tiny", dropped)


def test_the_parameter_mode_holds_a_reference_where_an_entry_says_so():
    cfg = preset("tiny", vocab_size=64)
    spec = lora.LoraSpec(("q", "v"), rank=2, alpha=4.0)
    for entry in objective_table.TABLE:
        full = ParamMode.of_settings(cfg, None, None)
        # With its reference knob (if any) at its default, off; `reference_in` reads a config's.
        assert full.for_objective(entry.name).reference == entry.holds_reference()
        assert ParamMode.of(load_config("tiny", [f"train.objective={entry.name}"])).reference == (
            entry.reference and not entry.reference_knob
        )
        if entry.reference_knob:  # the knob on: the reference with it
            on = load_config("tiny", [f"train.objective={entry.name}", f"{entry.reference_knob}=0.1"])
            assert entry.reference_in(on) and ParamMode.of(on).reference
        # A LoRA run's reference is its base, adapters off: never a copy.
        assert not ParamMode.of_settings(cfg, spec, None).for_objective(entry.name).reference


@pytest.mark.parametrize("entry", objective_table.TABLE, ids=objective_table.NAMES)
def test_the_pipeline_builds_the_data_an_entry_declares(tmp_path, entry):
    path = tmp_path / "demo.jsonl"
    path.write_text("".join(DEMO_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:20]))
    cfg = DataConfig(train_files=(str(path),), tokenizer="llama3", template="llama3", max_length=512)
    if entry.rollouts:  # its batches are the RL loop's rollouts (rl/): the split gives none
        with pytest.raises(DataError, match="trains on rollouts"):
            build_data(cfg, "train", objective=entry.name)
        return
    data = build_data(cfg, "train", objective=entry.name)
    kinds = [int(data.store.example(i)[1].max()) for i in range(len(data.store))]
    assert (kinds.count(1) > 0) == entry.examples
    assert (kinds.count(CHOSEN) > 0) == entry.pairs == (data.report.preference is not None)


@pytest.mark.parametrize("entry", objective_table.TABLE, ids=objective_table.NAMES)
def test_the_step_logs_the_metrics_an_entry_declares(entry):
    """Traced, not run: the one step body's metrics are the four every step logs and the entry's."""
    cfg = preset("tiny", vocab_size=64)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    fns = build_steps(
        cfg, optax.sgd(0.1), mesh, shd.DEFAULT_RULES, global_batch=2, micro_batch=1, loss_chunk=8,
        objective=entry.name,
    )  # fmt: skip
    # The packed batch's four int32 arrays, and the float32 ones the entry's loss reads beside them.
    assert set(fns.batch_dtypes) == {"input_ids", "loss_mask", "segment_ids", "positions"} | set(
        objectives.loss_of(entry).extra_keys
    )
    batch = {k: jax.ShapeDtypeStruct((2, 16), dtype) for k, dtype in fns.batch_dtypes.items()}
    _, _, metrics = jax.eval_shape(fns.train, fns.abstract_params, fns.abstract_opt, batch)
    assert set(metrics) == STEP_METRICS | set(entry.metrics)
    # Full fine-tuning: a frozen copy (a knob-switched reference: off at its default).
    assert ("ref" in fns.abstract_params) == entry.holds_reference()
