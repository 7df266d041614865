"""Read and write Hugging Face checkpoints of the families in models/families.py (safetensors only).

Reading streams one HF tensor at a time into (possibly sharded) device arrays, so host
memory holds about one HF tensor (plus its re-laid-out copy) and one device shard at a
time, never the model: a 70B checkpoint loads on a TPU host whose RAM is far smaller
than the model. Layer tensors are written into their slot of the stacked [L, ...]
parameter on device by a donated in-place update.

Writing gathers one parameter slice (one HF tensor) at a time and writes safetensors
shards of at most `max_shard_bytes`, so host memory holds at most one shard.

Pickle-based weights (`pytorch_model.bin`, `*.pt`, ...) are refused; nothing here ever
executes code from a checkpoint directory. The directory is untrusted input: weight files must
stay inside it (an index entry `../x` or a symlink leading out is refused), a safetensors header
is checked against the file's size before it is read, and only finite floating-point tensors
are accepted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from agentrefine_jax import outputs
from agentrefine_jax.models import families, llama, params
from agentrefine_jax.models.config import ModelConfig, RopeScaling
from agentrefine_jax.models.llama import abstract_params
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path, is_url
from agentrefine_jax.sharding import param_shardings

Log = Callable[[str], None]


def save_safetensors(tensors: dict[str, np.ndarray], path: str | pathlib.Path) -> None:
    """safetensors' `save_file`, its I/O failures as the OSError they are (the Rust writer reports
    a full disk as `SafetensorError: ... (os error 28)`; the CLIs answer an OSError in one line)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        raise _as_os_error(e, path) from e


def _as_os_error(e: Exception, path: str | os.PathLike[str]) -> Exception:
    """A Rust writer's I/O failure (`... (os error 28)`) as the OSError it is; else `e` itself."""
    code = re.search(r"os error (\d+)", str(e))
    if code is None:
        return e
    n = int(code.group(1))
    return OSError(n, os.strerror(n), str(path))


SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_SUPPORTED_ROPE = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Tensors some checkpoints carry that are recomputed, not learned: skipped and counted.
_RECOMPUTED_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def _quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------------- config.json


_MAX_JSON_BYTES = 64 * 2**20  # config / index files are kilobytes; /dev/zero or a FIFO is not one


def _load_json(path: pathlib.Path) -> dict[str, Any]:
    """A JSON object from a model directory's small file (config, generation config, index)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_JSON_BYTES:
            raise ValueError(f"{path} is not a regular JSON file of at most {_MAX_JSON_BYTES} bytes")
        value = json.loads(path.read_text())
    except NotADirectoryError:  # `path`'s directory is a file
        raise ValueError(f"{path.parent} is a file, not a Hugging Face model directory") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path} is JSON nested deeper than the parser allows") from None
    if not isinstance(value, dict):  # e.g. a list: every reader below looks keys up
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _rope_from_hf(c: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config layout; conflicting layouts are an error."""
    candidates: list[tuple[str, float, dict[str, Any] | None]] = []
    rp = c.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, Mapping):
            raise ValueError(f"rope_parameters must be an object, got {rp!r}")
        if rp and all(isinstance(v, Mapping) for v in rp.values()):
            raise ValueError(
                f"per-layer-type rope_parameters are not supported for Llama/Mistral: {sorted(rp)}"
            )
        theta = rp.get("rope_theta", c.get("rope_theta"))
        if theta is None:
            raise ValueError("rope_parameters has no rope_theta and config.json has no top-level rope_theta")
        candidates.append(("rope_parameters", float(theta), dict(rp)))
    if "rope_theta" in c or "rope_scaling" in c:
        theta = c.get("rope_theta", 10000.0)
        candidates.append(("rope_theta/rope_scaling", float(theta), c.get("rope_scaling")))
    if not candidates:
        candidates.append(("defaults", 10000.0, None))

    parsed = []
    for origin, theta, scaling in candidates:
        rope_type = "default"
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE:
            raise ValueError(
                f"unsupported rope type {rope_type!r} (from {origin}); "
                f"supported: {', '.join(_SUPPORTED_ROPE)}"
            )
        rs = None
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if k not in scaling]
            if missing:
                raise ValueError(f"llama3 rope scaling (from {origin}) lacks {missing}")
            rs = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        parsed.append((origin, theta, rs))
    if len(parsed) == 2 and parsed[0][1:] != parsed[1][1:]:
        raise ValueError(
            "config.json has both rope_parameters and top-level rope_theta/rope_scaling and they disagree: "
            f"{parsed[0][1:]} vs {parsed[1][1:]}"
        )
    return parsed[0][1], parsed[0][2]


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list | tuple) else [value])]


