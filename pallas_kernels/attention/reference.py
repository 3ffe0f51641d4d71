"""Pure-jnp reference of `decode_attention` (few queries into a long KV cache).

Everything in f32 (inputs are upcast), with explicit masks; no tiling, no online softmax.
Mode "tree" takes a per-row [T, T] mask over the new tokens (`tree_visibility`).
Slots at or past a row's length are zeroed BEFORE any arithmetic, so stale or NaN
entries there can reach neither the result nor (through `jax.vjp`) the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("causal", "block", "tree")


def check_args(q, k_cache, v_cache, lengths, k_new, v_new, mode, layer=None, tree_mask=None):
    """Validates shapes and mode; returns (B, T, N, K, R, S, H). Raises ValueError.
    With `layer` the caches are layer-major [L, B, K, S, H], else [B, K, S, H].
    `tree_mask` ([B, T, T], bool or integer) is required for mode "tree" and rejected
    for the other modes."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    if (tree_mask is None) != (mode != "tree"):
        raise ValueError("tree_mask is required for mode='tree'" if tree_mask is None else
                         f"tree_mask is only for mode='tree' (got mode={mode!r})")
    if q.ndim != 4:
        raise ValueError(f"q {q.shape} must be [B, T, N, H]")
    B, T, N, H = q.shape
    lead = 1 if layer is not None else 0
    want = "[L, B, K, S, H] (a layer is given)" if lead else "[B, K, S, H]"
    if (k_cache.ndim != 4 + lead or k_cache.shape[lead] != B
            or k_cache.shape[3 + lead] != H):
        raise ValueError(f"k_cache {k_cache.shape} must be {want} with B={B}, H={H}")
    K, S = k_cache.shape[1 + lead:3 + lead]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {v_cache.shape} must equal k_cache {k_cache.shape}")
    if K == 0 or N % K:
        raise ValueError(f"query heads N={N} must be a multiple of KV heads K={K}")
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths {lengths.shape} {lengths.dtype} must be an integer [B={B}]")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if a.shape != (B, T, K, H):
            raise ValueError(f"{name} {a.shape} must be [B, T, K, H] = {(B, T, K, H)}")
    if tree_mask is not None:
        dt = getattr(tree_mask, "dtype", None)
        if getattr(tree_mask, "shape", None) != (B, T, T) or not (
                dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer)):
            raise ValueError(f"tree_mask {getattr(tree_mask, 'shape', None)} {dt} must be a "
                             f"bool or integer [B, T, T] = {(B, T, T)}")
    return B, T, N, K, N // K, S, H


def tree_visibility(tree_mask):
    """bool[B, T, T] from a mode-"tree" mask: [b, t, u] = tree_mask[b, t, u] != 0, or
    u == t (the diagonal is always visible: a node sees itself whatever the mask holds,
    so every query has at least one key and its softmax is defined)."""
    T = tree_mask.shape[-1]
    return (tree_mask != 0) | jnp.eye(T, dtype=bool)[None]


def decode_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new, *, mode="causal",
                               layer=None, tree_mask=None):
    """Attention of T new queries over a row's cached prefix plus the T new tokens.

    Same arguments and result as `pallas_kernels.attention.decode_attention` (without the
    kernel knobs): q [B, T, N, H], k_cache/v_cache [B, K, S, H] (or [L, B, K, S, H] with
    `layer`, an int or i32 scalar: that layer is sliced out), lengths i32[B] (clipped
    to 0..S), k_new/v_new [B, T, K, H]; mode "causal" (query t sees new tokens 0..t),
    "block" (all T) or "tree" (new token u iff tree_mask[b, t, u] != 0 or u == t;
    tree_mask [B, T, T] bool or integer, only for "tree"). Returns [B, T, N, H] in
    q.dtype; scale 1/sqrt(H); f32 softmax. Raises ValueError on bad shapes or mode.
    """
    B, T, N, K, R, S, H = check_args(q, k_cache, v_cache, lengths, k_new, v_new, mode, layer,
                                     tree_mask)
    if layer is not None:
        k_cache = jax.lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)
        v_cache = jax.lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    f32 = jnp.float32
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)
    valid = jnp.arange(S)[None, :] < lengths[:, None]  # [B, S]
    vm = valid[:, None, :, None]
    kc = jnp.where(vm, k_cache.astype(f32), 0.0)
    vc = jnp.where(vm, v_cache.astype(f32), 0.0)
    qg = q.astype(f32).reshape(B, T, K, R, H)
    scale = 1.0 / np.sqrt(H)
    s_cache = jnp.einsum("BTKRH,BKSH->BKRTS", qg, kc) * scale
    s_cache = jnp.where(valid[:, None, None, None, :], s_cache, -jnp.inf)
    s_new = jnp.einsum("BTKRH,BUKH->BKRTU", qg, k_new.astype(f32)) * scale
    if mode == "causal":
        see = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # [T (query), U (key)]
        s_new = jnp.where(see, s_new, -jnp.inf)
    elif mode == "tree":
        see = tree_visibility(tree_mask)[:, None, None]  # [B, 1, 1, T (query), U (key)]
        s_new = jnp.where(see, s_new, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([s_cache, s_new], axis=-1), axis=-1)
    o = (jnp.einsum("BKRTS,BKSH->BTKRH", probs[..., :S], vc)
         + jnp.einsum("BKRTU,BUKH->BTKRH", probs[..., S:], v_new.astype(f32)))
    return o.reshape(B, T, N, H).astype(q.dtype)
