"""Load a model for inference from either checkpoint format, plus its tokenizer/template names.

* a project checkpoint (training run dir, checkpoint root or step dir; see
  `agentrefine_jax.checkpoint`): tokenizer and template default to the names in its meta;
  a LoRA run's adapters are merged into its rebuilt base at load (`checkpoint.load_model`);
* a Hugging Face directory (config.json + safetensors, e.g. written by `export`): the
  tokenizer defaults to the directory itself when it holds tokenizer files, the template to
  `hf` (the directory's own `chat_template.jinja` / tokenizer_config.json `chat_template`)
  when it ships one; `hf_dir_names` says so before any weight is read.

A project checkpoint may be a URL (gs://bucket/run, as `train.run_dir` allows); a Hugging Face
directory is read from local disk.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from agentrefine_jax.models.config import ModelConfig
from agentrefine_jax.models.llama import Transformer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    model: Transformer
    tokenizer: str | None  # a name for data.tokenizers.load_tokenizer, or None if unknown
    template: str | None
    source: str  # "checkpoint" | "hf"


def is_hf_dir(path: str | pathlib.Path) -> bool:
    from agentrefine_jax.paths import as_path, is_url

    if is_url(path):
        return False
    p = pathlib.Path(as_path(path))
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def hf_dir_names(path: str | pathlib.Path) -> tuple[str | None, str | None]:
    """The tokenizer and chat template an HF directory ships (absolute dir / "hf"), else None."""
    from agentrefine_jax.data.templates import hf_chat_template

    p = pathlib.Path(path).resolve()
    has_tok = any((p / f).is_file() for f in _TOKENIZER_FILES)
    return (str(p) if has_tok else None), ("hf" if hf_chat_template(p) else None)


def check_chat_names(path: str | pathlib.Path, template: str | None, tokenizer: str | None) -> None:
    """For an HF directory, the "no template / no tokenizer" error before its weights load."""
    if is_hf_dir(path):
        tok, tpl = hf_dir_names(pathlib.Path(path))
        if not (tokenizer or tok):
            raise ValueError(f"{path} has no tokenizer files; pass --tokenizer (llama3, mistral or a dir)")
        if not (template or tpl):
            raise ValueError(
                f"{path} ships no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template); pass --template llama3 or mistral"
            )


def load_for_inference(
    path: str | pathlib.Path,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    **load_kwargs: Any,
) -> LoadedModel:
    """Load parameters from `path`; `dtype` overrides the compute dtype (e.g. float32 on CPU),
    `param_dtype` the weights' storage dtype (e.g. bfloat16: half the bytes a decode step reads)."""
    overrides: dict[str, Any] = dict(load_kwargs)
    if dtype is not None:
        overrides["dtype"] = dtype
    if param_dtype is not None:
        overrides["param_dtype"] = param_dtype
    from agentrefine_jax.checkpoint import load_model
    from agentrefine_jax.paths import as_path

    if is_hf_dir(path):
        p = pathlib.Path(as_path(path))
        from agentrefine_jax.hf.io import load_hf_model

        tokenizer, template = hf_dir_names(p)
        cfg, model = load_hf_model(p, **overrides)
        return LoadedModel(cfg, model, tokenizer, template, "hf")
    cfg, model, meta = load_model(path, **overrides)
    return LoadedModel(cfg, model, meta.tokenizer, meta.template, "checkpoint")
