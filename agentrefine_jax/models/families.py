"""The model families we support, in one table: everything that differs between them.

A family is a transformers decoder architecture on our one config-driven decoder
(`models/llama.py`). Its row says how it is named on the Hugging Face side, which optional
parameters its models hold (rows of `models/params.py` with a presence rule), how its
`config.json` maps to `ModelConfig` beyond the shared Llama keys (both ways), and where its
chat template and tokenizer come from:

- vendor-checked (`llama3`, `mistral`): our own template and tokenizer, checked token for
  token against the vendors' encoders (llama-models, mistral-common);
- from the directory (`hf`): the HF model directory's own `tokenizer.json` and the Jinja
  `chat_template` of its `tokenizer_config.json` (`data/templates.py` HFDirTemplate), checked
  against transformers' `apply_chat_template`.

Adding a family = a row here (plus a config file in configs/); the forward pass, HF import and
export, parameter counts and sharding read the row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family and HF `model_type`
    architecture: str  # HF `architectures[0]`
    # Optional parameter groups this family's models hold (presence rules in models/params.py).
    qkv_bias: bool = False
    # RMSNorm over head_dim of each query/key head, before RoPE (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    # Reads/writes HF `sliding_window` (one window for every layer).
    sliding_window: bool = False
    # Routed experts (Qwen3-MoE) in every layer in place of the dense MLP: a router and stacked
    # expert projections (models/moe.py); the dense w_gate/w_up/w_down rows are not held.
    moe: bool = False
    # Extra HF config.json keys: read check (raises on what we cannot run) and written constants.
    check_hf: Callable[[Mapping[str, Any]], None] = lambda c: None
    # Takes the ModelConfig (typed Any: models/config.py imports this table, not the reverse).
    hf_constants: Callable[[Any], dict[str, Any]] = lambda cfg: {}
    # Default chat template and tokenizer: a vendor-checked name, or "hf" (the HF directory's own).
    template: str = "hf"
    tokenizer: str = "hf"

    @property
    def vendor_checked(self) -> bool:
        return self.template != "hf"


def _llama_check(c: Mapping[str, Any]) -> None:
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise ValueError(f"{flag}=true is not supported for Llama: the model has no bias terms")


def _full_attention_only(c: Mapping[str, Any], name: str) -> None:
    """Qwen configs can ask for sliding windows on some layers (`use_sliding_window` with
    `max_window_layers`, or `layer_types`); our decoder runs one attention kind for every layer."""
    if c.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true (per-layer windows) is not supported for {name}")
    kinds = sorted(set(c.get("layer_types") or ()) - {"full_attention"})
    if kinds:
        raise ValueError(f"layer_types {kinds} are not supported for {name} (full_attention only)")


def _qwen2_check(c: Mapping[str, Any]) -> None:
    _full_attention_only(c, "Qwen2")


def _qwen3_constants(cfg: Any) -> dict[str, Any]:
    """config.json keys every Qwen3 directory (dense and MoE) has and our model has no field for."""
    return {
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
    }


def _qwen3_check(c: Mapping[str, Any]) -> None:
    # Qwen3's q/k/v/o projections take a bias only with attention_bias=true (no published model).
    if c.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for Qwen3: its projections have no biases")
    _full_attention_only(c, "Qwen3")


def _qwen3_moe_check(c: Mapping[str, Any]) -> None:
    """Qwen3-MoE as published: every layer sparse. HF can mix dense-MLP layers in
    (`decoder_sparse_step` > 1 or `mlp_only_layers`); our stacked layers have one kind."""
    _qwen3_check(c)
    step = c.get("decoder_sparse_step", 1)
    if step != 1 or c.get("mlp_only_layers"):
        raise ValueError(
            f"decoder_sparse_step={step}, mlp_only_layers={c.get('mlp_only_layers')}: layers with a dense "
            "MLP among the sparse ones are not supported for Qwen3-MoE (every layer routed only)"
        )
    for key in ("moe_intermediate_size", "num_experts_per_tok"):
        if key not in c:
            raise ValueError(f"config.json lacks {key}")
    if not (c.get("num_experts") or c.get("num_local_experts")):
        raise ValueError("config.json lacks num_experts (or num_local_experts)")


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            check_hf=_llama_check,
            hf_constants=lambda cfg: {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
            template="llama3",
            tokenizer="llama3",
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            sliding_window=True,
            template="mistral",
            tokenizer="mistral",
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            qkv_bias=True,
            check_hf=_qwen2_check,
            hf_constants=lambda cfg: {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": cfg.num_layers,
            },
        ),
        # Qwen3 dense: Llama's layout plus q/k RMSNorm over head_dim (before RoPE), no biases,
        # head_dim set explicitly (128, not hidden / heads).
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            qk_norm=True,
            check_hf=_qwen3_check,
            hf_constants=_qwen3_constants,
        ),
        # Qwen3-MoE: Qwen3's attention; every layer's MLP is routed over `num_experts` experts
        # (top-`num_experts_per_tok` of a float32 softmax, renormalised when norm_topk_prob).
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            qk_norm=True,
            moe=True,
            check_hf=_qwen3_moe_check,
            hf_constants=lambda cfg: {
                **_qwen3_constants(cfg),
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "norm_topk_prob": cfg.norm_topk_prob,
                "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "output_router_logits": False,
            },
        ),
    )
}


def get(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model family {name!r} is not supported ({', '.join(FAMILIES)})") from None
