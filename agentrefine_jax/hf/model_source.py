"""`train.model_source`: where a run's model comes from, resolved once before any work.

"config" keeps the config's `model` (the trainer then checks `train.init_from_hf` against it field
for field: architecture, special tokens, context). "init_from_hf" takes those fields from the
directory's `config.json` through the family table (`read_hf_config`), keeps the config's
execution fields (dtypes, kernels, layout), and makes the directory's own tokenizer and chat
template the run's unless `--set data.tokenizer` / `data.template` name others. A `--set
model.<field>` that contradicts the directory is refused naming the field. "auto" is
"init_from_hf" when `train.init_from_hf` is set, else "config".

`train.init_from_gguf=FILE` is resolved first: converted once into the GGUF cache
(hf/gguf_cache.py) and then an ordinary `train.init_from_hf=<that directory>`.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from agentrefine_jax.config import Config
from agentrefine_jax.config_checks import ConfigError
from agentrefine_jax.hf.io import read_hf_config
from agentrefine_jax.models.config import HF_FIELDS, same_value


def resolve_init_from_gguf(cfg: Config) -> Config:
    """`train.init_from_gguf=FILE` -> `train.init_from_hf=<FILE's cached conversion>` (converted on
    first use); everything after this sees an ordinary HF-initialised run. The cache directory is
    keyed by the file's content, so a resume resolves to the same directory."""
    tc = cfg.train
    if not tc.init_from_gguf:
        return cfg
    from agentrefine_jax.hf.gguf_cache import cached_hf_dir

    try:
        hf_dir = cached_hf_dir(tc.init_from_gguf, log=logging.getLogger("agentrefine_jax.hf").info)
    except (ValueError, OSError) as e:
        raise ConfigError(f"train.init_from_gguf={tc.init_from_gguf}: {e}") from None
    train_cfg = dataclasses.replace(tc, init_from_gguf=None, init_from_hf=str(hf_dir))
    return dataclasses.replace(cfg, train=train_cfg)


def resolve(cfg: Config) -> Config:
    """The config with its model taken from `train.init_from_hf` (or `init_from_gguf`, converted)
    where `model_source` says so. Idempotent; a directory that cannot be read is left to the
    trainer's full check (one line)."""
    from agentrefine_jax.data.templates import hf_chat_template  # transformers: only when needed

    cfg = resolve_init_from_gguf(cfg)
    source, hf_dir = cfg.train.model_source, cfg.train.init_from_hf
    if source == "auto":
        source = "init_from_hf" if hf_dir else "config"
    if source == "config":
        return cfg
    if not hf_dir:
        raise ConfigError("train.model_source=init_from_hf needs train.init_from_hf=DIR")
    try:
        hf = read_hf_config(hf_dir)
    except (ValueError, OSError):
        return cfg
    set_keys = [o.split("=", 1)[0].strip() for o in cfg.overrides]
    for key in set_keys:
        parts = key.split(".")
        if parts[0] == "model" and len(parts) > 1 and parts[1] in HF_FIELDS:
            ours, theirs = getattr(cfg.model, parts[1]), getattr(hf, parts[1])
            if not same_value(ours, theirs):
                raise ConfigError(
                    f"--set model.{parts[1]}={ours!r} contradicts train.init_from_hf={hf_dir} "
                    f"({parts[1]}={theirs!r}); drop it or set train.model_source=config"
                )
    model = dataclasses.replace(cfg.model, **{f: getattr(hf, f) for f in HF_FIELDS})
    data = cfg.data
    if "data.tokenizer" not in set_keys and (pathlib.Path(hf_dir) / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=hf_dir)
    if "data.template" not in set_keys and hf_chat_template(hf_dir):
        data = dataclasses.replace(data, template="hf")
    return dataclasses.replace(cfg, model=model, data=data)
