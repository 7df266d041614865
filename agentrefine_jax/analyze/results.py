"""The one reader of `eval` result JSONs: every layout the eval stage writes becomes a `RunResult`.

`analyze report` and its tables and figures see only `RunResult`; when the eval stage's JSON
changes, this module is the one place that follows it. It reads one layout, docs/eval.md's "Results
JSON" (schema `agentrefine_jax.eval/2`, the same for `source` builtin and agentboard): `tasks.<task>`
(the headline greedy run; `best_of.greedy_run == "sample 0"` marks a policy's first sample), `held_out`
(the weighted held-out average), `best_of.tasks.<task>.{greedy, best_of}` (Table 4), `variants.<variant>
.tasks.<task>` (Table 3's original and perturbations), and `--all-checkpoints`'s `{checkpoints,
best_step}` (the best checkpoint's result is read). Older files (schema /1 of either source, and files
written before the schema field existed) are upgraded to that layout first, with their own meaning kept:
a /1 built-in Best-of-N file's headline is its first sample. Rates are fractions in [0, 1], as in the
files. Tasks scored by exact match / F1 (HotpotQA: EM as success, F1 as progress) go to `qa`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# The run settings the report groups and plots by (Table 2's ablations, Figure 11's sweeps).
RUN_KEYS = (
    "data.loss_on",
    "data.drop_refinement_data",
    "train.objective",
    "data.general_ratio",
    "data.train_size",
)


class ResultError(ValueError):
    """A file that is not an eval result (or not one this reader knows): one line for the CLI."""


@dataclasses.dataclass(frozen=True)
class Score:
    """One task's rates (fractions); None when the run did not measure it."""

    success: float | None
    progress: float | None
    episodes: int | None = None
    # How the replies fared (built-in source): the mean over episodes of the share of actions the
    # environment accepted, and of replies the parser could not read; None when the file lacks them.
    valid_action_rate: float | None = None
    format_error_rate: float | None = None
    # Why episodes ended: (termination, count) pairs, e.g. ("max_steps", 3); () when not recorded.
    terminations: tuple[tuple[str, int], ...] = ()
    # Recovery after a rejected turn (docs/eval.md, "Metrics"): the share of next turns that are valid,
    # the mean turns from a run of rejections to the valid turn ending it, the share repeating the
    # rejected action; None when the file lacks them or nothing was rejected.
    recovery_rate: float | None = None
    mean_steps_to_recover: float | None = None
    repeated_error_rate: float | None = None


@dataclasses.dataclass(frozen=True)
class QAScore:
    """HotpotQA-style exact match and token F1 (fractions)."""

    em: float
    f1: float
    questions: int | None = None


@dataclasses.dataclass
class RunResult:
    path: str
    label: str
    agent: str  # who acted, as the file names it (policy, endpoint model, checkpoint)
    protocol: str  # "builtin" | "agentboard"
    # The headline single-sample scores per task (greedy, or the first sample of a Best-of-N run).
    tasks: dict[str, Score]
    single_kind: str = "greedy"  # "greedy" | "first sample"
    held_out: Score | None = None
    held_out_note: str = ""
    best_of: int = 1
    best_of_tasks: dict[str, Score] = dataclasses.field(default_factory=dict)
    # task -> [original, perturbation 1, ..., perturbation k]
    perturbations: dict[str, list[Score]] = dataclasses.field(default_factory=dict)
    # tasks scored by exact match / F1 (HotpotQA): single-sample, and Best-of-N when best_of > 1
    qa: dict[str, QAScore] = dataclasses.field(default_factory=dict)
    qa_best_of: dict[str, QAScore] = dataclasses.field(default_factory=dict)
    # Training settings of the evaluated checkpoint (flat "data.general_ratio" keys), when known.
    run_config: dict[str, Any] = dataclasses.field(default_factory=dict)


