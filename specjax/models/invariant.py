"""Batch-invariant target forwards: every token row computed by the same program whatever
the number of rows beside it, so a verify forward of G + 1 tokens gives each token the
bits a one-token forward gives it (`LoopConfig(exact=True)`, `decode.py --exact`).

Why it is needed: a speculative step verifies G + 1 tokens in one forward, where
autoregressive decoding runs one. The matmul libraries pick their algorithm (and with it
the order of the floating-point reduction) by the number of rows M: on XLA:CPU one row
is a matrix-vector loop and 8 rows a GEMM (`specjax.models.matmul.linear` even takes
them weight-major), on GPUs cuBLAS splits K differently by shape. In f32 the rounding
differences almost never change an argmax; in bf16 they do on a few prompts, and greedy
speculative output then differs from autoregressive output (docs/accelerators.md).

The construction (mode "rows"): every operation that reduces within a token row, the
projections (`linear`), RMSNorm and attention, runs under `jax.lax.map` over the rows,
one row at a time, through the one-row path. Each row is then the same compiled
computation, on the same shapes, in an autoregressive step and in a verify forward,
whatever B and T are. Elementwise operations (RoPE, SwiGLU's product, residual adds)
and gathers are the same per element at any shape. Attention is already invariant in
its structure (`specjax.models.attention`: new K/V are written into the cache before any
query reads it, and a fully masked chunk is an exact no-op); in the exact mode every
query row reads the cache in chunks of CHUNK slots at absolute positions (the loop
rounds the cache capacity up to a multiple of CHUNK: an autoregressive loop and a
speculative one have different capacities, and a softmax over all S slots, or a last
chunk clamped to S, would reduce in an order that depends on S), and its two dots are
per row.

The price is the rows' parallelism: M rows cost M one-row products instead of one M-row
product, so on an accelerator a verify forward reads the weights G + 1 times. The mode is
opt-in, for users who need bit-identical output more than speed; a Pallas matmul with
fixed tiles would keep the rows' parallelism (see docs/accelerators.md for the state of
that work).

    with batch_invariant():
        ...  # trace the target's forward here
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_ACTIVE = contextvars.ContextVar("specjax_batch_invariant", default=False)
# Attention chunk of the exact mode: slots [i * CHUNK, (i + 1) * CHUNK), the same chunks
# for every query whatever the cache capacity (a multiple of CHUNK in the exact mode)
CHUNK = 64


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """While tracing inside this block, the target's row reductions run one row at a time
    (see the module docstring). A trace-time switch: it is part of what the caller's jit
    cache keys on only through the caller's static arguments (`LoopConfig.exact`)."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """True inside `batch_invariant()` (while tracing)."""
    return _ACTIVE.get()


def per_row(fn, xs):
    """fn applied to each row of xs (an array [M, ...] or a pytree of them) alone:
    jax.lax.map of fn(row i with a leading axis of 1), that axis dropped again (fn sees
    one row, with the switch off, so its own one-row path runs) -> [M, ...]."""
    def one(row):
        with batch_invariant(False):
            out = fn(jax.tree.map(lambda a: a[None], row))
        return jax.tree.map(lambda a: a[0], out)

    return jax.lax.map(one, xs)


