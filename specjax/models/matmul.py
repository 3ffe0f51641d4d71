"""The projection `linear(x, w)` in HF's [out, in] layout, with XLA:CPU's tuning: few-row
products taken weight-major (padded to a multiple of 8 rows where that is faster),
one-row bf16 products padded to two, and bf16 products under the vmap over drafts taken
weight-major (`DRAFTS_AXIS`, `vmapped_copies`). Other backends take the plain product.
`benchmarks/matmul_rows.py` measures each choice (docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The name of the vmapped axis of K drafts: `specjax.decoding.loop.step.propose_drafts`
# maps `drafter.propose` over it (`jax.vmap(..., axis_name=DRAFTS_AXIS)`).
DRAFTS_AXIS = "specjax_drafts"


def vmapped_copies() -> int:
    """How many copies the caller of `linear` is vmapped over, read while tracing: the
    size of the `DRAFTS_AXIS` axis of the vmap being traced (`propose_drafts`' K
    drafts), 1 outside such a vmap. `linear` cannot see a vmapped axis in x.shape; with
    bf16 weights the row-major product under vmap made XLA:CPU transpose every weight
    once per decoding step (1 ms of a 17 ms step for the demo's eagle3 head at K = 2,
    `benchmarks/profile_step.py --num-drafts 2`), and the weight-major product does not.
    The axis is JAX's own trace state, scoped to the vmapped function and part of jit's
    cache key: nothing here is set or reset."""
    try:
        return int(jax.lax.axis_size(DRAFTS_AXIS))
    except NameError:  # not traced under that vmap ("unbound axis name")
        return 1

# XLA:CPU only: products of up to this many rows (B*T) are taken weight-major (see `linear`).
CPU_WEIGHT_MAJOR_MAX_ROWS = 128


def _weight_major(rows: int) -> bool:
    return 2 <= rows <= CPU_WEIGHT_MAJOR_MAX_ROWS and jax.default_backend() == "cpu"


# XLA:CPU only: weight-major products of this many rows (inclusive range) are padded with
# zero rows to a multiple of 8 (see `_weight_major_width`).
CPU_WEIGHT_MAJOR_PAD_ROWS = (5, 16)


def _weight_major_width(rows: int) -> int:
    """Columns of the weight-major product for `rows` rows: 5-16 rows are padded to a
    multiple of 8, since XLA:CPU's f32 GEMM takes longer for 5-7 columns than for 8, and
    for 9-12 than for 16 (`python benchmarks/matmul_rows.py --rows 6 7 8 9 16`, columns
    "f32" and "f32 unpadded", measures it)."""
    lo, hi = CPU_WEIGHT_MAJOR_PAD_ROWS
    return -(-rows // 8) * 8 if lo <= rows <= hi else rows


def linear(x, w, out_dtype=None):
    """x [..., I] times w [O, I] (HF [out, in] layout) -> [..., O] in x's dtype (or
    `out_dtype`).

    With bf16 weights and f32 activations (`load_model(..., matmul_dtype=jnp.bfloat16)`,
    `make_drafter(..., matmul_dtype=jnp.bfloat16)`) the product takes bf16 inputs and
    accumulates in f32, the TPU convention. On CPU a single row (M = 1) is padded to
    two: XLA:CPU's bf16 path for one row is about 10x slower than for two (`python
    benchmarks/matmul_rows.py`, column "bf16 inputs"); rows of a batch stay independent, so the
    padding changes nothing.

    On CPU, 2 <= M <= `CPU_WEIGHT_MAJOR_MAX_ROWS` rows (a verification of G+1 tokens, a
    drafter's update, a short prefill) are computed weight-major: `w @ x.T` -> [O, M]
    behind an `optimization_barrier`, then transposed. XLA otherwise folds the transpose
    back into the `[M, O]` product, whose small-M GEMM costs about 2.1x a one-row
    product at M = 8; weight-major costs about 1.4x (f32, the demo target's shapes,
    `python benchmarks/matmul_rows.py`); 5-16 rows are padded with zero rows to a
    multiple of 8 first (`_weight_major_width`). One row stays a matrix-vector product and other
    backends keep the plain product: TPU and GPU have no such gap, and the barrier
    would only stop fusion there.
    """
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    if w.dtype == x.dtype:
        if not _weight_major(rows):
            return jnp.einsum("...I,OI->...O", x, w, preferred_element_type=out_dtype)
        flat = x.reshape(rows, x.shape[-1])
        width = _weight_major_width(rows)
        if width > rows:  # zero columns: each output row is still its own dot product
            flat = jnp.pad(flat, ((0, width - rows), (0, 0)))
        y = jnp.einsum("OI,MI->OM", w, flat, preferred_element_type=out_dtype)
        return jax.lax.optimization_barrier(y).T[:rows].reshape(*lead, w.shape[0])
    flat = x.reshape(-1, x.shape[-1]).astype(w.dtype)
    if jax.default_backend() == "cpu" and vmapped_copies() > 1:  # see `vmapped_copies`
        y = jnp.einsum("OI,MI->OM", w, flat, preferred_element_type=jnp.float32)
        return y.T.astype(out_dtype).reshape(*lead, w.shape[0])
    pad = flat.shape[0] == 1 and jax.default_backend() == "cpu"
    if pad:
        flat = jnp.concatenate([flat, flat], axis=0)
    y = jnp.einsum("MI,OI->MO", flat, w, preferred_element_type=jnp.float32)
    return (y[:1] if pad else y).astype(out_dtype).reshape(*lead, w.shape[0])
