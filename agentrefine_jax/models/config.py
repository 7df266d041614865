"""Model configuration and the shipped presets.

One `ModelConfig` describes every model we support (Llama-3, Mistral, Qwen2.5, Qwen3, Qwen3-MoE; the families
and what differs between them are in models/families.py), made of three parts: the `Architecture`
(the function), its `Interface` (special tokens, context length) and its `Execution` settings (how
it runs). The model code branches only on the architecture, the family's row and the resolved
`ExecutionPlan` (models/execution.py), never on a family name.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Literal

from agentrefine_jax.models import families


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style ("llama3") frequency scaling of rotary embeddings."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The function the network computes: what a `config.json` and the family table fix about the
    weights and the math. Two models with equal architectures compute the same logits from the same
    weights, however they run (`Execution`) and whatever their token ids (`Interface`)."""

    family: str = "llama"  # a row of models/families.py
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    sliding_window: int | None = None
    # Routed experts (families with `moe`, models/moe.py); all zero for dense families.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1

    def __post_init__(self) -> None:
        fam = families.get(self.family)  # ValueError naming the supported families
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size)
        if fam.moe and not (min(moe) >= 1 and self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"family {self.family!r} routes experts: num_experts, moe_intermediate_size >= 1 and "
                f"1 <= num_experts_per_tok <= num_experts are needed, got {moe}"
            )
        if not fam.moe and any(moe):
            raise ValueError(f"family {self.family!r} is dense: num_experts etc. must stay 0, got {moe}")

    @property
    def active_experts_fraction(self) -> float:
        """The share of the expert weights one token runs through (k / E; 1 for dense models)."""
        return self.num_experts_per_tok / self.num_experts if self.num_experts else 1.0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def architecture_diff(self, other: Architecture) -> list[str]:
        """Names of the `Architecture` fields that differ: the function the model computes changed.
        Floats compare as float32 (config.json round trips). Used by `export verify`."""
        return _diff(self, other, ARCHITECTURE_FIELDS)