def read_hf_config(
    hf_dir: str | pathlib.Path, *, param_dtype: str | None = None, dtype: str | None = None
) -> ModelConfig:
    """ModelConfig from a transformers Llama/Mistral `config.json` (transformers 4 or 5 layout).

    EOS ids are the union of config.json's and generation_config.json's (Llama-3-Instruct
    lists <|eot_id|> only in the latter). Unsupported features fail here, not mid-load.
    """
    d = pathlib.Path(hf_dir)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{d} is a file, not a Hugging Face model directory")
    c = _load_json(d / "config.json")
    family = c.get("model_type")
    if family not in families.FAMILIES:
        raise ValueError(
            f"{d}/config.json: model_type {family!r} is not supported ({', '.join(families.FAMILIES)})"
        )
    fam = families.get(family)
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (silu)")
    fam.check_hf(c)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in c:
            raise ValueError(f"{d}/config.json lacks {key}")
    heads = int(c["num_attention_heads"])
    theta, scaling = _rope_from_hf(c)
    eos = _eos_list(c.get("eos_token_id"))
    gen_path = d / "generation_config.json"
    if gen_path.exists():
        eos += [e for e in _eos_list(_load_json(gen_path).get("eos_token_id")) if e not in eos]
    window = c.get("sliding_window") if fam.sliding_window else None
    defaults = ModelConfig()
    moe: dict[str, Any] = {}
    if fam.moe:  # transformers 5 writes num_experts as num_local_experts (its attribute_map)
        moe = dict(
            num_experts=int(c.get("num_experts") or c["num_local_experts"]),
            num_experts_per_tok=int(c["num_experts_per_tok"]),
            moe_intermediate_size=int(c["moe_intermediate_size"]),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        )
    return ModelConfig(
        family=family,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window else None,
        initializer_range=float(c.get("initializer_range", 0.02)),
        param_dtype=param_dtype or defaults.param_dtype,
        dtype=dtype or defaults.dtype,
        bos_token_id=int(c.get("bos_token_id") if c.get("bos_token_id") is not None else 1),
        eos_token_ids=tuple(eos),
        pad_token_id=c.get("pad_token_id"),
        **moe,
    )


