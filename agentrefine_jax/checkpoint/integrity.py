"""Integrity manifests: what makes a step trustworthy after a crash, a kill or a flipped bit.

Once Orbax has committed a step, `write_manifest` records the size and sha256 of every file in it
(`MANIFEST`, written last; the trainer hashes on a background worker, off the training step).
`verify_step` re-hashes them; a step whose files differ is corrupt. A step with no manifest is one
whose process was killed between Orbax's commit and the manifest: if Orbax's own commit record is
complete (`orbax_commit_problem`: the step's `commit_success.txt`, a commit timestamp in
`_CHECKPOINT_METADATA`, every item committed) the trainer re-hashes it, writes the manifest and
resumes from it (`verify_step(..., repair=True)`); otherwise it is an interrupted save. Why this
rule and not "manifest before Orbax may delete older steps": it also covers the very first
checkpoint (nothing older to fall back to), leaves Orbax's keep policy as it is, and lets hashing
run off the step; Orbax's commit is atomic (a rename, or a commit file on object stores), so a
committed step is complete. The trainer resumes from the newest intact step
(`newest_intact_step`) and says which ones it skipped or repaired.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import warnings

from etils import epath

from agentrefine_jax.checkpoint.format import ITEM_META, ITEM_PARAMS, checkpoint_steps, resolve_checkpoint
from agentrefine_jax.checkpoint.meta import CheckpointMeta, read_meta
from agentrefine_jax.outputs import json_dumps
from agentrefine_jax.paths import as_path, is_url

MANIFEST = "agentrefine_manifest.json"
ORBAX_COMMIT_FILE = "commit_success.txt"  # orbax.checkpoint's atomicity COMMIT_SUCCESS_FILE
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"

log = logging.getLogger("agentrefine_jax.checkpoint")


class CheckpointIntegrityError(ValueError):
    """A checkpoint step whose files do not match its manifest (or that has none)."""


def _file_digest(path: epath.Path) -> tuple[int, str]:
    # Into one reused 4 MiB buffer where the file object can (local files): a fresh 16 MiB bytes
    # per read cost ~10% more CPU, and the hashing shares the cores with the training step.
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        readinto = getattr(f, "readinto", None)
        if readinto is None:  # a remote file object without it
            while chunk := f.read(1 << 24):
                h.update(chunk)
                size += len(chunk)
            return size, h.hexdigest()
        buf = bytearray(1 << 22)
        view = memoryview(buf)
        while n := readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def file_digests(step_dir: epath.Path, names: list[str]) -> list[tuple[int, str]]:
    """(size, sha256) per file, several files at once (hashlib releases the GIL on big reads)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda rel: _file_digest(step_dir / rel), names))


def _step_files(step_dir: epath.Path) -> list[str]:
    """Relative names of every file in a step directory except the manifest."""
    # fsspec-backed walks (gs://) yield "bucket/dir" without the scheme: compare scheme-less.
    base = str(step_dir).split("://", 1)[-1].rstrip("/")
    out = []
    for dirpath, _, filenames in step_dir.walk():
        where = str(dirpath).split("://", 1)[-1].rstrip("/")
        if where != base and not where.startswith(base + "/"):
            raise CheckpointIntegrityError(f"listing {step_dir} returned {dirpath}, outside it")
        for name in filenames:
            rel = f"{where[len(base) + 1 :]}/{name}" if where != base else name
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str | os.PathLike[str]) -> epath.Path:
    """Record size + sha256 of every file of a committed step; written last, so it marks completion."""
    from agentrefine_jax import faults

    step_dir = as_path(step_dir)
    names = _step_files(step_dir)
    files = {
        rel: {"size": size, "sha256": digest}
        for rel, (size, digest) in zip(names, file_digests(step_dir, names), strict=True)
    }
    if not files:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} holds no files")
    target = step_dir / MANIFEST
    body = json_dumps({"version": 1, "files": files}, indent=1, sort_keys=True)
    if is_url(step_dir):
        target.write_text(body)  # object stores publish an object whole
    else:
        tmp = step_dir / (MANIFEST + ".tmp")
        tmp.write_text(body)
        if step_dir.name.isdigit():
            faults.point("during_manifest", int(step_dir.name))
        tmp.rename(target)
    return target


