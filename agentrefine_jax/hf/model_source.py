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


def _from_dir(cfg: Config) -> bool:
    """Whether the run takes its model (and tokenizer) from `train.init_from_hf`."""
    source = cfg.train.model_source
    return source == "init_from_hf" or (source == "auto" and bool(cfg.train.init_from_hf))


def _set_keys(cfg: Config) -> list[str]:
    return [o.split("=", 1)[0].strip() for o in cfg.overrides]


def has_tokenizer(hf_dir: str | pathlib.Path) -> bool:
    return (pathlib.Path(hf_dir) / "tokenizer.json").is_file()


def resolve(cfg: Config) -> Config:
    """The config with its model taken from `train.init_from_hf` (or `init_from_gguf`, converted)
    where `model_source` says so. Idempotent. A directory that cannot be read (absent, a file,
    config.json not a JSON object, an unsupported family) is a one-line ConfigError here, so
    `--print-config` fails exactly as the run would; the weights are checked by `check`."""
    from agentrefine_jax.data.templates import hf_chat_template  # transformers: only when needed

    cfg = resolve_init_from_gguf(cfg)
    hf_dir = cfg.train.init_from_hf
    if not _from_dir(cfg):
        return cfg
    if not hf_dir:
        raise ConfigError("train.model_source=init_from_hf needs train.init_from_hf=DIR")
    try:
        hf = read_hf_config(hf_dir)
    except (ValueError, OSError) as e:
        raise ConfigError(f"train.init_from_hf={hf_dir}: {e}") from None
    set_keys = _set_keys(cfg)
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
    # Without tokenizer files the config's tokenizer stays here; `check` refuses it unless --set.
    if "data.tokenizer" not in set_keys and has_tokenizer(hf_dir):
        data = dataclasses.replace(data, tokenizer=hf_dir)
    if "data.template" not in set_keys and hf_chat_template(hf_dir):
        data = dataclasses.replace(data, template="hf")
    return dataclasses.replace(cfg, model=model, data=data)


def check(cfg: Config) -> None:
    """What a (resolved) run checks about its model before any data work, and `--print-config`
    too: `train.init_from_hf`'s config.json and whole tensor set (headers only) against the
    model, its context against data.max_length, its tokenizer files, and the tokenizer against
    the model's vocabulary. One-line ConfigError."""
    if cfg.train.init_from_hf:
        check_init_from_hf(cfg)
    check_tokenizer(cfg)


def check_init_from_hf(cfg: Config) -> None:
    """`train.init_from_hf` from its headers: a pickle-only or foreign directory, files outside
    it, corrupt files, missing, extra or misshapen tensors, and a config that does not match."""
    from agentrefine_jax.hf.io import check_hf_dir

    hf_dir = cfg.train.init_from_hf
    where = f"train.init_from_hf={hf_dir}"
    try:
        hf_cfg = check_hf_dir(hf_dir)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    bad = [
        f"{f}: config {getattr(cfg.model, f)!r} vs checkpoint {getattr(hf_cfg, f)!r}"
        for f in cfg.model.hf_diff(hf_cfg)
    ]
    if bad:
        raise ConfigError(
            f"{where} does not match model config: {bad} "
            "(train.model_source=init_from_hf takes the model from the directory)"
        )
    if cfg.data.max_length > hf_cfg.max_position_embeddings:
        raise ConfigError(
            f"data.max_length={cfg.data.max_length} exceeds the context of {where} "
            f"(max_position_embeddings={hf_cfg.max_position_embeddings})"
        )
    if _from_dir(cfg) and "data.tokenizer" not in _set_keys(cfg) and not has_tokenizer(hf_dir):
        raise ConfigError(
            f"{where} has no tokenizer files (tokenizer.json), and the model's tokenizer is never "
            "replaced silently: name it with --set data.tokenizer=DIR (or llama3 / mistral)"
        )


def check_tokenizer(cfg: Config) -> None:
    """The tokenizer's ids, its special tokens and the model's bos/eos/pad must all lie below
    `model.vocab_size`: an id past the embedding is not an error to XLA but a NaN loss at step 1."""
    from agentrefine_jax.data.tokenizers import load_tokenizer

    name, vocab = cfg.data.tokenizer, cfg.model.vocab_size
    try:
        tok = load_tokenizer(name)
    except Exception as e:  # an untrusted directory: whatever its loader raises is one line
        raise ConfigError(f"data.tokenizer={name}: cannot load it ({type(e).__name__}: {e})") from None
    ids = tok.get_vocab()
    top_token, top = max(ids.items(), key=lambda kv: kv[1]) if ids else ("", -1)
    specials = {t: i for t, i in zip(tok.all_special_tokens, tok.all_special_ids, strict=True)}
    m = cfg.model
    model_ids = {"bos_token_id": m.bos_token_id, "pad_token_id": m.pad_token_id}
    model_ids |= {f"eos_token_ids[{k}]": e for k, e in enumerate(m.eos_token_ids)}
    bad = [f"{t!r} {i}" for t, i in specials.items() if i is not None and i >= vocab]
    bad += [f"model.{k} {i}" for k, i in model_ids.items() if i is not None and i >= vocab]
    if top < vocab and not bad:
        return
    shown = ", ".join(bad[:6]) + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
    raise ConfigError(
        f"data.tokenizer={name} does not fit model.vocab_size={vocab}: its largest id is {top} "
        f"({top_token!r})"
        + (f"; ids past the vocabulary: {shown}" if bad else "")
        + "; name the model's own tokenizer with --set data.tokenizer=DIR"
    )