def hf_config_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json readable by transformers 4 (rope_theta/rope_scaling) and 5 (rope_parameters)."""
    fam = families.get(cfg.family)
    if cfg.sliding_window is not None and not fam.sliding_window:
        raise ValueError(
            f"transformers' {fam.architecture} has no sliding window; export such a model as family 'mistral'"
        )
    scaling = None
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        scaling = {
            "rope_type": cfg.rope_scaling.rope_type,
            **{k: getattr(cfg.rope_scaling, k) for k in _LLAMA3_KEYS},
        }
        rope_parameters = {**scaling, "rope_theta": cfg.rope_theta}
    eos: int | list[int] | None = (
        list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0]
    )
    out: dict[str, Any] = {
        "architectures": [fam.architecture],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos if cfg.eos_token_ids else None,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if fam.sliding_window:
        out["sliding_window"] = cfg.sliding_window
    out.update(fam.hf_constants(cfg))
    return out


def generation_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"bos_token_id": cfg.bos_token_id}
    if cfg.eos_token_ids:
        out["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out


# ------------------------------------------------------------------------------ reading


# safetensors' own cap on the JSON header; checked before the reader allocates for it.
_MAX_HEADER_BYTES = 100 * 2**20


def _allowed_roots(d: pathlib.Path) -> list[pathlib.Path]:
    """Where weight files may resolve to: the directory itself, and for a Hugging Face hub cache
    snapshot (`.../snapshots/<rev>`, whose files are symlinks to `../../blobs/<sha>`) its blobs."""
    roots = [d.resolve()]
    here = d.absolute()
    if here.parent.name == "snapshots":
        roots.append((here.parent.parent / "blobs").resolve())
    return roots


def _inside(d: pathlib.Path, name: str, what: str) -> pathlib.Path:
    """`d / name`, refused unless it stays inside `d` after resolving `..` and symlinks."""
    target = (d / name).resolve()
    if os.path.isabs(name) or not any(target.is_relative_to(r) for r in _allowed_roots(d)):
        raise ValueError(
            f"{what} {name!r} resolves to {target}, outside {d}: refused "
            "(weights are read only from inside the model directory)"
        )
    return d / name


def _check_header(path: pathlib.Path) -> None:
    """A regular file whose 8-byte header length fits in it: no read of a 2**62-byte header, no
    hang on a device or a pipe named *.safetensors."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file; a safetensors weight file was expected")
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path}: truncated safetensors file ({st.st_size} bytes, no header)")
    n = int.from_bytes(head, "little")
    if n > _MAX_HEADER_BYTES or 8 + n > st.st_size:
        raise ValueError(
            f"{path}: corrupt or truncated safetensors file (its header claims {n} bytes, "
            f"the file has {st.st_size})"
        )


@contextlib.contextmanager
def open_safetensors(path: pathlib.Path) -> Iterator[Any]:
    """`safe_open` after the header check; the reader's own errors name the file (one line)."""
    _check_header(path)
    try:
        f = safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a valid safetensors file ({e})") from None
    with f:
        yield f


