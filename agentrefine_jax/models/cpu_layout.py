"""CPU-friendly shapes for the same layer math (`model.cpu_layout`, "auto" by default).

XLA:CPU runs a dot with one batch dimension (or none) through its fast matmul path, and a
dot with several batch dimensions, or with 3-D/4-D operands, through slower loops plus
transposes. So on CPU the projections run as 2-D matmuls on [B*S, D] and attention as
one-batch-dimension dots over [B*KVH, G*S, D] (`attention.attend_flat`). Same products, same
float32 accumulation: the numbers match the default layout to float32 rounding
(tests/test_model_cpu_layout.py).

The layers also run unrolled rather than under `lax.scan` (unless a remat policy is set, which
only a scanned stack honours on XLA:CPU: `ExecutionPlan.scan_full_sequence`): XLA:CPU fuses across
an unrolled stack, and the small models a CPU trains compile quickly either way.

"auto" turns it on exactly when the step's devices are CPUs — the mesh's, so an
ahead-of-time compile for a TPU slice on a CPU host still gets the TPU layout; the choice is made
once, in models/execution.py (`ExecutionPlan.cpu_layout`). Off the TPU
path: a TPU wants the sharded, blocked default layout (sequence sharding, blocked
attention at 8k tokens, scan over many layers); this layout ignores `attention_block_size`.
"""

from __future__ import annotations

import jax


def project_in(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, S, D] x [D, *out] -> [B, S, *out] as one [B*S, D] @ [D, prod(out)] matmul."""
    b, s, d = x.shape
    out = w.shape[1:]
    return (x.reshape(b * s, d) @ w.reshape(d, -1)).reshape(b, s, *out)


def project_out(x: jax.Array, w: jax.Array) -> jax.Array:
    """[B, S, *in] x [*in, D] -> [B, S, D] as one [B*S, prod(in)] @ [prod(in), D] matmul."""
    b, s = x.shape[:2]
    d = w.shape[-1]
    return (x.reshape(b * s, -1) @ w.reshape(-1, d)).reshape(b, s, d)