def _num(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(float(value)) else float(value)


def _score(m: Mapping[str, Any], prefix: str = "") -> Score:
    eps = m.get("episodes")
    ends = m.get("terminations")
    return Score(
        _num(m.get(prefix + "success_rate")),
        _num(m.get(prefix + "progress_rate")),
        eps if isinstance(eps, int) else None,
        _num(m.get("valid_action_rate")),
        _num(m.get("format_error_rate")),
        tuple(sorted((str(k), int(v)) for k, v in ends.items())) if isinstance(ends, Mapping) else (),
        _num(m.get("recovery_rate")),
        _num(m.get("mean_steps_to_recover")),
        _num(m.get("repeated_error_rate")),
    )


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _run_config(doc: Mapping[str, Any], agent: str) -> dict[str, Any]:
    """The evaluated checkpoint's training settings: from the file when it records them, else from
    the project checkpoint the agent names (its meta's config), when it is still there."""
    for key in ("run_config", "train_config"):
        if isinstance(doc.get(key), Mapping):
            return _flatten(doc[key])
    if not agent.startswith("checkpoint:"):
        return {}
    path = agent.split(":", 1)[1]
    hf_dir = (pathlib.Path(path) / "config.json").is_file() and not _is_run(path)
    if not os.path.exists(path) or hf_dir:
        return {}  # moved away, or a Hugging Face directory: no training config to read
    from agentrefine_jax.checkpoint import read_meta, resolve_checkpoint

    try:
        root, step = resolve_checkpoint(path)
        config = read_meta(root, step).config
    except (FileNotFoundError, ValueError) as e:
        log.warning(f"{path}: no training config read ({e})")
        return {}
    return _flatten(config) if isinstance(config, Mapping) else {}


def _is_run(path: str) -> bool:
    """A training run directory (its config.json is the run's, not a Hugging Face model's)."""
    from agentrefine_jax.checkpoint import RUN_CHECKPOINTS_SUBDIR

    return (pathlib.Path(path) / RUN_CHECKPOINTS_SUBDIR).is_dir()


def _is_qa(task: str) -> bool:
    """A task the registry scores by exact match and F1 (reported as success and progress)."""
    from agentrefine_jax.eval import registry

    try:
        return registry.lookup(task).metric_names == ("EM", "F1")
    except ValueError:  # a plug-in task not loaded here
        return False


def _split_qa(result: RunResult) -> RunResult:
    for t in [t for t in result.tasks if _is_qa(t)]:
        s = result.tasks.pop(t)
        best = result.best_of_tasks.pop(t, None)
        result.qa[t] = QAScore(s.success, s.progress, s.episodes)  # type: ignore[arg-type]
        if best is not None:
            result.qa_best_of[t] = QAScore(best.success, best.progress, best.episodes)  # type: ignore[arg-type]
        result.perturbations.pop(t, None)
    return result


def _agent(doc: Mapping[str, Any]) -> str:
    return str(doc.get("agent") or doc.get("policy") or "?")


def _read(doc: Mapping[str, Any], path: str, label: str) -> RunResult:
    """A schema-/2 document (either source; older files are upgraded to it first)."""
    agent = _agent(doc)
    tasks = {t: _score(m) for t, m in doc["tasks"].items()}
    result = RunResult(path, label, agent, str(doc["source"]), tasks)
    bon = doc.get("best_of")
    if isinstance(bon, Mapping) and bon.get("tasks"):
        result.best_of = int(bon.get("n", 0)) or 2
        result.best_of_tasks = {
            t: _score(m["best_of"] | {"episodes": m.get("episodes")}) for t, m in bon["tasks"].items()
        }
        for t, m in bon["tasks"].items():  # Table 4's greedy row, where the file has no headline of its own
            result.tasks.setdefault(t, _score(m["greedy"]))
        if bon.get("greedy_run") == "sample 0":
            result.single_kind = "first sample"
    held = doc.get("held_out") or {}
    if _num(held.get("success_rate")) is not None or _num(held.get("progress_rate")) is not None:
        result.held_out = Score(_num(held.get("success_rate")), _num(held.get("progress_rate")))
        result.held_out_note = str(held.get("label") or "")
    variants = doc.get("variants") or {}
    original = (variants.get("original") or {}).get("tasks") or {}
    names = sorted((v for v in variants if v != "original"), key=_variant_index)
    for t, m in original.items():
        if names and all(t in variants[v]["tasks"] for v in names):
            result.perturbations[t] = [_score(m)] + [_score(variants[v]["tasks"][t]) for v in names]
    result.run_config = _run_config(doc, agent)
    return _split_qa(result)


def _variant_index(name: str) -> int:
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 10**6


# ----------------------------------------------------------------------------------------- older files


def _weighted(tasks: Mapping[str, Mapping[str, Any]], weights: Mapping[str, float]) -> dict[str, Any]:
    def mean(field: str) -> float | None:
        values = [(_num(tasks[t].get(field)), w) for t, w in weights.items() if t in tasks]
        if not values or any(v is None for v, _ in values):
            return None
        return sum(v * w for v, w in values) / sum(w for _, w in values)  # type: ignore[operator]

    return {"success_rate": mean("success_rate"), "progress_rate": mean("progress_rate")}


def _upgrade_builtin(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Schema /1 (or older) built-in file -> /2: its headline is `variants.original`, or that variant's
    first sample under Best-of-N (those files had no greedy run to report)."""
    variants = doc["variants"]
    if not isinstance(variants, Mapping) or "original" not in variants:
        raise ResultError("eval result without an 'original' variant")
    original = variants["original"]
    n = int((doc.get("config") or {}).get("best_of", 1) or 1)
    tasks = dict(original["tasks"])
    out = dict(doc) | {"source": "builtin", "tasks": tasks}
    if n > 1:
        first = ("success_rate", "progress_rate")
        tasks.update({t: dict(m) | {k: m.get("first_sample_" + k) for k in first} for t, m in tasks.items()})
        bon = dict(doc.get("best_of") or {"n": n})
        bon["greedy_run"] = "sample 0"
        bon["tasks"] = {
            t: {"greedy": tasks[t], "best_of": m, "episodes": m.get("episodes")}
            for t, m in original["tasks"].items()
        }
        out["best_of"] = bon
    weights = (original.get("held_out_average") or {}).get("weights") or {}
    out["held_out"] = _weighted(tasks, weights) | {
        "label": "paper weights 112/90/60/20 (Jericho's to TextWorld), renormalised"
    }
    return out


def _upgrade_agentboard(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Schema /1 (or older) AgentBoard file -> /2: the episode-weighted held-out mean and Table 3's
    `perturbation.<task>.variants` become `held_out` and `variants`."""
    out = dict(doc) | {"source": "agentboard"}
    weighted = (doc.get("held_out") or {}).get("episode_weighted_mean")
    held = weighted if isinstance(weighted, Mapping) else {}
    out["held_out"] = {k: held.get(k) for k in ("success_rate", "progress_rate")} | {
        "label": "episode-weighted (112/90/60/20)"
    }
    variants: dict[str, Any] = {"original": {"tasks": dict(doc["tasks"])}}
    for t, p in (doc.get("perturbation") or {}).items():
        for i, v in enumerate(p.get("variants", []), 1):
            variants.setdefault(f"perturbation_{v.get('index', i)}", {"tasks": {}})["tasks"][t] = v
    out["variants"] = variants
    return out


def _upgrade(doc: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    if str(doc.get("schema", "")).endswith("/2"):
        return doc
    return _upgrade_builtin(doc) if kind == "builtin" else _upgrade_agentboard(doc)


def _kind(doc: Any) -> str | None:
    if not isinstance(doc, Mapping):
        return None
    if doc.get("source") in ("builtin", "agentboard") and "schema" in doc:
        return "agentboard" if doc["source"] == "agentboard" else "builtin"
    if isinstance(doc.get("variants"), Mapping) and isinstance(doc.get("config"), Mapping):
        return "builtin"
    if doc.get("protocol") == "agentboard" and (
        isinstance(doc.get("tasks"), Mapping) or isinstance(doc.get("checkpoints"), list)
    ):
        return "agentboard"
    return None


def read_result(path: str | os.PathLike[str], label: str | None = None) -> RunResult:
    """Read one eval result file; `label` defaults to the run's `--name`, else the file name's stem."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ResultError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultError(
            f"{path}: not a JSON document ({e}); expected an eval result (eval --out)"
        ) from None
    kind = _kind(doc)
    name = (
        doc.get("config", {}).get("name")
        if isinstance(doc, Mapping) and isinstance(doc.get("config"), Mapping)
        else None
    )
    label = label or (str(name) if name else pathlib.Path(path).stem)
    if kind is None:
        keys = sorted(doc)[:8] if isinstance(doc, Mapping) else type(doc).__name__
        raise ResultError(
            f"{path}: not an eval result (keys {keys}); expected the JSON `python -m agentrefine_jax.eval "
            "--out` writes"
        )
    try:
        if "checkpoints" in doc:  # --all-checkpoints: the best checkpoint's result
            best = [r for r in doc["checkpoints"] if r.get("step") == doc.get("best_step")]
            if not best:
                raise ResultError(f"{path}: --all-checkpoints result without its best_step's entry")
            doc = best[0]["result"]
        return _read(_upgrade(doc, kind), path, label)
    except ResultError as e:
        raise ResultError(f"{path}: {e}" if not str(e).startswith(path) else str(e)) from None
    except (KeyError, TypeError, AttributeError) as e:
        raise ResultError(
            f"{path}: eval result with an unexpected layout ({type(e).__name__}: {e})"
        ) from None


def parse_setting(spec: str) -> tuple[str, str, Any]:
    """`LABEL:KEY=VALUE` (e.g. `mix20:data.general_ratio=0.2`); VALUE is read as JSON when it parses."""
    head, sep, text = spec.partition("=")
    label, colon, key = head.partition(":")
    if not sep or not colon or not label or not key:
        raise ResultError(f"--setting {spec!r}: expected LABEL:KEY=VALUE, e.g. mix20:data.general_ratio=0.2")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return label, key, value


def read_results(specs: Sequence[str], settings: Sequence[str] = ()) -> list[RunResult]:
    """`PATH` or `LABEL=PATH` each; labels must be unique (they name the rows). `settings`
    (`LABEL:KEY=VALUE`) add or override training settings of a run (e.g. one evaluated through an
    endpoint, whose result file names no checkpoint)."""
    out: list[RunResult] = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or os.path.exists(spec):
            label, path = "", spec
        out.append(read_result(path, label or None))
    seen: dict[str, str] = {}
    for r in out:
        if r.label in seen:
            raise ResultError(
                f"two results are labelled {r.label!r} ({seen[r.label]}, {r.path}); name them LABEL=PATH"
            )
        seen[r.label] = r.path
    for label, key, value in map(parse_setting, settings):
        if label not in seen:
            raise ResultError(f"--setting for {label!r}: no result has that label ({', '.join(seen)})")
        next(r for r in out if r.label == label).run_config[key] = value
    return out
