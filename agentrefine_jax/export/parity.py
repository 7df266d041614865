"""Check a project checkpoint against a Hugging Face checkpoint with transformers as the oracle.

Both stacks run the same token ids: several independent sequences of different lengths
and one packed row (two of those sequences back to back plus padding) that must equal
the separate runs. Reported: max |Δlogit|, mean and max per-token KL(p_hf || p_ours),
top-1 agreement. The check fails on any architecture mismatch between the two
configs, on any weight transformers could not load (it would silently random-initialise
it), or when a metric exceeds its tolerance.

When one side stores weights in lower precision than the other (a bfloat16 export of a
float32 checkpoint, or a checkpoint imported with --param-dtype bfloat16), the more
precise side is rounded to that precision first, so the comparison tests the
conversion, not the rounding the user asked for.

A LoRA run is checked as it is handed off (`load_model(handoff=True)`: the adapters merged
into the base as the user has it), against either hand-off: a merged export, or a PEFT adapter
directory (run by peft on the base its `base_model_name_or_path` names). When the run trained
on a rounded copy of that base (`train.lora.base_dtype` below the stored precision), the
trained model (rounded base + adapters) is run on the same inputs too, and its difference from
the hand-off is reported in one line (`VerifyResult.trained`), for information: it is what the
rounding cost, not a conversion error.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from agentrefine_jax.checkpoint import load_model, trained_base_rounding
from agentrefine_jax.hf.io import _PRECISION, NP_DTYPES, hf_storage_dtype, read_hf_config
from agentrefine_jax.hf.peft import base_path, is_adapter_dir
from agentrefine_jax.models.config import ModelConfig

Log = Callable[[str], None]
DEFAULT_SEQ_LENS = (16, 128, 512)
# (max |Δlogit|, mean KL) defaults per compute dtype. float32: both stacks compute the
# same function up to accumulation order (tiny models agree to ~1e-5). bfloat16: each
# stack rounds activations differently at every op, so logits drift by O(0.1).
DEFAULT_TOLERANCES = {"float32": (5e-3, 1e-5), "bfloat16": (1.0, 2e-2)}


@dataclasses.dataclass
class CaseResult:
    name: str
    tokens: int
    max_abs_diff: float
    mean_kl: float
    max_kl: float
    top1_agreement: float


@dataclasses.dataclass
class VerifyResult:
    cases: list[CaseResult]
    atol: float
    kl_tol: float
    compute_dtype: str
    problems: list[str]
    # A LoRA run that trained on a rounded base: (stored dtype, trained dtype) and the trained
    # model's (rounded base + adapters) difference from the hand-off on the same inputs.
    rounding: tuple[str, str] | None = None
    trained: CaseResult | None = None

    @property
    def max_abs_diff(self) -> float:
        return max((c.max_abs_diff for c in self.cases), default=float("nan"))

    @property
    def mean_kl(self) -> float:
        n = sum(c.tokens for c in self.cases)
        return sum(c.mean_kl * c.tokens for c in self.cases) / n if n else float("nan")

    @property
    def max_kl(self) -> float:
        return max((c.max_kl for c in self.cases), default=float("nan"))

    @property
    def passed(self) -> bool:
        return (
            not self.problems
            and bool(self.cases)
            and self.max_abs_diff <= self.atol
            and self.mean_kl <= self.kl_tol
        )


def config_mismatches(ours: ModelConfig, hf: ModelConfig) -> list[str]:
    return [
        f"{f}: checkpoint {getattr(ours, f)!r} vs HF {getattr(hf, f)!r}" for f in ours.architecture_diff(hf)
    ]


def _round_params(model: nnx.Module, dtype: str) -> None:
    state = nnx.state(model, nnx.Param)
    rounded = jax.tree.map(lambda x: x.astype(NP_DTYPES[dtype]).astype(x.dtype), state)
    nnx.update(model, rounded)


def _kl_stats(hf: np.ndarray, ours: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KL(p_hf || p_ours) and top-1 agreement, in float64."""
    a = hf.astype(np.float64)
    b = ours.astype(np.float64)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return np.maximum(kl, 0.0), a.argmax(-1) == b.argmax(-1)


def _case(name: str, hf: np.ndarray, ours: np.ndarray) -> CaseResult:
    kl, agree = _kl_stats(hf, ours)
    return CaseResult(
        name=name,
        tokens=int(kl.size),
        max_abs_diff=float(np.abs(hf - ours).max()),
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1_agreement=float(agree.mean()),
    )


