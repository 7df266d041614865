"""Small random transformers checkpoints on disk (Llama, Mistral, Qwen3, Llama-3.2): the oracle for
model, export and family tests, plus the helpers those tests share (a ChatML tokenizer trained on the
demo data, transformers' greedy generation, the `--set` list that trains from an HF directory).

Shared by the model, export and generation tests. Everything is built locally from a
config (no hub access): `torch.manual_seed` + `from_config`, then every weight is
re-drawn so that a wrong mapping cannot hide behind near-zero logits:
  * linear/embedding weights ~ N(0, init_std) with init_std large enough that logits
    have a standard deviation of order 1;
  * RMSNorm weights ~ 1 + N(0, 0.2), so swapping the two norms of a layer, or dropping
    one, changes the output.

Typical use:
    hf_dir = make_checkpoint(tmp_path / "hf", "llama")           # transformers-5 config.json
    hf_dir = make_checkpoint(tmp_path / "hf", "llama", config_layout="tf4")  # top-level rope_*
    logits = hf_logits(hf_dir, ids)                               # [B, S, V] float32 numpy
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
from typing import Any, Literal

import numpy as np
import torch
import transformers

Family = Literal["llama", "mistral", "qwen3", "llama3.2"]
ConfigLayout = Literal["tf4", "tf5"]

# Positions used by the tests run past original_max_position_embeddings / 2, so all three
# branches of the llama3 frequency scaling (high, medium, low frequency) change the output.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def llama_config(**overrides: Any) -> transformers.LlamaConfig:
    """Tiny Llama-3.1-style config: GQA (4 query heads per 2 KV heads) and llama3 rope scaling."""
    kw: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, 3],
        attn_implementation="eager",
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def mistral_config(**overrides: Any) -> transformers.MistralConfig:
    """Tiny Mistral config whose sliding window (8) is far shorter than the test sequences."""
    kw: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=8,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return transformers.MistralConfig(**kw)


def qwen3_config(**overrides: Any) -> transformers.Qwen3Config:
    """Tiny Qwen3: q/k RMSNorm, no biases, head_dim (32) set apart from hidden / heads (16)."""
    kw: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return transformers.Qwen3Config(**kw)


def qwen3_moe_config(**overrides: Any) -> transformers.Qwen3MoeConfig:
    """Tiny Qwen3-MoE: Qwen3's attention, every layer routed over 8 experts, top 2, renormalised."""
    kw: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


# Llama-3.2's rope scaling (factor 32, low 1, high 4) over a short original context, so test
# positions reach all three frequency bands (as LLAMA3_ROPE does for Llama-3.1's factor 8).
LLAMA32_ROPE = {**LLAMA3_ROPE, "factor": 32.0}


def llama32_config(**overrides: Any) -> transformers.LlamaConfig:
    """Tiny Llama-3.2: tied embeddings, llama3 rope scaling factor 32, Llama-3's special tokens."""
    kw: dict[str, Any] = dict(
        rope_parameters={"rope_theta": 500000.0, **LLAMA32_ROPE},
        tie_word_embeddings=True,
        num_hidden_layers=2,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    )
    kw.update(overrides)
    return llama_config(**kw)


