"""Tokenizers built offline from the vendors' own files, as Hugging Face fast tokenizers.

`llama3`  -> the tiktoken BPE file shipped in `llama-models` (Meta's `Tokenizer`), with Meta's
             256 special tokens at ids 128000..128255.
`mistral` -> the v3 SentencePiece model shipped in `mistral-common` (`[INST]`, `[/INST]`, ...
             are control pieces, byte fallback on), as used by Mistral-7B-Instruct-v0.3.
Anything else is taken as a local Hugging Face tokenizer directory (never `trust_remote_code`).

Both built-ins are checked token for token against the vendors' encoders in
tests/test_data_tokenizers.py. Building the Llama-3 merges takes a few seconds, so each
tokenizer is built once per process and cached.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
from collections.abc import Callable
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode, generate_merges

BUILTIN_TOKENIZERS = ("llama3", "mistral")

# Meta's pre-tokenization regex (llama_models/llama3/tokenizer.py, Tokenizer.pat_str).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_RESERVED_SPECIAL = 256
_CACHE_VERSION = 2  # bump when a builder changes (2: the cached file holds the BOS post-processor)


def llama3_model_path() -> pathlib.Path:
    import llama_models.llama3

    return pathlib.Path(llama_models.llama3.__file__).parent / "tokenizer.model"


def mistral_v3_model_path() -> pathlib.Path:
    import mistral_common

    data = pathlib.Path(mistral_common.__file__).parent / "data"
    return data / "mistral_instruct_tokenizer_240323.model.v3"


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "agentrefine_jax" / "tokenizers"


def _cached_builtin(
    name: str, source: pathlib.Path, build: Callable[[], Tokenizer], **hf_kwargs: Any
) -> PreTrainedTokenizerFast:
    """Build once, then reuse a tokenizer.json keyed by the vendor file's hash and library version.

    The Llama-3 merge table takes seconds to derive; loading the JSON takes well under one. The
    cached file goes to Hugging Face's wrapper as `tokenizer_file`, which loads it: handed a
    `Tokenizer` object instead, the wrapper deep-copies it (~0.9 s for Llama-3's vocabulary, in
    every process that loads it). A cache that cannot be read or written is ignored (rebuilt),
    never trusted blindly.
    """
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    path = _cache_dir() / f"{name}-{digest}-tokenizers{tokenizers.__version__}-v{_CACHE_VERSION}.json"
    if path.is_file():
        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(path), **hf_kwargs)
        except Exception:  # corrupt / partial / vanished file: rebuild below
            pass
    tok = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
    except OSError:
        pass
    return PreTrainedTokenizerFast(tokenizer_object=tok, **hf_kwargs)


def llama3_special_tokens() -> list[str]:
    """Meta's special-token list, in id order (same construction as llama_models' Tokenizer)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
        "<|image|>",
    ]
    n_reserved = LLAMA3_NUM_RESERVED_SPECIAL - len(named)
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(n_reserved)]
    return named + reserved