def verify(
    checkpoint: str | pathlib.Path,
    hf_dir: str | pathlib.Path,
    *,
    atol: float | None = None,
    kl_tol: float | None = None,
    compute_dtype: str = "float32",
    seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
    seed: int = 0,
    mesh: Mesh | None = None,
    log: Log | None = None,
) -> VerifyResult:
    """Run our forward and transformers' on the same inputs and compare (see module docstring)."""
    import torch

    log = log or (lambda _: None)
    if compute_dtype not in DEFAULT_TOLERANCES:
        raise ValueError(f"compute dtype must be one of {sorted(DEFAULT_TOLERANCES)}, got {compute_dtype!r}")
    d_atol, d_kl = DEFAULT_TOLERANCES[compute_dtype]
    result = VerifyResult(
        cases=[],
        atol=d_atol if atol is None else atol,
        kl_tol=d_kl if kl_tol is None else kl_tol,
        compute_dtype=compute_dtype,
        problems=[],
    )
    if not (result.atol >= 0 and result.kl_tol >= 0):  # NaN fails too
        raise ValueError(f"tolerances must be >= 0, got atol={result.atol}, kl_tol={result.kl_tol}")

    adapter_dir = hf_dir if is_adapter_dir(hf_dir) else None
    if adapter_dir is not None:  # a PEFT hand-off: the adapters on the base the directory names
        hf_dir = base_path(adapter_dir)
    hf_cfg = read_hf_config(hf_dir)
    cfg, model, meta = load_model(checkpoint, mesh=mesh, dtype=compute_dtype, handoff=True)
    result.rounding = trained_base_rounding(meta)
    result.problems += config_mismatches(cfg, hf_cfg)
    if result.problems:
        return result
    for f in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        if getattr(cfg, f) != getattr(hf_cfg, f):
            log(
                f"note: {f} differs (checkpoint {getattr(cfg, f)!r}, HF {getattr(hf_cfg, f)!r}); "
                "logits unaffected"
            )

    storage = hf_storage_dtype(hf_dir)
    if storage is not None and _PRECISION[storage] < _PRECISION[cfg.param_dtype]:
        log(f"note: HF weights are stored in {storage}; rounding checkpoint weights to {storage} to compare")
        _round_params(model, storage)

    hf_model = _load_transformers(hf_dir, compute_dtype, adapter_dir, result.problems)
    if result.problems:
        return result
    hf_model.eval()
    if (
        storage is not None
        and _PRECISION[cfg.param_dtype] < _PRECISION[storage]
        and compute_dtype == "float32"
    ):
        # The checkpoint holds fewer bits (e.g. from-hf --param-dtype bfloat16): round HF's copy likewise.
        log(
            f"note: checkpoint weights are {cfg.param_dtype}; "
            f"rounding the HF weights to {cfg.param_dtype} to compare"
        )
        low = getattr(torch, cfg.param_dtype)
        with torch.no_grad():
            for p in hf_model.parameters():
                p.copy_(p.to(low).to(p.dtype))

    forward = nnx.jit(lambda m, ids, pos, seg: m(ids, pos, seg))
    trained = None
    if result.rounding is not None:  # the model the run trained: its base as it held it
        _, trained, _ = load_model(checkpoint, mesh=mesh, dtype=compute_dtype)
        trained_out: list[np.ndarray] = []
    rng = np.random.default_rng(seed)
    lens = sorted({min(int(n), cfg.max_position_embeddings) for n in seq_lens if int(n) > 0})
    if not lens:
        raise ValueError("seq_lens must contain at least one positive length")
    seqs = [rng.integers(0, cfg.vocab_size, size=n, dtype=np.int64) for n in lens]
    hf_out = []
    for ids in seqs:
        with torch.no_grad():
            ref = hf_model(input_ids=torch.as_tensor(ids[None])).logits[0].float().numpy()
        hf_out.append(ref)
        ours = np.asarray(forward(model, jnp.asarray(ids[None], jnp.int32), None, None))[0]
        result.cases.append(_case(f"sequence of {len(ids)} tokens", ref, ours))
        log(_fmt(result.cases[-1]))
        if trained is not None:
            trained_out.append(np.asarray(forward(trained, jnp.asarray(ids[None], jnp.int32), None, None))[0])
    if trained is not None:
        result.trained = _case("the trained model", np.concatenate(hf_out), np.concatenate(trained_out))

    if len(seqs) >= 2:
        # Two documents + padding in one row must equal the two separate runs.
        a, b = seqs[0], seqs[1]
        pad = 8
        ids = np.concatenate([a, b, np.zeros(pad, np.int64)])[None]
        seg = np.concatenate([np.full(len(a), 1), np.full(len(b), 2), np.zeros(pad)]).astype(np.int32)[None]
        pos = np.concatenate([np.arange(len(a)), np.arange(len(b)), np.zeros(pad)]).astype(np.int32)[None]
        ours = np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seg)))[0]
        ref = np.concatenate(hf_out[:2])
        result.cases.append(
            _case(f"packed row ({len(a)}+{len(b)} tokens + {pad} padding)", ref, ours[: len(ref)])
        )
        log(_fmt(result.cases[-1]))
    return result


