"""Compile every paper config for its TPU slice with the real XLA TPU compiler (libtpu; no TPU
needed) and put the planner's estimate beside the compiler's per-device memory.

    python benchmarks/tpu_compile.py [--only llama3_8b] [--attention xla,splash] [--json] [--out F]
        [--python /path/to/venv/bin/python]

Each row is `python -m agentrefine_jax.plan --config C --topology S --compile --json` in its
own process, one at a time (a 70B compile holds several GiB of host memory), run by `--python`
(default: this interpreter) — e.g. a virtual environment with another libtpu, so rows for two
compilers come from the same tree. The compiler moves a step's memory by 30-40%, so every row
records the jax / jaxlib / libtpu versions its compile reported and the table names them. Rows: the three
paper models on their documented slices, Llama-3-8B also on v5e-256 and v6e-64, and the
mixture-of-experts Qwen3-30B-A3B on v5p-32. The
Table 2 ablations run the Llama-3-8B step unchanged (they differ only in which turns carry
loss), so they are not repeated. Splash rows need the `model.attention` config field and are
reported as skipped without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402

GiB = 1024**3

# (config, slice, overrides that map the config's mesh onto the slice)
ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    ("llama3_8b", "v5p-64", ()),
    # 64 sequences cannot split over 256 (or 64 x tensor) batch shards otherwise.
    ("llama3_8b", "v5e-256", ("mesh.fsdp=64", "mesh.tensor=4")),
    ("llama3_8b", "v6e-64", ()),
    ("mistral_7b", "v5p-64", ()),
    ("llama3_70b", "v5p-256", ()),
    # Qwen3-30B-A3B (issue 43): full fine-tuning's 488 GB of float32 weights, gradients and AdamW
    # state need 16 chips (30.5 GiB each); 64 sequences split 4 per chip.
    ("qwen3_30b_a3b", "v5p-32", ()),
]


def has_attention_field() -> bool:
    from agentrefine_jax.models.config import ModelConfig

    return any(f.name == "attention" for f in dataclasses.fields(ModelConfig))


def interpreter_versions(python: str) -> dict[str, str | None]:
    """jax, jaxlib and libtpu as `python` sees them (what its compiles will report)."""
    code = (
        "import json\nfrom agentrefine_jax.train.aot import compiler_versions\n"
        "print(json.dumps(compiler_versions()))"
    )
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if r.returncode:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"[tpu_compile] error: {python} cannot import agentrefine_jax: {why}", file=sys.stderr)
        raise SystemExit(2)
    return json.loads(r.stdout)


def compiler_name(versions: dict[str, str | None]) -> str:
    return f"jax {versions.get('jax')} / libtpu {versions.get('libtpu')}"


def compile_row(
    config: str,
    slice_name: str,
    overrides: tuple[str, ...],
    attention: str | None,
    python: str = sys.executable,
) -> dict:
    sets = [*overrides, *([f"model.attention={attention}"] if attention else [])]
    cmd = [python, "-m", "agentrefine_jax.plan", "--config", config, "--topology", slice_name]
    cmd += ["--compile", "--json", *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    row: dict[str, Any] = {"config": config, "slice": slice_name, "attention": attention or "default"}
    row["overrides"] = list(overrides)
    row["wall_seconds"] = round(time.perf_counter() - t0, 1)
    try:  # exit 1 is "does not fit" (still a report) or a crash (no JSON)
        out = json.loads(r.stdout) if r.returncode in (0, 1) else None
    except json.JSONDecodeError:
        out = None
    if out is None:
        row["error"] = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return row
    b = out["compiled"]["bytes_per_device"]
    row.update(
        versions=out["versions"],
        mesh=out["mesh"],
        compiled_total=b["total"],
        compiled_temp=b["temp"],
        compiled_arguments=b["arguments"],
        fits=out["compiled"]["fits"],
        hbm_bytes=out["compiled"]["hbm_bytes"],
        compile_seconds=out["compiled"]["compile_seconds"],
        planned_total=out["planned"]["bytes_per_device"]["total"],
        planned_to_compiled=out["planned_to_compiled"],
    )
    return row


def replan(row: dict) -> dict:
    """Refresh a reused row's planner figures (the compiler's do not depend on the planner)."""
    from agentrefine_jax.config import load_config
    from agentrefine_jax.train import planner
    from agentrefine_jax.train.topology import get_slice

    sets = [
        *row["overrides"],
        *([f"model.attention={row['attention']}"] if row["attention"] != "default" else []),
    ]
    planned = planner.plan(load_config(row["config"], sets), row["mesh"], get_slice(row["slice"]).chip.name)
    total = planned["bytes_per_device"]["total"]
    return {**row, "planned_total": total, "planned_to_compiled": total / row["compiled_total"]}


def _g(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def table(rows: list[dict], skipped: str | None) -> str:
    lines = [
        "| config | slice | mesh | attention | compiler | compiler GiB/device (temp) | fits HBM | "
        "planner GiB | planner / compiler | splash / xla | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def key(r: dict) -> tuple:
        return r["config"], r["slice"], compiler_name(r.get("versions", {}))

    xla = {key(r): r for r in rows if r["attention"] in ("xla", "default") and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['slice']} | | {r['attention']} | | error: {r['error']} |||||")
            continue
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
        base = xla.get(key(r))
        vs = (
            f"{r['compiled_total'] / base['compiled_total']:.2f}"
            if r["attention"] == "splash" and base and base.get("compiled_total")
            else ""
        )
        ratio = "" if r["planned_to_compiled"] is None else f"{r['planned_to_compiled']:.2f}"
        attention = "xla" if r["attention"] == "default" else r["attention"]
        secs = "n/a" if r["compile_seconds"] is None else f"{r['compile_seconds']:.0f}"
        lines.append(
            f"| {r['config']} | {r['slice']} | {mesh} | {attention} | {compiler_name(r.get('versions', {}))} "
            f"| {_g(r['compiled_total'])} "
            f"({_g(r['compiled_temp'])}) | {'yes' if r['fits'] else 'NO'} of {r['hbm_bytes'] // GiB} | "
            f"{_g(r['planned_total'])} | {ratio} | {vs} | {secs} |"
        )
    if skipped:
        lines.append(f"\n{skipped}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated config names (default: all)")
    ap.add_argument("--slices", help="comma-separated slice names (default: all)")
    ap.add_argument("--attention", default="xla,splash", help="attention implementations to compile")
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter that compiles the rows (e.g. a venv with another libtpu); default: this one",
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--out", help="append each row as a JSON line to this file as it finishes")
    ap.add_argument(
        "--reuse",
        help="JSON lines from an earlier --out: take the compiler's figures from there (same config, "
        "slice, overrides, attention and compiler versions as --python's) and recompute only the planner's",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    versions = interpreter_versions(args.python)
    print(f"# {_machine.header()}", file=sys.stderr, flush=True)
    print(f"# compiler: {compiler_name(versions)} (jaxlib {versions['jaxlib']}) via {args.python}",
          file=sys.stderr, flush=True)  # fmt: skip
    wanted = [a.strip() for a in args.attention.split(",") if a.strip()]
    skipped = None
    if not has_attention_field():
        skipped = (
            f"note: model.attention is not a config field in this tree; compiled the default attention only "
            f"(skipped: {', '.join(a for a in wanted if a != 'xla') or 'none'})"
        )
        wanted = [None]
    only = set(args.only.split(",")) if args.only else None
    slices = set(args.slices.split(",")) if args.slices else None
    reused = []
    if args.reuse:
        with open(args.reuse) as f:
            reused = [json.loads(line) for line in f if line.strip()]
    rows = []
    for config, sl, overrides in ROWS:
        if (only and config not in only) or (slices and sl not in slices):
            continue
        for attention in wanted:
            key = (config, sl, list(overrides), attention or "default", versions)
            row = next(
                (
                    r
                    for r in reused
                    if (r["config"], r["slice"], r["overrides"], r["attention"], r.get("versions")) == key
                ),
                None,
            )
            if row and "error" not in row:
                row = replan(row)
            else:
                row = compile_row(config, sl, overrides, attention, args.python)
            rows.append(row)
            used = compiler_name(row.get("versions", versions))
            gib = row.get("compiled_total", 0) / GiB
            print(f"# {config} {sl} {row['attention']}: {gib:.2f} GiB ({row['wall_seconds'] or 'reused'} s) "
                  f"with {used}", file=sys.stderr, flush=True)  # fmt: skip
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    out = {"machine": _machine.machine(), "rows": rows, "note": skipped, "versions": versions}
    print(json.dumps(out, indent=2) if args.json else table(rows, skipped))
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
