"""What a background save may take from the training step on a CPU backend, and what it must not
change: no copy of the state (the step after a save writes into the previous save's buffers, the
trainer's `SpareBufferSaves` strategy)
while the saved bytes stay those of the save; uncompressed and zstd steps restore alike (old zstd
checkpoints included); the manifest is hashed at the lowest CPU priority (SCHED_IDLE, nice 19).
Real Orbax on disk, real donation by JAX, real thread priorities."""

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
from agentrefine_jax.train import save_strategy

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


def _ptrs(tree) -> list[int]:
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]


class _Saves:
    """A save as the trainer's Checkpointing hook makes it: Orbax's, then the strategy is told."""

    def __init__(self, ckpts, strategy) -> None:
        self.ckpts, self.strategy = ckpts, strategy

    def save(self, step, params, opt_state, meta) -> None:
        self.ckpts.save(step, params, opt_state, meta)
        self.strategy.handed((params, opt_state))

    def step_buffers(self):
        return self.strategy.step_buffers()

    def finish(self) -> None:
        self.ckpts.finish()
        self.strategy.release()


def test_the_step_after_a_save_writes_into_the_previous_saves_buffers(tmp_path, monkeypatch) -> None:
    """No copy of the state on a CPU backend: a save hands Orbax the live arrays, and the next
    step writes into buffers `step_buffers()` offers, donated (as StepFns.train_into does) —
    from the second save on, those the save before handed over — leaving the saved ones alone."""
    params, opt_state = _state(3.0)
    monkeypatch.setattr(save_strategy, "SPARE_MIN_BYTES", 0)  # this 2 MiB state counts as big
    strategy = save_strategy.choose(None, (params, opt_state))
    assert isinstance(strategy, save_strategy.SpareBufferSaves)
    c = _Saves(ckpt.TrainCheckpoints(as_path(tmp_path / "ck"), keep=5), strategy)
    bump = lambda p, o: (jax.tree.map(lambda x: x + 1, p), jax.tree.map(lambda x: x * 2, o))  # noqa: E731
    step = jax.jit(bump, donate_argnums=(0, 1))
    into = jax.jit(lambda p, o, spare: bump(p, o), donate_argnums=2, keep_unused=True)
    c.save(1, params, opt_state, META)
    first = (params, opt_state)
    fresh = c.step_buffers()  # nothing handed over before: new buffers of the state's layout
    assert fresh is not None and c.step_buffers() is None  # offered once
    params, opt_state = into(params, opt_state, fresh)
    jax.block_until_ready((params, opt_state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(first))  # Orbax's to read, untouched
    c.save(2, params, opt_state, META)  # waits for save 1's commit: Orbax let go of `first`
    second = (params, opt_state)
    spare = c.step_buffers()
    assert all(a is b for a, b in zip(jax.tree.leaves(spare), jax.tree.leaves(first), strict=True))
    where = _ptrs(spare)
    params, opt_state = into(params, opt_state, spare)
    jax.block_until_ready((params, opt_state))
    # The new state lives in the first save's buffers; the state being saved is untouched.
    assert _ptrs((params, opt_state)) == where
    assert all(x.is_deleted() for x in jax.tree.leaves(first))
    assert not any(x.is_deleted() for x in jax.tree.leaves(second))
    params, opt_state = step(params, opt_state)  # and the step updates it in place again
    assert _ptrs((params, opt_state)) == where
    c.save(3, params, opt_state, META)
    c.save(3 + 1, params, opt_state, META)  # a second save of the same arrays: not their own spare
    assert not set(_ptrs(c.step_buffers())) & set(where)
    c.finish()
    want1 = _state(3.0)
    want2 = bump(*want1)
    want3 = bump(*bump(*want2))
    for saved, want in ((1, want1), (2, want2), (3, want3), (4, want3)):
        ckpt.verify_step(tmp_path / "ck" / str(saved))
        got = _restore(tmp_path / "ck", saved, *want)
        for x, y in zip(
            jax.tree.leaves((got["params"], got["opt_state"])), jax.tree.leaves(want), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_small_states_get_no_spare_and_the_step_still_updates_correctly(tmp_path) -> None:
    """Below SPARE_MIN_BYTES a spare would cost a second compiled step for milliseconds: the run's
    strategy is plain steps, and the plain donating step after a save (JAX declines to donate what
    Orbax reads) leaves the saved bytes those of the save."""
    step = jax.jit(
        lambda p, o: (jax.tree.map(lambda x: x + 1, p), jax.tree.map(lambda x: x * 2, o)),
        donate_argnums=(0, 1),
    )
    params, opt_state = _state(5.0)
    assert isinstance(save_strategy.choose(None, (params, opt_state)), save_strategy.PlainSaves)
    c = ckpt.TrainCheckpoints(as_path(tmp_path / "ck"), keep=5)
    for k in (1, 2):
        c.save(k, params, opt_state, META)
        params, opt_state = step(params, opt_state)
    c.finish()
    got = _restore(tmp_path / "ck", 2, *step(*_state(5.0)))
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.arange(N, dtype=np.float32) * 5 + 1)


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


def _nice() -> tuple[int, int]:
    """(nice value, scheduling policy) of the calling thread."""
    tid = threading.get_native_id()
    return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)


LOWEST = (19, os.SCHED_IDLE)


def test_manifests_are_hashed_at_the_lowest_cpu_priority(tmp_path) -> None:
    before = _nice()
    c = ckpt.TrainCheckpoints(as_path(tmp_path / "ck"), keep=1)

    def inside() -> tuple[int, list[int]]:
        with ThreadPoolExecutor(2) as pool:  # as file_digests hashes several files at once
            return _nice(), list(pool.map(lambda _: _nice(), range(2)))

    assert c._hasher.submit(inside).result() == (LOWEST, [LOWEST, LOWEST])
    assert _nice() == before  # the training thread keeps its priority
    done = []
    t = threading.Thread(target=lambda: (background_priority(), done.append(_nice())))
    t.start()
    t.join(timeout=30)
    assert done == [LOWEST] and _nice() == before
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
    assert all(os.sched_getscheduler(tid) == os.SCHED_IDLE for tid in writers)
    assert _nice() == before  # the training thread keeps its priority
