"""What a background save may take from the training step on a CPU backend, and what it must not
change: the step keeps donating its buffers after a save while the saved bytes stay those of the
save; uncompressed and zstd steps restore alike (old zstd checkpoints included); the manifest is
hashed at the lowest CPU priority. Real Orbax on disk, real donation by JAX, real thread nice values."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrefine_jax import checkpoint as ckpt
from agentrefine_jax.checkpoint.train_state import background_priority, lower_storage_threads
from agentrefine_jax.models import preset
from agentrefine_jax.paths import as_path

META = ckpt.make_meta(preset("tiny", vocab_size=256), step=0)
N = 1 << 18


def _state(seed: float) -> tuple[dict, dict]:
    return {"w": jnp.arange(N, dtype=jnp.float32) * seed}, {"mu": jnp.full(N, seed), "count": jnp.int32(seed)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _restore(root, step, params, opt_state, compression="auto"):
    c = ckpt.TrainCheckpoints(as_path(root), keep=5, compression=compression)
    abstract = {"params": _abstract(params), "opt_state": _abstract(opt_state)}
    shardings = jax.tree.map(lambda x: x.sharding, {"params": params, "opt_state": opt_state})
    return ckpt.restore_train_state(c.mngr, step, abstract, shardings)


def test_a_save_leaves_the_step_its_buffers_and_stores_the_state_it_was_given(tmp_path) -> None:
    step = jax.jit(
        lambda p, o: (jax.tree.map(lambda x: x + 1, p), jax.tree.map(lambda x: x * 2, o)),
        donate_argnums=(0, 1),
    )
    params, opt_state = _state(3.0)
    c = ckpt.TrainCheckpoints(as_path(tmp_path / "ck"), keep=5)
    c.save(1, params, opt_state, META)
    live = jax.tree.leaves((params, opt_state))
    params, opt_state = step(params, opt_state)  # while Orbax is still writing, most likely
    jax.block_until_ready((params, opt_state))
    # The step updated its state in place: nothing of the save kept those buffers from donation.
    assert all(x.is_deleted() for x in live)
    first_copy = jax.tree.leaves(c._snapshot.buffers)
    c.save(2, params, opt_state, META)
    # The second save copied into the first one's buffers (Orbax had let go of them).
    assert all(x.is_deleted() for x in first_copy)
    params, opt_state = step(params, opt_state)
    c.finish()
    want1, want2 = _state(3.0), step(*_state(3.0))
    for saved, want in ((1, want1), (2, want2)):
        ckpt.verify_step(tmp_path / "ck" / str(saved))
        got = _restore(tmp_path / "ck", saved, *want)
        for a, b in zip(
            jax.tree.leaves((got["params"], got["opt_state"])), jax.tree.leaves(want), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _bytes(step_dir) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir) for f in fs)


def test_uncompressed_and_zstd_steps_restore_alike_and_open_in_plain_orbax(tmp_path) -> None:
    zeros = ({"w": jnp.zeros(N)}, {"mu": jnp.zeros(N)})  # 2 MiB that zstd squeezes to almost nothing
    sizes = {}
    for compression in ("none", "zstd"):
        c = ckpt.TrainCheckpoints(as_path(tmp_path / compression), keep=1, compression=compression)
        c.save(1, *zeros, META)
        c.finish()
        sizes[compression] = _bytes(tmp_path / compression / "1")
        meta = json.loads((tmp_path / compression / "1" / "_CHECKPOINT_METADATA").read_text())
        # Orbax's own handler is named, as before: Orbax alone (no registry of ours) opens the step.
        assert meta["item_handlers"]["params"].endswith("StandardCheckpointHandler")
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(tmp_path / compression) as plain:
            np.testing.assert_array_equal(plain.restore(1)["params"]["w"], np.zeros(N))
    assert sizes["none"] > 2 * 4 * N > 20 * sizes["zstd"], sizes
    # Either restores under either setting (the codec is read from the stored metadata).
    for stored, reader in (("zstd", "none"), ("none", "zstd"), ("zstd", "auto")):
        got = _restore(tmp_path / stored, 1, *zeros, compression=reader)
        np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.zeros(N))
    with pytest.raises(ValueError, match="compression must be auto, zstd or none"):
        ckpt.TrainCheckpoints(as_path(tmp_path / "x"), keep=1, compression="gzip")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_manifests_are_hashed_at_the_lowest_cpu_priority(tmp_path) -> None:
    before = _nice()
    c = ckpt.TrainCheckpoints(as_path(tmp_path / "ck"), keep=1)

    def inside() -> tuple[int, list[int]]:
        with ThreadPoolExecutor(2) as pool:  # as file_digests hashes several files at once
            return _nice(), list(pool.map(lambda _: _nice(), range(2)))

    assert c._hasher.submit(inside).result() == (19, [19, 19])
    assert _nice() == before  # the training thread keeps its priority
    done = []
    t = threading.Thread(target=lambda: (background_priority(), done.append(_nice())))
    t.start()
    t.join(timeout=30)
    assert done == [19] and _nice() == before
    c.finish()


def test_orbax_writes_on_tensorstore_threads_that_a_save_lowers(tmp_path) -> None:
    before = _nice()
    c = ckpt.TrainCheckpoints(as_path(tmp_path / "ck"), keep=1)
    c.save(1, *_state(1.0), META)
    c.finish()
    lower_storage_threads()
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names[int(tid)] = f.read().strip()
    writers = [tid for tid, name in names.items() if name == "ts_pool_worker"]
    assert writers, f"TensorStore's pool threads not found by name: {sorted(set(names.values()))}"
    assert all(os.getpriority(os.PRIO_PROCESS, tid) == 19 for tid in writers)
    assert _nice() == before  # the training thread keeps its priority