def _llama3_backend() -> Tokenizer:
    from llama_models.tokenizer_utils import load_bpe_file

    ranks = load_bpe_file(llama3_model_path())
    # GPT-2 byte-to-unicode mapping, applied with str.translate (much faster than per-byte joins).
    table = {b: c for b, c in bytes_to_unicode().items()}
    strs = {tok: tok.decode("latin-1").translate(table) for tok in ranks}
    vocab = {strs[tok]: rank for tok, rank in ranks.items()}
    # tiktoken merges greedily by the rank of the merged token; a merge list ordered by that
    # rank with `ignore_merges` (whole-word vocab hits first) reproduces it exactly.
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None:
                merges.append((rank, rl, rr, left, right))
    merges.sort()
    bpe = BPE(vocab, [(strs[m[3]], strs[m[4]]) for m in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = llama3_special_tokens()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    base = len(ranks)
    for i, s in enumerate(specials):  # ids must be Meta's, not just "appended somewhere"
        assert tok.token_to_id(s) == base + i, s
    return tok


def _with_bos(backend: Tokenizer, bos: str) -> Tokenizer:
    """`tok(text)` starts with BOS, as the vendors' HF tokenizers do (exported dirs must match).

    Templates encode content with add_special_tokens=False, so this never reaches training data.
    """
    bos_id = backend.token_to_id(bos)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return backend


def _build_llama3() -> PreTrainedTokenizerFast:
    return _cached_builtin(
        "llama3",
        llama3_model_path(),
        lambda: _with_bos(_llama3_backend(), "<|begin_of_text|>"),
        bos_token="<|begin_of_text|>",
        # Instruct models end a turn with <|eot_id|>; generation also stops on the other two
        # (see ChatTemplate.stop_token_ids).
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )


def _mistral_v3_backend() -> Tokenizer:
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    proto.ParseFromString(mistral_v3_model_path().read_bytes())
    spec = proto.normalizer_spec
    if proto.trainer_spec.model_type != 2 or not proto.trainer_spec.byte_fallback:
        raise ValueError("expected a SentencePiece BPE model with byte fallback (Mistral v3)")
    if spec.name != "identity" or spec.remove_extra_whitespaces or not spec.add_dummy_prefix:
        raise ValueError(f"unexpected SentencePiece normalizer spec {spec.name!r} for Mistral v3")
    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    normal = {p.piece: p.score for p in pieces if p.type == 1}  # 1 = NORMAL
    # SentencePiece BPE merges the adjacent pair whose merged piece scores highest; only
    # normal pieces take part (control, unknown and byte pieces are never merge results).
    skip = {p.piece for p in pieces if p.type != 1}
    merges = generate_merges(vocab, normal, skip_tokens=skip)
    bpe = BPE(vocab, merges, unk_token=proto.trainer_spec.unk_piece, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    # SentencePiece's dummy prefix: one "▁" in front of every encode() call, spaces -> "▁".
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    controls = [p.piece for p in pieces if p.type in (2, 3)]  # unknown + control pieces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in controls])
    for s in controls:
        assert tok.token_to_id(s) == vocab[s], s
    return tok


def _build_mistral_v3() -> PreTrainedTokenizerFast:
    return _cached_builtin(
        "mistral-v3",
        mistral_v3_model_path(),
        lambda: _with_bos(_mistral_v3_backend(), "<s>"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )


@functools.lru_cache(maxsize=8)
def _load_cached(name_or_path: str) -> PreTrainedTokenizerFast:
    if name_or_path == "llama3":
        return _build_llama3()
    if name_or_path == "mistral":
        return _build_mistral_v3()
    path = pathlib.Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown tokenizer {name_or_path!r}: use one of {BUILTIN_TOKENIZERS} or a local Hugging Face "
            "tokenizer directory (tokenizer.json / tokenizer_config.json)"
        )
    memo = _class_memo(path)
    cls = _remembered_class(memo)
    if cls is not None:
        # What `AutoTokenizer.from_pretrained` ends in once it has chosen the class (transformers 5:
        # `cls.from_pretrained(path, **kwargs)`, its own trust_remote_code popped, `_from_auto` set).
        return cls.from_pretrained(str(path), local_files_only=True, _from_auto=True)
    # Imported here, not at the top: `transformers`' auto classes import torch when it is
    # installed, which a process on a built-in tokenizer never needs.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise TypeError(f"{path}: need a fast (tokenizers-backed) tokenizer, got {type(tok).__name__}")
    _remember_class(memo, type(tok))
    return tok


# Which class `AutoTokenizer` chose for a directory, remembered across processes.
#
# Choosing the class is most of the cost of loading a directory's tokenizer: `AutoTokenizer` reads
# the model's config through `AutoConfig`, which imports torch and accelerate where they are
# installed -- 2-3 s of every CLI start on an HF directory (trainer, export, eval, collection) on a
# 2-core machine, against 0.2 s to load the tokenizer once its class is known. The choice depends on
# the directory's config.json, tokenizer_config.json and tokenizer.json, which files it holds, the
# path as given (transformers matches some hub ids against it) and the transformers version: the
# memo is keyed by all of them, so any change is a miss and `AutoTokenizer` decides again. A memo that
# cannot be read, names a class that no longer imports, or cannot be written is ignored.
_DECISION_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def _class_memo(path: pathlib.Path) -> pathlib.Path | None:
    import transformers

    try:
        names = sorted(p.name for p in path.iterdir())
        h = hashlib.sha256(f"transformers {transformers.__version__}\0{path}\0".encode())
        h.update("\0".join(names).encode())
        for name in _DECISION_FILES:
            if name in names:
                h.update(f"\0{name}\0".encode())
                h.update((path / name).read_bytes())
    except OSError:
        return None
    return _cache_dir() / "auto-class" / f"{h.hexdigest()[:32]}.json"


def _remembered_class(memo: pathlib.Path | None) -> type[PreTrainedTokenizerFast] | None:
    if memo is None or not memo.is_file():
        return None
    try:
        import importlib
        import json

        doc = json.loads(memo.read_text())
        cls = getattr(importlib.import_module(doc["module"]), doc["name"])
    except Exception:  # noqa: BLE001 - unreadable, partial or stale memo: AutoTokenizer decides
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerFast) else None


def _remember_class(memo: pathlib.Path | None, cls: type) -> None:
    if memo is None:
        return
    from agentrefine_jax import outputs

    try:  # a memo we cannot write only costs the next process AutoTokenizer's choice
        memo.parent.mkdir(parents=True, exist_ok=True)
        outputs.write_json(memo, {"module": cls.__module__, "name": cls.__qualname__})
    except (OSError, outputs.OutputWriteError):
        pass


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerFast:
    """`llama3` / `mistral` built offline from vendor files, or a local HF tokenizer directory.

    The returned object is shared (cached per process): do not mutate it.
    """
    return _load_cached(str(name_or_path))