def build_model(
    config: transformers.PretrainedConfig, *, seed: int = 0, init_std: float = 0.15
) -> transformers.PreTrainedModel:
    """A float32 model in eval mode with every parameter re-drawn (see module docstring)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.tie_weights()
    return model.eval()


def save_checkpoint(
    model: transformers.PreTrainedModel,
    out_dir: str | pathlib.Path,
    *,
    config_layout: ConfigLayout = "tf5",
    max_shard_size: str | int | None = None,
) -> pathlib.Path:
    """`save_pretrained` as safetensors, then optionally rewrite config.json in the transformers-4 layout.

    tf4 layout: `rope_theta` and `rope_scaling` at top level (null for plain rope), no
    `rope_parameters` — what every Llama/Mistral checkpoint on the hub written before
    transformers 5 looks like.
    """
    out = pathlib.Path(out_dir)
    kwargs: dict[str, Any] = {"safe_serialization": True} if _accepts_safe_serialization() else {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    if config_layout == "tf4":
        to_tf4_config(out / "config.json")
    elif config_layout != "tf5":
        raise ValueError(f"config_layout must be 'tf4' or 'tf5', got {config_layout!r}")
    return out


def to_tf4_config(path: pathlib.Path) -> None:
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _accepts_safe_serialization() -> bool:
    import inspect

    return "safe_serialization" in inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters


# A one-layer Llama-3 with the real 128k vocabulary: the smallest base the demo config can train on.
TINY_LLAMA3 = dict(
    vocab_size=128256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def make_checkpoint(
    out_dir: str | pathlib.Path,
    family: Family = "llama",
    *,
    seed: int = 0,
    config_layout: ConfigLayout = "tf5",
    max_shard_size: str | int | None = None,
    init_std: float = 0.15,
    **config_overrides: Any,
) -> pathlib.Path:
    """Build a random tiny checkpoint of `family` and write it to `out_dir`; returns the directory."""
    make = {
        "llama": llama_config,
        "mistral": mistral_config,
        "qwen3": qwen3_config,
        "llama3.2": llama32_config,
    }[family]
    model = build_model(make(**config_overrides), seed=seed, init_std=init_std)
    return save_checkpoint(model, out_dir, config_layout=config_layout, max_shard_size=max_shard_size)


def load_hf(hf_dir: str | pathlib.Path) -> transformers.PreTrainedModel:
    """Load a checkpoint in float32 (eager attention); fails if any weight is missing or unexpected.

    transformers silently random-initialises missing weights, which would make an oracle
    comparison meaningless, hence the loading-info check.
    """
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir,
        dtype=torch.float32,
        use_safetensors=True,
        attn_implementation="eager",
        local_files_only=True,
        output_loading_info=True,
    )
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise AssertionError(f"transformers did not load {hf_dir} cleanly: {info}")
    return model.eval()


def hf_logits(
    model_or_dir: transformers.PreTrainedModel | str | pathlib.Path,
    input_ids: np.ndarray,
    position_ids: np.ndarray | None = None,
) -> np.ndarray:
    """transformers' float32 logits [B, S, V] for `input_ids` [B, S]."""
    model = model_or_dir if isinstance(model_or_dir, torch.nn.Module) else load_hf(model_or_dir)
    kwargs = {} if position_ids is None else {"position_ids": torch.tensor(position_ids, dtype=torch.long)}
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(input_ids), dtype=torch.long), **kwargs)
    return out.logits.float().numpy()


def random_ids(rng: np.random.Generator, vocab_size: int, *shape: int) -> np.ndarray:
    return rng.integers(0, vocab_size, size=shape, dtype=np.int64)


def hf_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new: int, eos: list[int]
) -> list[list[int]]:
    """transformers' batched greedy generation (left padding), cut after the first eos like ours."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    rows = []
    for r in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(r) if t in eos), None)
        rows.append(r if cut is None else r[: cut + 1])
    return rows


def random_prompts(vocab: int, lengths: list[int], avoid: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab), avoid)
    return [rng.choice(allowed, size=n).tolist() for n in lengths]


# ------------------------------------------------------------------ families with the HF dir's template

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO = REPO / "agentrefine_jax" / "data" / "demo" / "train.jsonl"
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with a default system prompt, as Qwen2.5 ships it (written here, not copied).
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def demo_conversations(n: int = 6) -> list[list[dict[str, Any]]]:
    return [json.loads(line)["messages"] for line in DEMO.read_text().splitlines()[:n]]


def chatml_tokenizer(
    out: pathlib.Path, texts: list[str] | None = None, vocab_size: int = 500, bos: str | None = None
) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE trained on `texts` (default: the demo conversations), with ChatML
    specials (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2) and template, saved into `out`
    (tokenizer.json, tokenizer_config.json, chat_template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if texts is None:
        texts = [m["content"] for c in demo_conversations() for m in c]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out)
    return fast


def hf_masks(tok: transformers.PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids, and the assistant tokens found by rendering prefix by prefix: what
    message k adds after the generation prompt, up to its end token."""
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    eos = tok.eos_token_id
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(
            messages[:k], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        upto = tok.apply_chat_template(messages[: k + 1], tokenize=True, return_dict=False)
        assert ids[: len(upto)] == upto and upto[: len(before)] == before
        end = len(before) + upto[len(before) :].index(eos) + 1
        mask[len(before) : end] = [1] * (end - len(before))
    return ids, mask


# Fields of the model config that today's `train.init_from_hf` does not take from the directory.
_ARCH_SETS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "head_dim",
    "rope_theta",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_embeddings",
    "bos_token_id",
    # Routed experts (0 / False / 0.0 for the dense families, whose configs already say so).
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "router_aux_loss_coef",
)


