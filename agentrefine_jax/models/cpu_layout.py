"""CPU-friendly shapes for the same layer math (`model.cpu_layout`, "auto" by default).

XLA:CPU runs a dot with one batch dimension (or none) through its fast matmul path, and a
dot with several batch dimensions, or with 3-D/4-D operands, through slower loops plus
transposes. So on CPU the projections run as 2-D matmuls on [B*S, D] and attention as
one-batch-dimension dots over [B*KVH, G*S, D] (`attention.attend_flat`). Same products, same
float32 accumulation: the numbers match the default layout to float32 rounding
(tests/test_model_cpu_layout.py).

The layers run unrolled rather than under `lax.scan` only with `model.remat_policy=none`; a remat
policy, which only a scanned stack honours on XLA:CPU, scans them (`ExecutionPlan.scan_full_sequence`),
and the default ("auto") is the policy "dots_no_batch" here: on SmolLM2's train step the unrolled stack kept
every layer's weight copy and elementwise intermediates until the backward pass (docs/scale.md,
"CPU memory of a real model").

"auto" turns it on exactly when the step's devices are CPUs — the mesh's, so an
ahead-of-time compile for a TPU slice on a CPU host still gets the TPU layout; the choice is made
once, in models/execution.py (`ExecutionPlan.cpu_layout`). Off the TPU
path: a TPU wants the sharded, blocked default layout (sequence sharding, blocked
attention at 8k tokens, scan over many layers); this layout ignores `attention_block_size`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def project_in(x: jax.Array, w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """[B, S, D] x [D, *out] -> [B, S, *out] as one [B*S, D] @ [D, prod(out)] matmul."""
    b, s, d = x.shape
    out = w.shape[1:]
    y = jnp.matmul(x.reshape(b * s, d), w.reshape(d, -1), preferred_element_type=preferred_element_type)
    return y.reshape(b, s, *out)


def project_out(x: jax.Array, w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """[B, S, *in] x [*in, D] -> [B, S, D] as one [B*S, prod(in)] @ [prod(in), D] matmul."""
    b, s = x.shape[:2]
    d = w.shape[-1]
    y = jnp.matmul(x.reshape(b * s, -1), w.reshape(-1, d), preferred_element_type=preferred_element_type)
    return y.reshape(b, s, d)


def layer_views(weights: Mapping[str, Any], num_layers: int) -> tuple[dict[str, Any], ...] | None:
    """Each layer's weights as arrays of their own that share memory with the stacked `weights`
    ({name: [layers, ...] array or pytree of such}), or None where that cannot be had for free.

    Why: XLA:CPU materialises every slice of a parameter it reads, so a program that unrolls the
    layers over stacked weights copies each layer's slice out before its matmuls -- in a decode loop
    every weight, every step (SmolLM2-135M: 538 MB copied per token, and the first step of each call
    page-faults the fresh copies in). A contiguous slice of a single-device CPU buffer is a host
    view (numpy, no copy) that `device_put` adopts without copying, so passing these per-layer
    arrays to the program costs no memory and no copy. The views keep the stacked buffers alive.
    """
    leaves, treedef = jax.tree.flatten(dict(weights))
    views: list[list[jax.Array]] = []
    for leaf in leaves:
        if not isinstance(leaf, jax.Array) or leaf.ndim == 0 or leaf.shape[0] != num_layers:
            return None
        devices = leaf.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return None
        host = np.asarray(leaf)  # zero-copy on CPU: a view of the device buffer
        per_layer = [jax.device_put(host[i], next(iter(devices))) for i in range(num_layers)]
        # device_put copies a view it cannot adopt (a misaligned slice): then keep the stacked path
        # rather than holding a second copy of the weights.
        if any(v.unsafe_buffer_pointer() != host[i].ctypes.data for i, v in enumerate(per_layer)):
            return None
        views.append(per_layer)
    return tuple(jax.tree.unflatten(treedef, [v[i] for v in views]) for i in range(num_layers))
