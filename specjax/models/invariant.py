"""Batch-invariant target forwards: every token row computed by the same program whatever
the number of rows beside it, so a verify forward of G + 1 tokens gives each token the
bits a one-token forward gives it (`LoopConfig(exact=True)`, `decode.py --exact`; the
target's forward takes it as `invariant_rows=ROWS`, an explicit argument like every
other path choice).

Why it is needed: a speculative step verifies G + 1 tokens in one forward, where
autoregressive decoding runs one. The matmul libraries pick their algorithm (and with it
the order of the floating-point reduction) by the number of rows M: on XLA:CPU one row
is a matrix-vector loop and 8 rows a GEMM (`specjax.models.matmul.linear` even takes
them weight-major), on GPUs cuBLAS splits K differently by shape. In f32 the rounding
differences almost never change an argmax; in bf16 they do on a few prompts, and greedy
speculative output then differs from autoregressive output (docs/accelerators.md).

The construction: the token rows of a forward (B x T of them) go through each layer in
tiles of a fixed ROWS rows (zero rows pad the last tile), one tile at a time under
`jax.lax.map`: a layer's pre-attention block (`specjax.models.layers.layer_qkv`: norm,
projections, q/k norms, RoPE), each attention query (`specjax.models.attention`), the
post-attention block (`layer_out`: o_proj, residual, norm, MLP) and the final norm and
LM head (`logits`). Every tile is then the same compiled computation on the same shapes,
in an autoregressive step and in a verify forward, whatever B and T are; what remains is
that a row's result does not depend on where in its tile it sits or on its neighbours,
which holds for kernels that compute every output element with the same reduction order
(XLA:CPU's GEMM and fused loops, checked by tests/models/test_invariant.py; on GPU and
TPU the device round's `exact` step measures it). Shapes matter beyond the matmuls: on
XLA:CPU the fused elementwise code of the default mode rounded differently at different
shapes, which is why whole blocks go through the tiles, not only the products.
Attention is invariant in its structure (new K/V are written into the cache before any
query reads it, and a fully masked chunk is an exact no-op); in the exact mode every
query reads the cache in chunks of CHUNK slots at absolute positions (the loop rounds the
cache capacity up to a multiple of CHUNK: an autoregressive loop and a speculative one
have different capacities, and a softmax over all S slots, or a last chunk clamped to S,
would reduce in an order that depends on S).

The price: an autoregressive step computes a tile of ROWS rows for its B, and a verify
forward ceil(B (G + 1) / ROWS) tiles one after another instead of one product. With
ROWS = 8 on the 2-core CPU the demo's bf16 speculative decoding ran at 0.82x the default
mode's speed (`python benchmarks/exact_mode.py`); on an accelerator an 8-row tile costs
about what one row does (the weights' bytes dominate), so the mode should cost little
there: unmeasured until a device round runs. ROWS = 1 (one row at a time) is the
construction that assumes least, at 0.46x on the CPU (the same benchmark at bb39b3b).

    target(tokens, positions, cache, invariant_rows=invariant.ROWS)  # the exact mode
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Attention chunk of the exact mode: slots [i * CHUNK, (i + 1) * CHUNK), the same chunks
# for every query whatever the cache capacity (a multiple of CHUNK in the exact mode)
CHUNK = 64
# Token rows per tile (`per_row`): every tile has this many rows whatever the batch
ROWS = 8


def per_row(fn, xs, rows: int = ROWS):
    """fn applied to the rows of xs (an array [M, ...] or a pytree of them) in tiles of
    `rows` rows: xs padded with zero rows to a multiple of `rows`, then jax.lax.map of fn
    over [rows, ...] tiles (every tile the same computation on the same shapes), the
    padding dropped again -> [M, ...]. fn must treat its leading axis as independent
    rows (a batch)."""
    M = jax.tree.leaves(xs)[0].shape[0]
    Mp = -(-M // rows) * rows

    def tiles(a):
        a = jnp.pad(a, [(0, Mp - M)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(Mp // rows, rows, *a.shape[1:])

    out = jax.lax.map(fn, jax.tree.map(tiles, xs))
    return jax.tree.map(lambda a: a.reshape(Mp, *a.shape[2:])[:M], out)
