"""The `meta` item of a step, typed: `CheckpointMeta` (with `LoraMeta` for a LoRA run).

On disk it is the JSON object this project has always written, unchanged, so every older
checkpoint still loads:

  {"model": ModelConfig dict, "tokenizer": str|None, "template": str|None,
   "config": full Config dict|None, "step": int,
   and when known: "source_dtype" (dtype of the HF weights it was imported from; export's
   `auto`), "schedule_steps" (the LR schedule's horizon), "steps_per_epoch", "epoch" (on a
   step that closes an epoch), "lora" (rank, alpha, dropout, targets, base_dtype, "base":
   {"init_from_hf": dir, "sha256": ...} or {"seed": n, "shapes": ...}, and "base_rounding":
   {"stored": dtype, "trained": dtype} when base_dtype rounded or quantised the HF base)}

Every reader goes through `CheckpointMeta.from_json` (`read_meta`); nothing reads it by string keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from agentrefine_jax.checkpoint.format import ITEM_META
from agentrefine_jax.models.config import ModelConfig, RopeScaling


def _without_none(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class LoraBase:
    """How a LoRA run's frozen base is rebuilt (an HF directory, or the seed of a random model)
    and what identifies it (the sha256 of the HF weights, or the random model's shapes)."""

    init_from_hf: str | None = None
    seed: int | None = None
    sha256: str | None = None
    shapes: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _without_none(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LoraBase:
        seed = d.get("seed")
        return cls(
            d.get("init_from_hf"), None if seed is None else int(seed), d.get("sha256"), d.get("shapes")
        )


@dataclasses.dataclass(frozen=True)
class LoraMeta:
    """A LoRA run's adapters settings and its base: the step's `params` hold only the adapters."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    base_dtype: str  # as the run held it ("auto" resolved to the model's param_dtype)
    base: LoraBase
    # (the HF directory's stored dtype, base_dtype) when training rounded or quantised the base the
    # user has: the trained model (rounded base + adapters) is then not exactly what the hand-offs
    # (merged export, PEFT adapter on that directory) serve. None: the base as stored.
    base_rounding: tuple[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "base_dtype": self.base_dtype,
            "base": self.base.to_json(),
        }
        if self.base_rounding is not None:
            stored, trained = self.base_rounding
            out["base_rounding"] = {"stored": stored, "trained": trained}
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LoraMeta:
        rounding = d.get("base_rounding")
        return cls(
            int(d["rank"]),
            float(d["alpha"]),
            float(d["dropout"]),
            tuple(d["targets"]),
            str(d["base_dtype"]),
            LoraBase.from_json(d["base"]),
            (str(rounding["stored"]), str(rounding["trained"])) if rounding else None,
        )


_OPTIONAL = ("source_dtype", "schedule_steps", "steps_per_epoch", "epoch")


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    model: ModelConfig
    step: int = 0
    tokenizer: str | None = None
    template: str | None = None
    config: dict[str, Any] | None = None  # the run's full Config as a dict
    source_dtype: str | None = None
    schedule_steps: int | None = None
    steps_per_epoch: int | None = None
    epoch: int | None = None
    lora: LoraMeta | None = None

    def to_json(self) -> dict[str, Any]:
        from agentrefine_jax.config import to_dict

        out: dict[str, Any] = {
            "model": to_dict(self.model),
            "tokenizer": self.tokenizer,
            "template": self.template,
            "config": self.config,
            "step": int(self.step),
        }
        out |= _without_none({k: getattr(self, k) for k in _OPTIONAL})
        if self.lora is not None:
            out["lora"] = self.lora.to_json()
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CheckpointMeta:
        """Keys this version does not know are ignored (readers never needed them); an unknown
        model field is an error (see `model_config_from_meta`)."""
        if not isinstance(d.get("model"), Mapping):
            raise ValueError("checkpoint meta lacks ['model']")
        opt = {k: d.get(k) for k in _OPTIONAL}
        for k in ("schedule_steps", "steps_per_epoch", "epoch"):
            opt[k] = None if opt[k] is None else int(opt[k])
        return cls(
            model_config_from_meta(d),
            step=int(d.get("step") or 0),
            tokenizer=d.get("tokenizer"),
            template=d.get("template"),
            config=d.get("config"),
            lora=LoraMeta.from_json(d["lora"]) if d.get("lora") else None,
            **opt,
        )


def make_meta(model_cfg: ModelConfig, *, step: int, config: Any = None, **fields: Any) -> CheckpointMeta:
    """A step's meta; `config` may be a `Config` dataclass or its dict, `fields` are
    CheckpointMeta's other fields (tokenizer, template, source_dtype, ...)."""
    from agentrefine_jax.config import to_dict

    if config is not None and dataclasses.is_dataclass(config):
        config = to_dict(config)
    return CheckpointMeta(model_cfg, step=int(step), config=config, **fields)


def model_config_from_meta(meta: Mapping[str, Any]) -> ModelConfig:
    """Rebuild the ModelConfig stored in `meta["model"]` (also accepts that dict itself).

    Unknown keys are an error: a field this version does not know may change the architecture.
    """
    d = dict(meta["model"] if "model" in meta and isinstance(meta["model"], Mapping) else meta)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"checkpoint model config has fields this version does not know: {unknown}")
    if isinstance(d.get("rope_scaling"), Mapping):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("eos_token_ids") is not None:
        d["eos_token_ids"] = tuple(int(x) for x in d["eos_token_ids"])
    return ModelConfig(**d)


def read_meta(root: epath.Path, step: int) -> CheckpointMeta:
    path = root / str(step) / ITEM_META
    if not path.exists():
        raise FileNotFoundError(f"checkpoint step {root / str(step)} has no '{ITEM_META}' item")
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path, args=ocp.args.JsonRestore())
    if "model" not in meta:
        raise ValueError(f"checkpoint meta at {path} lacks ['model']")
    try:
        return CheckpointMeta.from_json(meta)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint meta at {path} is unusable: {e}") from None