def hf_weight_files(hf_dir: str | pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """{safetensors file: tensor names in it}, from the index when sharded; pickles refused.

    Every file must lie inside `hf_dir` (see `_inside`) and pass the header check."""
    d = pathlib.Path(hf_dir)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{d} is a file, not a Hugging Face model directory")
    if not d.is_dir():
        raise FileNotFoundError(f"{d} is not a directory")
    index = d / SAFE_INDEX
    if index.exists():
        _inside(d, SAFE_INDEX, "the index")
        weight_map = _load_json(index).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files: dict[pathlib.Path, list[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname:
                raise ValueError(f"{index}: weight_map[{name!r}] is not a file name: {fname!r}")
            files.setdefault(_inside(d, fname, f"{index.name}: weight_map[{name!r}] ="), []).append(name)
        absent = sorted(str(f.name) for f in files if not f.exists())
        if absent:
            raise FileNotFoundError(f"{index} references missing shard files: {absent}")
        for f in files:
            _check_header(f)
        return dict(sorted(files.items()))
    single = d / SAFE_SINGLE
    if single.exists() or single.is_symlink():
        with open_safetensors(_inside(d, SAFE_SINGLE, "the weight file")) as f:
            return {single: list(f.keys())}
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{d} holds only pickle-based weights {pickles}; these can execute code when loaded "
            "and are refused. "
            "Convert them to safetensors in a trusted environment first."
        )
    raise FileNotFoundError(f"{d} has neither {SAFE_SINGLE} nor {SAFE_INDEX}")


_SAFE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_FLOAT_SAFE_DTYPES = (*_SAFE_DTYPES, "F64")  # what a weight may be stored as (F64 is cast down)
_PRECISION = {"float32": 3, "float16": 2, "bfloat16": 1}
EXPORT_DTYPES = ("auto", *NP_DTYPES)


def hf_storage_dtypes(hf_dir: str | pathlib.Path) -> set[str]:
    """The float dtypes the HF tensors are stored in (from the safetensors headers)."""
    found = {_SAFE_DTYPES.get(sl.get_dtype(), "?") for _, _, _, sl in _iter_slices(hf_dir)}
    return {d for d in found if d in _PRECISION}


def hf_storage_dtype(hf_dir: str | pathlib.Path) -> str | None:
    """The lowest-precision float dtype among the HF tensors (None if unknown)."""
    known = hf_storage_dtypes(hf_dir)
    return min(known, key=_PRECISION.__getitem__) if known else None


def precision_rank(dtype: str) -> int:
    """Orders float dtypes by precision (float32 > float16 > bfloat16)."""
    return _PRECISION[dtype]


def resolve_export_dtype(requested: str, *, source_dtype: str | None, param_dtype: str) -> str:
    """`auto`: the dtype the weights were imported from (so HF -> project -> HF is exact), else the
    parameter dtype (never lose precision silently); anything else is taken as given."""
    if requested == "auto":
        return source_dtype or param_dtype
    if requested not in NP_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {requested!r}")
    return requested


def _check_dtype(path: pathlib.Path, name: str, dtype: str) -> None:
    if dtype not in _FLOAT_SAFE_DTYPES:
        raise ValueError(
            f"{path.name}: tensor {name} is {dtype}; only floating-point weights "
            f"({', '.join(_FLOAT_SAFE_DTYPES)}) are supported"
        )


def _check_finite(path: pathlib.Path, name: str, tensor: np.ndarray) -> None:
    """NaN/Inf anywhere in a weight makes every logit NaN: refuse it by name. Checked in blocks so
    the boolean temporary stays small next to the tensor."""
    flat = tensor.reshape(-1)
    block = 1 << 24
    for i in range(0, flat.size, block):
        if not np.isfinite(flat[i : i + block]).all():
            raise ValueError(f"{path.name}: tensor {name} holds NaN or Inf values")


def _iter_slices(hf_dir: str | pathlib.Path) -> Iterator[tuple[pathlib.Path, Any, str, Any]]:
    """(file, its open reader, tensor name, lazy slice) for every tensor, after the checks on files,
    headers, the index's placement and the dtype; nothing is read but headers."""
    for path, names in hf_weight_files(hf_dir).items():
        with open_safetensors(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"{path.name} does not contain {name}, which the index places there")
                sl = f.get_slice(name)
                _check_dtype(path, name, sl.get_dtype())
                yield path, f, name, sl


def iter_hf_tensors(hf_dir: str | pathlib.Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor, one at a time, in file order; each a finite float array."""
    for path, f, name, _ in _iter_slices(hf_dir):
        try:
            tensor = f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{path}: cannot read tensor {name} ({e})") from None
        _check_finite(path, name, tensor)
        yield name, tensor


def check_hf_dir(hf_dir: str | pathlib.Path) -> ModelConfig:
    """Everything about an HF directory that is known without reading the weights: a supported
    config.json, safetensors files inside the directory with sound headers, and exactly the
    expected tensor names, float dtypes and shapes. Raises a one-line ValueError/FileNotFoundError.
    `load_hf_model` checks the same while it reads; this lets a trainer fail before its data work."""
    cfg = read_hf_config(hf_dir)
    check_tensor_set(hf_dir, cfg)
    return cfg


def check_tensor_set(hf_dir: str | pathlib.Path, cfg: ModelConfig) -> None:
    """The directory's whole tensor set against `cfg`, from the headers: every missing, extra
    (unknown, or a layer past num_layers) and misshapen tensor named in one ValueError."""
    shapes: dict[str, tuple[int, ...]] = {}
    for _, _, name, sl in _iter_slices(hf_dir):
        if _RECOMPUTED_RE.match(name) or (name == "lm_head.weight" and cfg.tie_embeddings):
            continue
        if name in shapes:
            raise ValueError(f"tensor {name} appears twice in {hf_dir}")
        shapes[name] = tuple(sl.get_shape())
    problems = params.hf_set_problems(shapes, cfg, "config.json")
    if problems:
        raise ValueError(f"{hf_dir}: {problems}")


def _check_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig, hf_dir: Any) -> None:
    try:
        want = params.hf_shape(name, cfg)
    except KeyError as e:
        raise ValueError(f"{hf_dir}: {e.args[0]} (not part of a {cfg.family} model)") from None
    if shape != want:
        raise ValueError(f"{name} has shape {shape}, config.json implies {want}")


def _check_complete(missing_names: set[str], hf_dir: Any) -> None:
    missing = sorted(missing_names)
    if missing:
        more = f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""
        raise ValueError(f"{hf_dir} lacks {len(missing)} tensors: {missing[:10]}{more}")


def _set_layer(stacked: jax.Array, piece: jax.Array, index: jax.Array) -> jax.Array:
    """Write `piece` at `index` (a layer, or a [layer, expert] pair) of the leading axes."""
    lead = index.shape[0] if index.ndim else 1
    at = (*jnp.atleast_1d(index), *[0] * (stacked.ndim - lead))
    return jax.lax.dynamic_update_slice(stacked, piece.astype(stacked.dtype)[(None,) * lead], at)


@functools.cache
def _layer_setter(sharding: jax.sharding.Sharding) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """In-place (donated) write of one layer (or one layer's expert) into a stacked parameter that
    keeps `sharding`."""
    return jax.jit(_set_layer, donate_argnums=0, out_shardings=sharding)


@functools.cache
def _zeros(
    shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding
) -> Callable[[], jax.Array]:
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def _slice_sharding(sharding: jax.sharding.Sharding, lead: int = 1) -> jax.sharding.Sharding:
    """Sharding of one layer (`lead` 2: one layer's expert) of a stacked parameter: the stacked
    spec without its leading entries."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[lead:]))
    return sharding


def _to_device(host: np.ndarray, sharding: jax.sharding.Sharding, dtype: np.dtype) -> jax.Array:
    # Each addressable device gets only its slice, cast per slice: no full-size cast copy.
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: np.asarray(host[idx], dtype=dtype))


def load_hf_model(
    hf_dir: str | pathlib.Path,
    *,
    mesh: Mesh | None = None,
    rules: Any = None,
    param_dtype: str | None = None,
    log: Log | None = None,
    **overrides: Any,
) -> tuple[ModelConfig, llama.Transformer]:
    """Stream a transformers Llama/Mistral checkpoint into a Transformer.

    Every expected tensor must be present exactly once with the right shape; unknown
    tensors are an error. `overrides` replace ModelConfig fields (e.g. dtype="float32").
    """
    log = log or _quiet
    cfg = read_hf_config(hf_dir, param_dtype=param_dtype)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    check_tensor_set(hf_dir, cfg)  # the whole set first: nothing half-loaded, dropped or overwritten
    graphdef, abs_params = abstract_params(cfg)
    shardings = param_shardings(abs_params, mesh, rules)
    pdt = NP_DTYPES[cfg.param_dtype]
    flat_abs = flatten_dict(nnx.to_pure_dict(abs_params))
    flat_sh = flatten_dict(shardings)

    expected = params.expected_hf_names(cfg)
    total = len(expected)
    arrays: dict[tuple[str, ...], jax.Array] = {}
    seen: set[str] = set()
    skipped: list[str] = []
    for name, tensor in iter_hf_tensors(hf_dir):
        if _RECOMPUTED_RE.match(name) or (name == "lm_head.weight" and cfg.tie_embeddings):
            skipped.append(name)
            log(f"  skip {name} ({'recomputed' if 'rotary' in name else 'tied to the embedding'})")
            continue
        if name in seen:
            raise ValueError(f"tensor {name} appears twice in {hf_dir}")
        _check_shape(name, tuple(tensor.shape), cfg, hf_dir)
        path, layer, ours = params.hf_to_ours(name, tensor, cfg)
        del tensor
        sh = flat_sh[path]
        if layer is None:
            arrays[path] = _to_device(ours, sh, pdt)
        else:
            if path not in arrays:
                # Every layer slot is overwritten below and checked by `seen`: nothing stays zero.
                arrays[path] = _zeros(tuple(flat_abs[path].shape), pdt, sh)()
            index = jnp.asarray(layer, jnp.int32)  # a layer, or a (layer, expert) pair
            piece = _to_device(ours, _slice_sharding(sh, max(1, index.size)), pdt)
            arrays[path] = _layer_setter(sh)(arrays[path], piece, index)
        del ours
        seen.add(name)
        where = "" if layer is None else f"{list(layer)}" if isinstance(layer, tuple) else f"[{layer}]"
        log(f"  [{len(seen)}/{total}] {name} -> {'/'.join(path)}{where}")

    _check_complete(expected - seen, hf_dir)
    if skipped:
        log(f"skipped {len(skipped)} tensor(s) that are recomputed or tied")
    nnx.replace_by_pure_dict(abs_params, unflatten_dict(arrays))
    return cfg, nnx.merge(graphdef, abs_params)


# ------------------------------------------------------------------------------ writing


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500*2**20, '1234' -> 1234 (decimal units, as transformers)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    unit = (m.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1024 if "I" in unit else 1000
    value = int(float(m.group(1)) * base**power)
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def _hf_plan(
    cfg: ModelConfig, flat_abs: Mapping[tuple[str, ...], Any]
) -> list[tuple[str, tuple[str, ...], params.Index]]:
    """(HF name, our path, layer) in transformers' order: embed, layer 0..L-1, norm, lm_head."""
    plan = [(name, row.path, layer) for name, row, layer in params.hf_order(cfg)]
    missing = sorted({"/".join(p) for _, p, _ in plan} - {"/".join(p) for p in flat_abs})
    if missing:
        raise ValueError(f"model lacks parameters {missing}")
    return plan


def _to_host(x: jax.Array, *, owned: bool) -> np.ndarray:
    """The array on this host, as numpy. `owned`: `x` is a temporary of the caller's.

    jax caches the host copy of a sharded array on the array itself (`_npy_value`), for the array's
    lifetime: done to one of the model's own arrays, an export would leave a host copy of every
    unstacked parameter (the embedding, the LM head: 2 GB for Llama-3-8B in bfloat16) alive for as
    long as the model. A device-side copy takes the cache and dies with it.
    """
    if x.is_fully_addressable:
        if not owned:
            x = jax.device_put(x, may_alias=False)
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_output_dir(out_dir: str | pathlib.Path) -> pathlib.Path:
    """Refuse a directory that already holds a model: mixing old and new shards corrupts both
    (`save_hf`'s own guard; the CLIs check their outputs with agentrefine_jax.outputs first)."""
    out = pathlib.Path(out_dir)
    if out.exists() and (any(out.glob("*.safetensors")) or (out / "config.json").exists()):
        raise FileExistsError(f"{out} already holds a model; choose an empty directory")
    return out


def save_hf(
    model: llama.Transformer,
    model_cfg: ModelConfig,
    out_dir: str | pathlib.Path,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | None = None,
    log: Log | None = None,
) -> None:
    """Write a transformers checkpoint directory.

    safetensors (sharded with an index past `max_shard_bytes`), config.json,
    generation_config.json, and the tokenizer files when `tokenizer` is given.
    """
    log = log or _quiet
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NP_DTYPES)}, got {dtype!r}")
    out = check_output_dir(out_dir)
    config_json = hf_config_dict(model_cfg, dtype)  # validates before anything is written
    np_dtype = NP_DTYPES[dtype]
    flat = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    plan = _hf_plan(model_cfg, flat)

    def nbytes(path: tuple[str, ...]) -> int:
        return math.prod(params.slice_shape(params.BY_PATH[path], model_cfg)) * np_dtype.itemsize

    shards: list[list[tuple[str, tuple[str, ...], params.Index]]] = [[]]
    size = 0
    for entry in plan:
        n = nbytes(entry[1])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    total_bytes = sum(nbytes(p) for _, p, _ in plan)
    names = (
        [SAFE_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    done = 0
    for fname, entries in zip(names, shards, strict=True):
        tensors: dict[str, np.ndarray] = {}
        for hf_name, path, layer in entries:
            arr = flat[path]
            host = _to_host(arr if layer is None else arr[layer], owned=layer is not None)
            name, host = params.ours_to_hf(params.BY_PATH[path], host, layer)
            assert name == hf_name, (name, hf_name)
            tensors[name] = np.ascontiguousarray(host.astype(np_dtype, copy=False))
            weight_map[name] = fname
            done += 1
        if writer:
            save_safetensors(tensors, out / fname)
        log(f"  wrote {fname}: {len(tensors)} tensors ({done}/{len(plan)})")
        del tensors
    if not writer:
        return
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / SAFE_INDEX).write_text(json_dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json_dumps(config_json, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json_dumps(generation_config_dict(model_cfg), indent=2) + "\n"
    )
    log(f"wrote config.json, generation_config.json ({total_bytes / 1e6:.1f} MB of {dtype} weights)")
    if tokenizer:
        _save_tokenizer(tokenizer, out, log)
    else:
        log("note: no tokenizer recorded in the checkpoint; tokenizer files not written (pass --tokenizer)")


def _save_tokenizer(name: str, out: pathlib.Path, log: Log) -> None:
    try:
        from agentrefine_jax.data.tokenizers import load_tokenizer
    except ImportError as e:
        log(f"note: tokenizer {name!r} not written: agentrefine_jax.data.tokenizers unavailable ({e})")
        return
    try:
        load_tokenizer(name).save_pretrained(str(out))
    except OSError:
        raise
    except Exception as e:  # the `tokenizers` writer reports a full disk as a bare Exception
        error = _as_os_error(e, out)
        if error is e:
            raise
        raise error from e
    log(f"wrote tokenizer files for {name!r}")


def write_hf(
    model: llama.Transformer,
    model_cfg: ModelConfig,
    out: str | pathlib.Path,
    *,
    overwrite: bool = False,
    protect: Sequence[str | pathlib.Path] = (),
    tool: str = "export",
    **save_kwargs: Any,
) -> str:
    """`save_hf` to a local directory or a URL (gs://..., file://...); returns where it went.

    Written into a new temporary sibling and renamed into place (agentrefine_jax.outputs; a local
    staging directory for URLs), so a crash never leaves a half-written model where one is
    expected; `overwrite` replaces only an earlier export of this project, never anything else.
    """
    import tempfile

    target = as_path(out)
    main = jax.process_index() == 0
    if not is_url(target):
        # A full disk: the export is written again under $TMPDIR and OutputWriteError says where.
        outputs.write_dir(
            str(target),
            lambda where: save_hf(model, model_cfg, where, **save_kwargs),
            tool=tool,
            overwrite=overwrite,
            protect=protect,
            writer=main,
            note=save_kwargs.get("log"),
        )
        return str(target)
    if main:
        _check_url_dir(target, overwrite)
    with tempfile.TemporaryDirectory(prefix="agentrefine-export-") as staging:
        local = pathlib.Path(staging) / "hf"
        save_hf(model, model_cfg, local, **save_kwargs)
        if main:
            outputs.mark(local, tool)
            if target.exists() and any(target.iterdir()):
                _check_url_dir(target, overwrite)
                target.rmtree()  # an earlier export of this project (checked just above)
            target.mkdir(parents=True, exist_ok=True)
            for f in sorted(local.iterdir()):  # config.json last: it marks a complete export
                if f.name != "config.json":
                    _copy_out(f, target / f.name)
            _copy_out(local / "config.json", target / "config.json")
    return str(target)


def _check_url_dir(target: Any, overwrite: bool) -> None:
    """The `outputs.check_dir` rule for a URL: empty, or (with overwrite) only an earlier export."""
    if not target.exists() or not any(target.iterdir()):
        return
    if not overwrite:
        raise outputs.OutputError(f"{target} exists and is not empty; choose a new directory")
    marker_path = target / outputs.MARKER
    marker = json.loads(marker_path.read_text()) if marker_path.exists() else None
    marker = marker if isinstance(marker, dict) else None
    present = {f.name for f in target.iterdir()} - {outputs.MARKER}
    if marker is None or not present <= set(marker.get("entries", ())):
        raise outputs.OutputError(f"{target} holds files this project did not write; it is not replaced")
    why = outputs.changed_since_marked(target, sorted(present), marker)  # sizes and sha256s
    if why:
        raise outputs.OutputError(f"{target} {why}")


def _copy_out(src: pathlib.Path, dst: Any) -> None:
    import shutil

    with src.open("rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(fin, fout, length=1 << 24)