def orbax_commit_problem(step_dir: str | os.PathLike[str]) -> str | None:
    """None when Orbax's own record says the step was committed whole, else what is missing:
    the step's commit marker, its commit timestamp, and a commit marker in every item it lists
    (Orbax writes each of these only after every byte of the step is written)."""
    step_dir = as_path(step_dir)
    if not (step_dir / ORBAX_COMMIT_FILE).exists():
        return f"it has no Orbax commit marker ({ORBAX_COMMIT_FILE})"
    try:
        meta = json.loads((step_dir / ORBAX_STEP_METADATA).read_text())
        items = dict(meta["item_handlers"])
        committed_at = meta["commit_timestamp_nsecs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its Orbax {ORBAX_STEP_METADATA} is unreadable ({type(e).__name__}: {e})"
    if not committed_at:
        return f"its Orbax {ORBAX_STEP_METADATA} has no commit timestamp"
    for item in sorted({ITEM_PARAMS, ITEM_META} | set(items)):
        if item not in items or not (step_dir / item / ORBAX_COMMIT_FILE).exists():
            return f"its item '{item}' was not committed"
    return None


def verify_step(step_dir: str | os.PathLike[str], *, repair: bool = False) -> bool:
    """Raise CheckpointIntegrityError naming the first problem found in a step directory.

    A step without a manifest is an interrupted save, unless `repair` and Orbax's commit record
    is complete (killed between the commit and the manifest): then its files are hashed and its
    manifest written now. Returns True when it did that.
    """
    step_dir = as_path(step_dir)
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        problem = orbax_commit_problem(step_dir) if repair else None
        if repair and problem is None:
            write_manifest(step_dir)
            return True
        why = f" and {problem}" if problem else ""
        raise CheckpointIntegrityError(f"checkpoint {step_dir} is incomplete: it has no {MANIFEST}{why}")
    try:
        want = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointIntegrityError(f"checkpoint {step_dir}: unreadable {MANIFEST} ({e})") from None
    have = set(_step_files(step_dir))
    missing = sorted(set(want) - have)
    if missing:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} is incomplete: {missing[0]} is missing")
    extra = sorted(have - set(want))
    if extra:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} has a file its manifest lacks: {extra[0]}")
    for (rel, rec), (size, digest) in zip(want.items(), file_digests(step_dir, list(want)), strict=True):
        if size != rec["size"]:
            raise CheckpointIntegrityError(
                f"checkpoint {step_dir} is truncated: {rel} has {size} bytes, {rec['size']} were written"
            )
        if digest != rec["sha256"]:
            raise CheckpointIntegrityError(f"checkpoint {step_dir} is corrupt: {rel} fails its sha256 check")
    return False


def newest_intact_step(
    root: str | os.PathLike[str], *, repair: bool = False
) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest step whose files match its manifest, [(step, problem)] of the newer steps skipped).

    `repair`: a committed step missing only its manifest gets one (see `verify_step`), with a
    notice in the log. (None, []) when there is no step at all; raises CheckpointIntegrityError
    when steps exist but none is intact, naming them.
    """
    root = as_path(root)
    steps = checkpoint_steps(root)
    skipped: list[tuple[int, str]] = []
    for step in reversed(steps):
        try:
            if verify_step(root / str(step), repair=repair):
                log.warning(
                    f"NOTE: checkpoint {root / str(step)} had no {MANIFEST} (the run stopped before it was "
                    f"written); Orbax's commit record is complete, so it was hashed now and is used"
                )
        except CheckpointIntegrityError as e:
            skipped.append((step, str(e)))
            continue
        return step, skipped
    if steps:
        raise CheckpointIntegrityError(
            f"no intact checkpoint in {root}: steps {steps} all fail verification "
            f"({'; '.join(p for _, p in skipped)}); start a new train.run_dir or restore the checkpoints"
        )
    return None, skipped


def open_step(path: str | pathlib.Path | epath.Path) -> tuple[epath.Path, int, CheckpointMeta]:
    """(root, step, meta) of the step `path` names, its files verified against its manifest."""
    root, step = resolve_checkpoint(path)
    if (root / str(step) / MANIFEST).exists():
        verify_step(root / str(step))
    else:  # written by another tool or an older version: usable, but say it is unverified
        warnings.warn(f"checkpoint {root / str(step)} has no {MANIFEST}; loading it unverified", stacklevel=2)
    return root, step, read_meta(root, step)


def params_fingerprint(root: str | os.PathLike[str], step: int) -> str:
    """A sha256 naming the parameters one saved step holds, cheap to take: it digests the
    manifest's records (size, sha256) of the step's `params` and `meta` files (the meta names a
    LoRA step's frozen base, whose weights make the model as much as the adapters do), hashes the
    save already computed. A step without a manifest (another tool's, an older version's) has
    those files hashed now.

    Two saves of the same step number with different parameters never share a fingerprint (an
    evaluation journal is bound to it: eval/model_identity.py); a file-level digest, so two
    separate saves of equal parameters may still differ, which only ever refuses a resume."""
    step_dir = as_path(root) / str(step)
    items = {ITEM_PARAMS, ITEM_META}
    manifest = step_dir / MANIFEST
    if manifest.exists():
        try:
            files = json.loads(manifest.read_text())["files"]
            records = {
                rel: [rec["size"], rec["sha256"]] for rel, rec in files.items() if rel.split("/")[0] in items
            }
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointIntegrityError(f"checkpoint {step_dir}: unreadable {MANIFEST} ({e})") from None
    else:
        names = [rel for rel in _step_files(step_dir) if rel.split("/")[0] in items]
        records = {rel: list(d) for rel, d in zip(names, file_digests(step_dir, names), strict=True)}
    if not records:
        raise CheckpointIntegrityError(f"checkpoint {step_dir} holds no '{ITEM_PARAMS}' files")
    return hashlib.sha256(json_dumps(records, sort_keys=True).encode()).hexdigest()