def _load_transformers(
    hf_dir: str | pathlib.Path,
    compute_dtype: str,
    adapter_dir: str | pathlib.Path | None,
    problems: list[str],
) -> Any:
    """transformers' model of `hf_dir` (with peft's adapters from `adapter_dir`, if given); any
    weight it could not load is a problem (it would silently random-initialise it)."""
    import torch
    import transformers

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir,
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[compute_dtype],
        use_safetensors=True,
        local_files_only=True,
        attn_implementation="eager",
        output_loading_info=True,
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            problems.append(f"transformers {key.replace('_', ' ')}: {sorted(map(str, info[key]))[:10]}")
    return hf_model if adapter_dir is None else _with_adapters(hf_model, adapter_dir, problems)


def _with_adapters(hf_model: Any, adapter_dir: str | pathlib.Path, problems: list[str]) -> Any:
    """transformers' base with peft's adapters from `adapter_dir` (unmerged: PEFT's own forward);
    an adapter weight peft could not place is a problem, as a missing base weight is."""
    import peft
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    peft_model = peft.PeftModel.from_pretrained(hf_model, str(adapter_dir))
    loaded = set_peft_model_state_dict(peft_model, load_peft_weights(str(adapter_dir)))
    if loaded.unexpected_keys:
        problems.append(f"peft unexpected keys: {sorted(map(str, loaded.unexpected_keys))[:10]}")
    return peft_model


def _fmt(c: CaseResult) -> str:
    return (
        f"  {c.name}: max |Δlogit| {c.max_abs_diff:.3g}, mean KL {c.mean_kl:.3g}, "
        f"max KL {c.max_kl:.3g}, top-1 agreement {c.top1_agreement:.1%}"
    )


def summary(result: VerifyResult) -> str:
    if result.problems:
        return "FAIL:\n  " + "\n  ".join(result.problems)
    verdict = "PASS" if result.passed else "FAIL"
    line = (
        f"{verdict} ({result.compute_dtype} compute): max |Δlogit| {result.max_abs_diff:.3g} "
        f"(tolerance {result.atol:g}), mean KL {result.mean_kl:.3g} (tolerance {result.kl_tol:g}), "
        f"max KL {result.max_kl:.3g}"
    )
    return line if result.trained is None else f"{line}\n{trained_line(result)}"


def trained_line(result: VerifyResult) -> str:
    """One line: the trained model (its base rounded, + adapters) against this hand-off."""
    (stored, low), t = result.rounding, result.trained
    return (
        f"note: the run trained on its base rounded from {stored} to {low} (train.lora.base_dtype); "
        f"the trained model (rounded base + adapters) vs this hand-off (adapters on the {stored} "
        f"base): max |Δlogit| {t.max_abs_diff:.3g}, mean KL {t.mean_kl:.3g}, "
        f"top-1 agreement {t.top1_agreement:.1%} (not counted in the verdict)"
    )


def result_dict(result: VerifyResult) -> dict[str, Any]:
    return {
        "passed": result.passed,
        "max_abs_diff": result.max_abs_diff,
        "mean_kl": result.mean_kl,
        "max_kl": result.max_kl,
        "atol": result.atol,
        "kl_tol": result.kl_tol,
        "compute_dtype": result.compute_dtype,
        "problems": result.problems,
        "cases": [dataclasses.asdict(c) for c in result.cases],
        "base_rounding": None
        if result.rounding is None
        else {"stored": result.rounding[0], "trained": result.rounding[1]},
        "trained_vs_handoff": None if result.trained is None else dataclasses.asdict(result.trained),
    }
