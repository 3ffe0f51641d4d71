"""Pure-jnp reference of `packed_attention` (queries with per-query key limits).

Everything in f32 (inputs are upcast) with explicit masks and one plain softmax per
query: no tiling, no online softmax. Key/value slots that no query of a row sees
(s >= max_t limit[b, t]) are zeroed BEFORE any arithmetic, so NaN there can reach
neither the result nor (through autodiff) the gradients; a query that sees nothing
gets o = 0 and lse = -inf, with zero (not NaN) gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = (jnp.float32, jnp.bfloat16)


def check_args(q, k, v, limit):
    """Validates shapes and dtypes; returns (B, T, N, K, R, S, H). Raises ValueError."""
    if q.ndim != 4:
        raise ValueError(f"q {q.shape} must be [B, T, N, H]")
    B, T, N, H = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"k {k.shape} must be [B, K, S, H] with B={B}, H={H}")
    K, S = k.shape[1:3]
    if v.shape != k.shape:
        raise ValueError(f"v {v.shape} must equal k {k.shape}")
    if min(B, T, N, H, K, S) == 0:
        raise ValueError(f"empty axis: q {q.shape}, k {k.shape}")
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} must be one "
                         f"dtype, float32 or bfloat16")
    if tuple(limit.shape) != (B, T) or not jnp.issubdtype(limit.dtype, jnp.integer):
        raise ValueError(f"limit {limit.shape} {limit.dtype} must be an integer "
                         f"[B, T] = {(B, T)}")
    return B, T, N, K, N // K, S, H


def packed_attention_reference(q, k, v, limit):
    """Attention of each query over the key slots below its own limit.

    Same arguments and results as `pallas_kernels.attention.packed.packed_attention`
    (without the kernel knobs): q [B, T, N, H], k/v [B, K, S, H] (GQA: head n uses KV
    head n // R, R = N/K), limit i32[B, T] (clipped to 0..S; query t sees slots
    s < limit[b, t]). Returns (o [B, T, N, H] in q.dtype, lse f32[B, T, N]); scale
    1/sqrt(H), f32 softmax; a query that sees nothing gets o = 0, lse = -inf.
    Differentiable by ordinary autodiff (NaN-free). Raises ValueError on bad arguments.
    """
    B, T, N, K, R, S, H = check_args(q, k, v, limit)
    f32 = jnp.float32
    limit = jnp.clip(limit.astype(jnp.int32), 0, S)
    slots = jnp.arange(S, dtype=jnp.int32)
    see = slots[None, None, :] < limit[:, :, None]  # [B, T, S]
    live = (slots[None, :] < limit.max(axis=1)[:, None])[:, None, :, None]  # [B, 1, S, 1]
    kz = jnp.where(live, k.astype(f32), 0.0)
    vz = jnp.where(live, v.astype(f32), 0.0)
    qg = q.astype(f32).reshape(B, T, K, R, H)
    s = jnp.einsum("BTKRH,BKSH->BTKRS", qg, kz) / np.sqrt(H)
    s = jnp.where(see[:, :, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # cancels in o and lse
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    seen = l > 0.0
    l_use = jnp.where(seen, l, 1.0)
    o = jnp.einsum("BTKRS,BKSH->BTKRH", p, vz) / l_use
    lse = jnp.where(seen, m + jnp.log(l_use), -jnp.inf)
    return o.reshape(B, T, N, H).astype(q.dtype), lse.reshape(B, T, N)