@dataclasses.dataclass(frozen=True)
class Interface:
    """What a `config.json` says beside the function: the special tokens and the advertised context
    (RoPE depends on rope_theta / rope_scaling, never on max_position_embeddings)."""

    max_position_embeddings: int = 8192
    bos_token_id: int = 128000
    eos_token_ids: tuple[int, ...] = (128001, 128009)
    pad_token_id: int | None = None
    # HF's weight of the auxiliary load-balancing loss (MoE families; config.json's value, which
    # transformers applies only with output_router_logits). Changes the training loss, not logits.
    router_aux_loss_coef: float = 0.0


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the model is initialised and runs — never read from a config.json, never compared with
    one. Settings as the user writes them ("auto" included); `models/execution.py` resolves them
    once against the devices a step is compiled for into the `ExecutionPlan` the model runs by."""

    initializer_range: float = 0.02
    # Storage dtype of parameters (master weights) vs the dtype matmuls run in.
    param_dtype: str = "float32"
    dtype: str = "bfloat16"
    # "auto" | "none" | "full" | "dots" | "dots_no_batch" | "save_attn_out": what the backward pass
    # keeps. "auto" = "dots_no_batch" in the CPU layout, "none" elsewhere (models/execution.py).
    remat_policy: str = "auto"
    # lax.scan over the stacked layers: one compiled layer body instead of N copies.
    scan_layers: bool = True
    # Queries are processed in blocks of this many tokens so the [heads, S, S] score
    # matrix never exists whole (0 = one block). Exact: no approximation involved.
    attention_block_size: int = 0
    # The MLP runs over sequence chunks of this many tokens, each rematerialised in the backward
    # pass, so its [B, S, intermediate] tensors exist one chunk at a time (0 = whole sequence).
    # Exact per token; the weight gradients sum the chunks' products in float32.
    mlp_chunk_size: int = 0
    # "auto" | "xla" | "splash" | "cudnn" (see models/attention.py); auto = splash on TPU,
    # cudnn on GPU (16-bit compute), blocked XLA elsewhere.
    attention: str = "auto"
    # Splash kernel tiles (tokens); clipped to the sequence, multiples of 128.
    splash_block_q: int = 512
    splash_block_kv: int = 512
    splash_block_kv_compute: int = 512
    # 2-D projections (models/cpu_layout.py) and one-batch-dimension attention dots
    # (attention.attend_flat), layers scanned under remat "dots_no_batch" by default (remat_policy "auto";
    # unrolled with "none"): faster on XLA:CPU, same numbers; training (no KV
    # cache) only, except that decode loops then unroll the layers over per-layer cache arrays
    # (inference/engine.py). "auto" = on when the step's devices are CPUs (models/execution.py).
    cpu_layout: bool | str = "auto"

    def __post_init__(self) -> None:
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        if self.cpu_layout not in (True, False, "auto"):
            raise ValueError(f"cpu_layout must be true, false or auto, got {self.cpu_layout!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if self.attention == "cudnn" and self.dtype == "float32":
            raise ValueError("attention='cudnn' needs dtype bfloat16 or float16 (cuDNN has no float32 path)")
        for name in ("splash_block_q", "splash_block_kv", "splash_block_kv_compute"):
            if getattr(self, name) <= 0 or getattr(self, name) % 128:
                raise ValueError(f"{name} must be a positive multiple of 128, got {getattr(self, name)}")
        if self.splash_block_kv % self.splash_block_kv_compute:
            raise ValueError("splash_block_kv must be a multiple of splash_block_kv_compute")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Execution, Interface, Architecture):
    """The run config's `model` section: one flat set of keys (`--set model.dtype=...`, and the
    JSON every checkpoint records), made of the three parts above. Code that compares or runs a
    model asks for the part it means: `architecture_diff`, `hf_diff`, `.execution`."""

    def __post_init__(self) -> None:
        Architecture.__post_init__(self)
        Execution.__post_init__(self)

    @property
    def architecture(self) -> Architecture:
        return Architecture(**{f: getattr(self, f) for f in ARCHITECTURE_FIELDS})

    @property
    def execution(self) -> Execution:
        return Execution(**{f: getattr(self, f) for f in EXECUTION_FIELDS})

    def hf_diff(self, other: ModelConfig) -> list[str]:
        """Fields a Hugging Face `config.json` describes that differ: the architecture plus the
        special tokens and the context length (`HF_FIELDS`). Used by `train.init_from_hf`."""
        return _diff(self, other, HF_FIELDS)


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


ARCHITECTURE_FIELDS = _names(Architecture)
# What an HF config.json fixes: the architecture, the special tokens and the context length.
HF_FIELDS = ARCHITECTURE_FIELDS + _names(Interface)
EXECUTION_FIELDS = _names(Execution)


def _diff(a: object, b: object, names: tuple[str, ...]) -> list[str]:
    return [f for f in names if not same_value(getattr(a, f), getattr(b, f))]


def same_value(a: object, b: object) -> bool:
    """Equal, with floats (also inside RopeScaling) compared at float32: `rms_norm_eps` 1e-05 and
    9.999999747378752e-06 (its float32 round trip through a checkpoint) are the same setting."""
    if isinstance(a, float) or isinstance(b, float):
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            return False
        return struct.pack("<f", a) == struct.pack("<f", b)
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(same_value(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


# The floating-point dtypes a model may store or compute in: the one list (config checks, CLIs).
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("auto", "none", "full", "dots", "dots_no_batch", "save_attn_out")
ATTENTION_IMPLS = ("auto", "xla", "splash", "cudnn")

_LLAMA3_8B = ModelConfig()
_LLAMA3_70B = dataclasses.replace(
    _LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8
)
_LLAMA31 = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

PRESETS: dict[str, ModelConfig] = {
    "llama3_8b": _LLAMA3_8B,
    "llama3.1_8b": dataclasses.replace(_LLAMA3_8B, rope_scaling=_LLAMA31, max_position_embeddings=131072),
    "llama3_70b": _LLAMA3_70B,
    "llama3.1_70b": dataclasses.replace(_LLAMA3_70B, rope_scaling=_LLAMA31, max_position_embeddings=131072),
    "mistral_7b_v0.3": ModelConfig(
        family="mistral",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    # Qwen2.5-7B-Instruct's config.json (q/k/v biases come with the family, models/families.py).
    "qwen2.5_7b": ModelConfig(
        family="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    # Small enough to train on two CPU cores in minutes; same architecture as Llama-3.
    # The vocabulary is Llama-3's so the real tokenizer and chat template apply unchanged.
    "tiny": ModelConfig(
        vocab_size=128256,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        max_position_embeddings=2048,
        tie_embeddings=True,
        param_dtype="float32",
        dtype="float32",
    ),
}


# Presets below name architecture fields only (what config.json says): how a run executes
# (dtypes, remat, scan, attention) is the config file's business.

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json: Llama layout, 9/3 heads, tied, <|im_end|> = 2.
PRESETS["smollm2_135m"] = ModelConfig(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=2,
)

# meta-llama/Llama-3.2-{1B,3B}-Instruct's config.json: tied embeddings, llama3 rope scaling with
# factor 32 over an original 8192-token context; eos lists <|end_of_text|>, <|eom_id|>, <|eot_id|>.
_LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32 = dict(
    family="llama",
    vocab_size=128256,
    intermediate_size=8192,
    num_kv_heads=8,
    rope_theta=500000.0,
    rope_scaling=_LLAMA32_ROPE,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_embeddings=True,
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)
PRESETS["llama3.2_1b"] = ModelConfig(hidden_size=2048, num_layers=16, num_heads=32, head_dim=64, **_LLAMA32)
PRESETS["llama3.2_3b"] = ModelConfig(hidden_size=3072, num_layers=28, num_heads=24, head_dim=128, **_LLAMA32)

# Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} (the post-trained releases) config.json: vocab 151936,
# head_dim 128 for every size, rope theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960,
# no attention bias, no sliding window; tied embeddings up to 4B. bos 151643 (<|endoftext|>); eos
# as for Qwen2.5: config.json's <|im_end|> (151645) then generation_config.json's <|endoftext|>
# (151643), the union read_hf_config forms. transformers' Qwen3Config defaults (vocab 151936,
# head_dim 128, rms 1e-6) agree; its other defaults (8B-like sizes, max positions 32768, no
# bos/eos) are not a published model. Parameter counts: tests/test_model_presets.py.
_QWEN3 = dict(
    family="qwen3",
    vocab_size=151936,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_ids=(151645, 151643),
)
for _name, _hidden, _inter, _layers, _heads, _kv, _tied in (
    ("qwen3_0.6b", 1024, 3072, 28, 16, 8, True),
    ("qwen3_1.7b", 2048, 6144, 28, 16, 8, True),
    ("qwen3_4b", 2560, 9728, 36, 32, 8, True),
    ("qwen3_8b", 4096, 12288, 36, 32, 8, False),
    ("qwen3_14b", 5120, 17408, 40, 40, 8, False),
    ("qwen3_32b", 5120, 25600, 64, 64, 8, False),
):
    PRESETS[_name] = ModelConfig(
        hidden_size=_hidden,
        intermediate_size=_inter,
        num_layers=_layers,
        num_heads=_heads,
        num_kv_heads=_kv,
        tie_embeddings=_tied,
        **_QWEN3,
    )

# Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B (config.json): Qwen3's attention, every layer routed over
# 128 experts, top 8, renormalised (norm_topk_prob), untied; intermediate_size is the dense MLP
# width HF keeps in config.json for dense layers (none here: decoder_sparse_step 1). 30B-A3B:
# 30.5B parameters, 3.3B active per token (tests/test_family_qwen3_moe.py).
_QWEN3_MOE = dict(
    _QWEN3,
    family="qwen3_moe",
    num_kv_heads=4,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    tie_embeddings=False,
)
PRESETS["qwen3_30b_a3b"] = ModelConfig(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_layers=48,
    num_heads=32,
    **_QWEN3_MOE,
)
PRESETS["qwen3_235b_a22b"] = ModelConfig(
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_layers=94,
    num_heads=64,
    **_QWEN3_MOE,
)


def preset(name: str, **overrides: object) -> ModelConfig:
    try:
        base = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}") from None
    return dataclasses.replace(base, **overrides)
