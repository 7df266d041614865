"""`python -m agentrefine_jax.export {from-hf,from-gguf,to-hf,verify,demo}`: HF interop from the shell.

Exit codes: 0 success, 1 `verify` out of tolerance (or structurally different), 2 bad
input (missing files, refused weights, config mismatch while loading, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax

from agentrefine_jax import logs, outputs
from agentrefine_jax.cli_errors import DISK_FULL, OneLineParser, fail, float_in, write_failed
from agentrefine_jax.models.config import DTYPES
from agentrefine_jax.models.llama import param_count
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path

log = logging.getLogger("agentrefine_jax.export")
OVERWRITE_HELP = (
    "replace --out if it is an earlier output of this project (its marker file, nothing else in it); "
    "never a run directory or a directory holding anything else"
)


def parse_mesh(text: str) -> Any:
    """'auto' (fsdp over all devices when there are several), 'none', or 'data=1,fsdp=-1,tensor=2'."""
    from agentrefine_jax.sharding import make_mesh, parse_mesh_sizes

    if text == "none":
        return None
    if text == "auto":
        return make_mesh(data=1, fsdp=-1, tensor=1) if jax.device_count() > 1 else None
    try:
        sizes = parse_mesh_sizes(text)
    except ValueError:
        raise ValueError(
            f"--mesh: expected 'auto', 'none' or e.g. 'data=1,fsdp=-1,tensor=2', got {text!r}"
        ) from None
    return make_mesh(**sizes)


def _describe_mesh(mesh: Any) -> str:
    return "single device" if mesh is None else f"mesh {dict(mesh.shape)}"


def cmd_from_hf(args: argparse.Namespace) -> int:
    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.hf.io import hf_storage_dtype, load_hf_model, read_hf_config

    outputs.check_dir(args.out, overwrite=args.overwrite, protect=[args.hf])  # before any reading
    mesh = parse_mesh(args.mesh)
    cfg = read_hf_config(args.hf, param_dtype=args.param_dtype)
    log.info(
        f"reading {args.hf}: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads} kv, vocab {cfg.vocab_size}, rope theta {cfg.rope_theta:g}"
        f"{', llama3 scaling' if cfg.rope_scaling else ''}"
        f"{f', sliding window {cfg.sliding_window}' if cfg.sliding_window else ''}; "
        f"params as {cfg.param_dtype} on {_describe_mesh(mesh)}"
    )
    tokenizer = args.tokenizer
    hf = pathlib.Path(args.hf)
    if tokenizer is None and ((hf / "tokenizer.json").exists() or (hf / "tokenizer_config.json").exists()):
        tokenizer = str(hf.resolve())
        log.info(f"note: recording the tokenizer in {tokenizer} (override with --tokenizer NAME)")
    t0 = time.time()
    cfg, model = load_hf_model(args.hf, mesh=mesh, param_dtype=args.param_dtype, log=log.info)
    log.info(
        f"loaded {param_count(model):,} parameters in {time.time() - t0:.1f}s; writing checkpoint {args.out}"
    )
    source_dtype = hf_storage_dtype(args.hf)
    # Orbax writes collectively: every process must name the same directory, so a multi-process
    # import writes in place (after the same up-front check); one process publishes atomically.
    publish = (
        outputs.publish_dir(args.out, tool="export from-hf", overwrite=args.overwrite, protect=[args.hf])
        if jax.process_count() == 1
        else contextlib.nullcontext(pathlib.Path(args.out))
    )
    with publish as where:
        save_model(
            where,
            model,
            cfg,
            step=0,
            tokenizer=tokenizer,
            template=args.template,
            source_dtype=source_dtype,
        )
    log.info(f"done: {pathlib.Path(args.out) / '0'}")
    return 0


def cmd_from_gguf(args: argparse.Namespace) -> int:
    """llama.cpp GGUF file -> HF directory (numpy dequantisation; hf/gguf_import.py)."""
    from agentrefine_jax.hf.gguf_import import read_gguf, write_hf_dir

    outputs.check_dir(args.out, overwrite=args.overwrite, protect=[args.gguf])  # before any reading
    t0 = time.time()
    m = read_gguf(args.gguf)  # refuses an unsupported file in one line, before anything is written
    c = m.cfg
    types = sorted({t.tensor_type.name for t in m.reader.tensors})
    eos = [m.tokens[i] for i in c.eos_token_ids]
    log.info(
        f"reading {args.gguf}: {m.arch}, {c.num_layers} layers, hidden {c.hidden_size}, "
        f"heads {c.num_heads}/{c.num_kv_heads} kv, vocab {c.vocab_size}, "
        f"context {c.max_position_embeddings}, "
        f"{'tied' if c.tie_embeddings else 'untied'} embeddings; tensors {', '.join(types)}; "
        f"special tokens (the file's ids) bos {m.token('bos')!r}, eos {eos}, "
        f"pad {m.token('pad')!r}"
    )
    with outputs.publish_dir(
        args.out, tool="export from-gguf", overwrite=args.overwrite, protect=[args.gguf]
    ) as tmp:
        write_hf_dir(m, tmp, dtype=args.dtype, log=log.info)
    log.info(f"done in {time.time() - t0:.1f}s: {args.out}")
    return 0


def cmd_to_hf(args: argparse.Namespace) -> int:
    from agentrefine_jax.checkpoint import load_model, read_meta, resolve_checkpoint
    from agentrefine_jax.hf.io import parse_size, resolve_export_dtype, write_hf
    from agentrefine_jax.paths import is_url

    root, step = resolve_checkpoint(args.checkpoint)
    if not is_url(args.out):  # before loading anything: a refused --out costs nothing
        outputs.check_dir(args.out, overwrite=args.overwrite, protect=[args.checkpoint])
    mesh = parse_mesh(args.mesh)
    max_shard = parse_size(args.max_shard_size)
    is_lora = read_meta(root, step).lora is not None
    if args.merge_lora and not is_lora:
        raise ValueError(f"--merge-lora: {root} step {step} is not a LoRA run")
    if is_lora and not args.merge_lora:
        return _to_peft(args, root / str(step), mesh, max_shard)
    log.info(f"loading checkpoint {root} step {step} on {_describe_mesh(mesh)}")
    # --merge-lora: the adapters merged into the base as the user has it (not as the run held it).
    cfg, model, meta = load_model(args.checkpoint, mesh=mesh, handoff=args.merge_lora)
    _note_rounding(meta, "the merged export merges the adapters into")
    tokenizer = args.tokenizer or meta.tokenizer
    dtype = resolve_export_dtype(
        args.export_dtype, source_dtype=meta.source_dtype, param_dtype=cfg.param_dtype
    )
    if args.export_dtype == "auto":
        why = "the dtype it was imported from" if meta.source_dtype else "the parameter dtype"
        log.info(f"--export-dtype auto: {dtype}, {why}")
    log.info(f"writing {param_count(model):,} parameters as {dtype} to {args.out}")
    write_hf(
        model,
        cfg,
        args.out,
        overwrite=args.overwrite,
        protect=[args.checkpoint],
        tool="export to-hf",
        dtype=dtype,
        max_shard_bytes=max_shard,
        tokenizer=tokenizer,
        log=log.info,
    )
    log.info(f"done: {args.out}")
    return 0


def _to_peft(args: argparse.Namespace, step_dir: Any, mesh: Any, max_shard: int) -> int:
    """A LoRA run without --merge-lora: a PEFT adapter directory (plus the base when it is not an HF dir)."""
    from flax import nnx

    from agentrefine_jax.checkpoint import load_lora, read_meta
    from agentrefine_jax.hf.io import save_hf
    from agentrefine_jax.hf.peft import write_peft_adapter
    from agentrefine_jax.models.llama import abstract_params

    meta = read_meta(step_dir.parent, int(step_dir.name))
    base_cfg, base, spec, adapters = load_lora(step_dir, meta, mesh=mesh)
    _note_rounding(meta, "PEFT applies the adapters to")
    tokenizer = args.tokenizer or meta.tokenizer

    def write_base(where: Any) -> None:
        dtype = base_cfg.param_dtype if args.export_dtype == "auto" else args.export_dtype
        graphdef, abs_params = abstract_params(base_cfg)
        nnx.replace_by_pure_dict(abs_params, base)
        model = nnx.merge(graphdef, abs_params)
        log.info(f"the base is not an HF directory: writing it ({dtype}) to {where}")
        save_hf(model, base_cfg, where, dtype=dtype, max_shard_bytes=max_shard, tokenizer=tokenizer)

    outputs.write_dir(  # a full disk: written again under $TMPDIR, the error line says where
        args.out,
        lambda where: write_peft_adapter(
            where, spec, adapters, meta.lora.base.init_from_hf, write_base=write_base
        ),
        tool="export to-hf",
        overwrite=args.overwrite,
        protect=[args.checkpoint],
        writer=jax.process_index() == 0,
        note=log.info,
    )
    log.info(f"done: PEFT adapter (rank {spec.rank}, {', '.join(spec.targets)}) in {args.out}")
    return 0


def _note_rounding(meta: Any, handoff: str) -> None:
    """Say so when the run trained on a rounded copy of its base: the hand-off is then not
    exactly the trained model (`export verify` measures by how much)."""
    from agentrefine_jax.checkpoint import trained_base_rounding

    rounding = trained_base_rounding(meta)
    if rounding is not None:
        stored, trained = rounding
        log.info(
            f"note: the run trained on its base rounded from {stored} to {trained} "
            f"(train.lora.base_dtype); {handoff} the base's own {stored} weights "
            f"({meta.lora.base.init_from_hf}); `export verify --checkpoint RUN --hf OUT` "
            "reports the difference"
        )


def _seq_lens(text: str, hf_dir: str) -> list[int]:
    """`--seq-lens`: positive integers, none above the model's context (its HF config.json's
    max_position_embeddings, read before anything heavy: a length past it is refused, not run)."""
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seq-lens {text!r}: expected comma-separated integers") from None
    if not lens or min(lens) < 1:
        raise ValueError(f"--seq-lens {text!r}: each length must be >= 1")
    try:
        context = json.loads((as_path(hf_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return lens  # verify reports an unreadable HF directory itself
    if isinstance(context, int) and max(lens) > context:
        raise ValueError(f"--seq-lens {max(lens)} is above the model's context ({context} tokens, {hf_dir})")
    return lens


def cmd_verify(args: argparse.Namespace) -> int:
    seq_lens = _seq_lens(args.seq_lens, args.hf)  # refused before torch or any model is loaded
    from agentrefine_jax.export.parity import result_dict, summary, verify

    mesh = parse_mesh(args.mesh)
    log.info(f"verifying {args.checkpoint} against {args.hf} ({args.dtype} compute, lengths {seq_lens})")
    result = verify(
        args.checkpoint,
        args.hf,
        atol=args.atol,
        kl_tol=args.kl_tol,
        compute_dtype=args.dtype,
        seq_lens=seq_lens,
        seed=args.seed,
        mesh=mesh,
        log=log.info,
    )
    print(summary(result), flush=True)
    if args.json:
        print(json_dumps(result_dict(result)))
    return 0 if result.passed else 1


def cmd_demo(args: argparse.Namespace) -> int:
    """Build a preset model and take it through checkpoint -> HF -> verify -> back, end to end."""
    from agentrefine_jax.models import families, preset

    cfg = preset(args.preset)
    tokenizer = families.get(cfg.family).tokenizer
    if tokenizer == "hf":  # the tokenizer would come from an HF directory the demo does not have
        raise ValueError(f"preset {args.preset!r} has no built-in tokenizer (family {cfg.family})")
    with outputs.publish_dir(args.out, tool="export demo", overwrite=args.overwrite) as out:
        passed = _demo(args, out, cfg, tokenizer)
    log.info(f"done: {args.out} (checkpoint/ and hf/)")
    return 0 if passed else 1


def _demo(args: argparse.Namespace, out: pathlib.Path, cfg: Any, tokenizer: str) -> bool:
    import numpy as np
    from flax import nnx

    from agentrefine_jax.checkpoint import save_model
    from agentrefine_jax.export.parity import summary, verify
    from agentrefine_jax.hf.io import load_hf_model, save_hf
    from agentrefine_jax.models import llama

    ck_dir, hf_dir = out / "checkpoint", out / "hf"
    log.info(
        f"[1/4] creating the {args.preset!r} model "
        f"({cfg.num_layers} layers, hidden {cfg.hidden_size}), seed {args.seed}"
    )
    model = nnx.jit(lambda: llama.create(cfg, args.seed))()
    log.info(f"      {param_count(model):,} parameters; saving project checkpoint {ck_dir}")
    save_model(ck_dir, model, cfg, step=0, tokenizer=tokenizer, template=tokenizer)
    log.info(f"[2/4] exporting to Hugging Face format (float32) in {hf_dir}")
    save_hf(model, cfg, hf_dir, dtype="float32", tokenizer=tokenizer, log=log.info)
    log.info("[3/4] verifying our forward pass against transformers on the export")
    result = verify(ck_dir, hf_dir, seq_lens=(16, 128), log=log.info)
    print(summary(result), flush=True)
    log.info("[4/4] importing the export back and comparing every parameter bit for bit")
    _, back = load_hf_model(hf_dir)
    mine = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    theirs = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    same = jax.tree.structure(mine) == jax.tree.structure(theirs) and all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True)
    )
    print("round trip: parameters identical" if same else "round trip: PARAMETERS DIFFER", flush=True)
    return result.passed and same


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m agentrefine_jax.export",
        description=(
            "Convert Hugging Face Llama/Mistral checkpoints to and from project checkpoints; "
            "import llama.cpp GGUF files; verify."
        ),
    )
    sub = p.add_subparsers(dest="command", required=True)
    # Every subcommand takes -q/--quiet and -v/--verbose (added below, once all exist).
    mesh_help = "device mesh: auto (fsdp over all devices if several), none, or data=1,fsdp=-1,tensor=2"

    a = sub.add_parser("from-hf", help="HF safetensors checkpoint -> project checkpoint (Orbax)")
    a.add_argument("--hf", required=True, help="transformers model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="checkpoint root to create, new or empty (step 0 is written)")
    a.add_argument("--tokenizer", help="tokenizer name/path to record (default: the HF dir if it has one)")
    a.add_argument("--template", help="chat template name to record (e.g. llama3, mistral)")
    a.add_argument("--param-dtype", default="float32", choices=DTYPES)
    a.add_argument("--mesh", default="auto", help=mesh_help)
    a.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    a.set_defaults(func=cmd_from_hf)

    g = sub.add_parser("from-gguf", help="llama.cpp GGUF file -> HF safetensors directory (no torch)")
    g.add_argument("--gguf", required=True, help="GGUF file (llama architecture, byte-level BPE tokenizer)")
    g.add_argument("--out", required=True, help="HF directory to create, new or empty")
    g.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="storage dtype"
    )
    g.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    g.set_defaults(func=cmd_from_gguf)

    b = sub.add_parser("to-hf", help="project checkpoint -> HF safetensors directory")
    b.add_argument("--checkpoint", required=True, help="run dir, checkpoint root (latest step) or step dir")
    b.add_argument("--out", required=True, help="output directory (new or empty)")
    b.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    b.add_argument(
        "--export-dtype",  # storage dtype, as `train.export_dtype`; --dtype is a compute dtype everywhere
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="storage dtype of the weights; auto (default): the dtype imported from, else the param dtype",
    )
    b.add_argument(
        "--max-shard-size", default="5GB", help="split safetensors past this size (e.g. 5GB, 500MB)"
    )
    b.add_argument("--tokenizer", help="tokenizer to write (default: the one recorded in the checkpoint)")
    b.add_argument("--mesh", default="auto", help=mesh_help)
    b.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA run: write full weights with the adapters merged (default: a PEFT adapter directory)",
    )
    b.set_defaults(func=cmd_to_hf)

    c = sub.add_parser("verify", help="compare our forward pass with transformers' on the same inputs")
    c.add_argument("--checkpoint", required=True, help="run dir, checkpoint root (latest step) or step dir")
    c.add_argument(
        "--hf",
        required=True,
        help="transformers model directory, or (a LoRA run) its PEFT adapter export, run by peft on its base",
    )
    tolerance = float_in(0, float("inf"))  # a negative tolerance fails every model: a typo
    c.add_argument(
        "--atol", type=tolerance, help="max |Δlogit| allowed (default: 5e-3 float32, 1.0 bfloat16)"
    )
    c.add_argument("--kl-tol", type=tolerance, help="mean KL allowed (default: 1e-5 float32, 2e-2 bfloat16)")
    c.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype, both sides"
    )
    c.add_argument("--seq-lens", default="16,128,512", help="comma-separated test sequence lengths")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--mesh", default="none", help=mesh_help)
    c.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    c.set_defaults(func=cmd_verify)

    d = sub.add_parser("demo", help="preset model -> checkpoint -> HF -> verify -> back (the shipped demo)")
    d.add_argument("--out", required=True, help="work directory, new or empty (checkpoint/ and hf/ go in it)")
    d.add_argument("--preset", default="tiny", help="model preset (default: tiny, CPU-sized)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    d.set_defaults(func=cmd_demo)
    for command in sub.choices.values():
        logs.add_flags(command)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup("export", args)
    try:
        return args.func(args)
    except OSError as e:
        if e.errno in DISK_FULL:  # the work was done and is recomputable; nothing half-written is left
            return write_failed("export", f"{e.strerror}: {e.filename}" if e.filename else e)
        return fail("export", e)  # e.g. a directory gone read-only, a missing file
    except (ValueError, KeyError) as e:
        return fail("export", e)
