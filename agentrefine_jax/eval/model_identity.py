"""What model an evaluation runs, pinned once at its start: the journal is bound to it, the results record it.

`--checkpoint RUN_DIR` names the run's newest step *now*; a run still training saves newer ones. An evaluation
resolves the step once (`identify`), loads exactly that step, records it in its results, and binds its
journal to it (eval/journal.py): a rerun that resolves to another step, or to the same step saved again with
other parameters, is refused instead of resuming into a result that mixes two models' episodes.

* a project checkpoint: the step directory, its step and `params_fingerprint` (a digest of its manifest's
  records of the parameter files: no weight is read);
* an HF directory: the directory and a digest of its config and weight files' names, sizes and contents
  (it has no manifest): files up to `WHOLE_FILE_BYTES` whole, larger ones by their first and last MiB (a
  safetensors header names every tensor, its dtype, shape and offsets) and `SAMPLES` blocks evenly spread
  between — a different model differs in nearly every block, and hashing gigabytes at every start would cost
  more than it checks. Not modification times: the same model exported again, or restored from a record on
  another machine (benchmarks/mini_paper.py `--record`), is the same model (with mtimes, a record's journal of
  96 base episodes could not be resumed on the next machine);
* an endpoint: its URL and model name.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from agentrefine_jax.outputs import json_dumps

_HF_FILES = ("config.json", "model.safetensors.index.json")
WHOLE_FILE_BYTES = 64 << 20
SAMPLES, SAMPLE_BYTES, EDGE_BYTES = 256, 64 << 10, 1 << 20


def identify(checkpoint: str | None, base_url: str | None, model: str | None) -> dict[str, Any] | None:
    """The identity of `--checkpoint` (resolved to one step) or `--base-url`/`--model`; None for a policy."""
    if checkpoint:
        return checkpoint_identity(checkpoint)
    if base_url:
        return {"base_url": base_url, "model": model}
    return None


def checkpoint_identity(path: str) -> dict[str, Any]:
    """{"checkpoint": the step dir (or HF dir) loaded, "step", "fingerprint"} of what `path` names now."""
    from agentrefine_jax.checkpoint import params_fingerprint, resolve_checkpoint
    from agentrefine_jax.inference.loading import is_hf_dir
    from agentrefine_jax.paths import as_path

    if is_hf_dir(path):
        where = os.path.abspath(path)
        return {"checkpoint": where, "step": None, "fingerprint": _hf_fingerprint(where)}
    root, step = resolve_checkpoint(path)
    return {
        "checkpoint": str(as_path(root) / str(step)),
        "step": step,
        "fingerprint": params_fingerprint(root, step),
    }


def _hf_fingerprint(hf_dir: str) -> str:
    names = sorted(n for n in os.listdir(hf_dir) if n in _HF_FILES or n.endswith(".safetensors"))
    digest = hashlib.sha256(b"hf-content-v1")
    for name in names:
        digest.update(json_dumps([name, _content_digest(os.path.join(hf_dir, name))]).encode())
    return digest.hexdigest()


def _content_digest(path: str) -> list[Any]:
    """[size, sha256 of the file's content or of its sampled blocks] (module docstring)."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            h.update(f.read())
        else:
            span = size - 2 * EDGE_BYTES - SAMPLE_BYTES
            blocks = [(EDGE_BYTES + i * span // (SAMPLES - 1), SAMPLE_BYTES) for i in range(SAMPLES)]
            for offset, length in [(0, EDGE_BYTES), *blocks, (size - EDGE_BYTES, EDGE_BYTES)]:
                f.seek(offset)
                h.update(f.read(length))
    return [size, h.hexdigest()]


def describe(identity: dict[str, Any] | None) -> str:
    """One phrase for an error line: `checkpoint X (step 3, parameters 1a2b3c4d5e6f)` or `model m at URL`."""
    if identity is None:
        return "no recorded model"
    if "base_url" in identity:
        return f"model {identity.get('model')!r} at {identity['base_url']}"
    step = identity.get("step")
    at = f"step {step}, " if step is not None else ""
    return f"{identity.get('checkpoint')} ({at}parameters {str(identity.get('fingerprint'))[:12]})"


def resumable(identity: Any) -> bool:
    """Whether `identity` names a checkpoint whose files are still those it was taken from (the journal's
    mismatch line then says: rerun naming that step directory)."""
    if not isinstance(identity, dict) or not identity.get("checkpoint") or not identity.get("fingerprint"):
        return False
    try:
        return checkpoint_identity(identity["checkpoint"]) == identity
    except (OSError, ValueError):
        return False