def model_overrides(hf_dir: str | pathlib.Path) -> list[str]:
    """The `--set model.*` list that makes a config describe `hf_dir`'s model for
    `train.init_from_hf` (its architecture check compares, it does not adopt). The one place to
    empty once init_from_hf takes the whole model config from the directory.

    `--set` validates one key at a time, and heads must stay a multiple of kv heads at every
    step: kv heads go to 1 first, then heads, then kv heads."""
    from agentrefine_jax.hf.io import read_hf_config

    c = read_hf_config(hf_dir)
    sets = [f"model.{k}={getattr(c, k)}" for k in _ARCH_SETS]
    sets += ["model.num_kv_heads=1", f"model.num_heads={c.num_heads}", f"model.num_kv_heads={c.num_kv_heads}"]
    rope = "null" if c.rope_scaling is None else json.dumps(dataclasses.asdict(c.rope_scaling))
    sets += [f"model.rope_scaling={rope}", f"model.eos_token_ids={','.join(map(str, c.eos_token_ids))}"]
    if c.pad_token_id is not None:
        sets.append(f"model.pad_token_id={c.pad_token_id}")
    return sets


def train_from_hf(
    hf_dir: pathlib.Path, run: pathlib.Path, *, config: str, sets: list[str], timeout: int = 900
) -> subprocess.CompletedProcess:
    """`python -m agentrefine_jax.train --config CONFIG` from `train.init_from_hf=hf_dir` (float32,
    with `model_overrides`), plus `sets`; returns the finished process."""
    cmd = [sys.executable, "-m", "agentrefine_jax.train", "--config", config]
    run_sets = ["model.param_dtype=float32", "model.dtype=float32", "model.remat_policy=none"]
    run_sets += [f"train.init_from_hf={hf_dir}", f"train.run_dir={run}"]
    every = [*model_overrides(hf_dir), *run_sets, *sets]
    return subprocess.run(
        cmd + [a for s in every for a in ("--set", s)], capture_output=True, text=True, timeout=timeout
    )


def chatml_llama_dir(out: str | pathlib.Path, texts: list[str], **config_overrides: Any) -> pathlib.Path:
    """A tiny random Llama with its own byte-level BPE tokenizer (trained on `texts`, specials
    <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2) and ChatML `chat_template.jinja`; bos 1, eos 2,
    pad 0 and a context of 8192, as SmolLM2-Instruct: none of them the tiny preset's."""
    out = pathlib.Path(out)
    fast = chatml_tokenizer(out, texts, vocab_size=400, bos="<|im_start|>")
    kw: dict[str, Any] = dict(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(config_overrides)
    save_checkpoint(build_model(llama_config(**kw), seed=3), out)
    return out


# ------------------------------------------------------------------ Qwen3's tool and thinking format
# Qwen3's chat template rules, written here (not copied): tools in the system turn (Hermes
# <tools>), calls as <tool_call> JSON after the content, tool results in one user turn as
# <tool_response> blocks, and thinking kept only for the turns after the last real user query
# (the last turn always shows its <think> block, empty or not); `enable_thinking=false` puts an
# empty think block into the generation prompt. Qwen2.5's template is the same without thinking.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(query=messages|length - 1) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and not (m.content.startswith('<tool_response>')"
    " and m.content.endswith('</tool_response>')) %}{%- set ns.query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set text = m.content %}{%- set thought = '' %}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{%- set thought = m.reasoning_content %}"
    "{%- elif '</think>' in text %}"
    "{%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.query and (loop.last or thought) %}"
    "{{- '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + text.lstrip('\\n') }}"
    "{%- else %}{{- text }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set fn = call.function if call.function else call %}"
    "{%- if text or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' }}'
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Qwen2.5's rules (no thinking; a default system prompt): the assistant header, then "\n" + content
# when there is content, then each call as "\n<tool_call>...</tool_call>".
QWEN25_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}"
    "{%- else %}{%- set sys = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + sys + '\\n\\n# Tools\\n\\nYou may call one or more functions to assist "
    "with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- else %}{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set fn = call.function if call.function else call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' + (fn.arguments | tojson) }}'
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def qwen_tokenizer(
    out: pathlib.Path, texts: list[str], template: str = QWEN3_TEMPLATE
) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE with ChatML specials, Qwen's added (non-special) tool and think
    tokens, and a Qwen template, saved into `out`."""
    from tokenizers import AddedToken

    fast = chatml_tokenizer(out, texts, vocab_size=600)
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast
