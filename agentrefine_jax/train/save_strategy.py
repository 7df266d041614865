"""How the training step and the background checkpoint saves share the state's memory: one
strategy, chosen once per run (`choose`), owning the step it wraps and any spare buffers.

- `PlainSaves`: the step donates and updates its own buffers. Right for accelerators (a save
  copies device memory to the host first, so the step may reuse it at once) and for small states.
- `SpareBufferSaves`: for a CPU backend and a big state. Orbax's "device to host" transfer of a
  CPU array is a zero-copy view of the live buffer, which JAX will then not donate: the step after
  a save would fault its whole new state into fresh memory, and copying the state before the save
  blocks the loop. Instead the save hands Orbax the live arrays, and the step after it writes into
  spare buffers (`StepFns.train_into`, the spare donated): the arrays the save before handed over
  (Orbax let go of them at their commit, which every save first waits for), new ones after the
  first save. From the second save on no byte is copied or freshly faulted; two states' worth of
  memory is held, as with a copy. Measured figures: docs/scale.md, "What a checkpoint save costs".
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from agentrefine_jax.train.step import StepFns

# Below this a save's state is left to the next step's fresh allocation: a spare would cost a
# second compiled train program (seconds) to save milliseconds of page faults.
SPARE_MIN_BYTES = 64 << 20


class SaveStrategy(Protocol):
    def step(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
        """One train step: (params, opt_state, metrics)."""
        ...

    def handed(self, saved: Any) -> None:
        """A save just handed Orbax `saved` (trained params, opt_state): Orbax reads it from now on."""
        ...

    def release(self) -> None:
        """The run is done saving: drop anything held for the next step."""
        ...


class PlainSaves:
    """The step updates its own (donated) buffers; a save changes nothing about it."""

    def __init__(self, fns: StepFns) -> None:
        self._fns = fns

    def step(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
        return self._fns.train(params, opt_state, batch)

    def handed(self, saved: Any) -> None:
        pass

    def release(self) -> None:
        pass


def _fresh_like(tree: Any) -> Any:
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t), out_shardings=shardings)(tree)


def _same_layout(a: Any, b: Any) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        (x.shape, x.dtype, x.sharding) == (y.shape, y.dtype, y.sharding)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


class SpareBufferSaves:
    """The step after a save writes into spare buffers, leaving the arrays Orbax reads untouched.

    `fns` may be None for a caller that runs its own step over `step_buffers()` (tests)."""

    def __init__(self, fns: StepFns | None) -> None:
        self._fns = fns
        self._handed: Any = None  # what the newest save handed Orbax
        self._spare: Any = None  # for the next step to write into; see `step_buffers`

    def step(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
        assert self._fns is not None
        return self._fns.train_into(params, opt_state, batch, self.step_buffers())

    def handed(self, saved: Any) -> None:
        """Note what Orbax now reads, and offer the previous save's arrays as the next step's spare."""
        previous, self._handed = self._handed, saved
        live = {id(x) for x in jax.tree.leaves(saved)}  # two saves with no step between: the same arrays
        usable = (
            previous is not None
            and _same_layout(previous, saved)
            and not any(id(x) in live or x.is_deleted() for x in jax.tree.leaves(previous))
        )
        # None usable (the first save): new buffers, which the step would otherwise have taken
        # itself; so the step after every save leaves the saved arrays alone, whatever the timing.
        self._spare = previous if usable else _fresh_like(saved)

    def step_buffers(self) -> Any:
        """Where the next step writes its (trained params, opt_state) — a tree of that layout to
        donate (`StepFns.train_into`) — or None: the step may update its own buffers. Not None
        only right after a save; taken once."""
        spare, self._spare = self._spare, None
        return spare

    def release(self) -> None:
        self._handed = self._spare = None  # memory the size of the state, needed only between saves


def _on_cpu(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(
        isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set) for x in leaves
    )


def choose(fns: StepFns, saved: Any) -> SaveStrategy:
    """The run's strategy, from the state a save hands over (trained params, opt_state): spare
    buffers on a CPU backend for states of at least SPARE_MIN_BYTES, plain steps otherwise."""
    nbytes = sum(x.nbytes for x in jax.tree.leaves(saved))
    if _on_cpu(saved) and nbytes >= SPARE_MIN_BYTES:
        return SpareBufferSaves(fns)
    return PlainSaves(fns)
