"""Few-query attention into a long KV cache (flash decoding), Pallas kernel + jnp reference.

`decode_attention` attends T new query tokens (T small: a verify block or a draft
block) over one layer of specjax's layer-major cache (`specjax.kv_cache.KVCache.k[l]`,
[B, K, S, H], valid slots 0..lengths[b]-1) plus the T tokens' own keys and values,
which are NOT yet in the cache. Two masks over the new tokens: "causal" (query t sees
new tokens 0..t: verification, autoregressive decoding) and "block" (every query sees
all T new tokens: bidirectional block drafters).

`impl="pallas"` runs `kernel.py` (TPU: Mosaic with scalar-prefetched lengths and tile
skipping; GPU: Triton, `backend="triton"`), `impl="reference"` runs `reference.py`.
The Pallas path is wrapped in `jax.custom_vjp` whose backward is `jax.vjp` of the
reference (correct but not memory-efficient: it materialises [B, K, R, T, S] scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import kernel, reference
from pallas_kernels.attention.reference import MODES, decode_attention_reference

BACKENDS = ("tpu", "triton")
DEFAULT_BLOCK_S = 128


def pick_block_s(S: int, block_s: int = DEFAULT_BLOCK_S, backend: str = "tpu") -> int:
    """The S tile the kernel uses.

    tpu: `block_s` if it is < S (then it must be a multiple of 8, the sublane tiling;
    128 or more keeps the score tile lane-dense), else S itself (a full-dim block).
    triton: a power of two >= 16 (Triton's shape rules), at most S rounded up to one.
    Raises ValueError on a non-positive block_s, one that breaks those rules, or an
    unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if block_s <= 0:
        raise ValueError(f"block_s={block_s} must be positive")
    if backend == "tpu":
        if block_s >= S:
            return S
        if block_s % 8:
            raise ValueError(f"block_s={block_s} must be a multiple of 8 (TPU tiling) "
                             f"when smaller than S={S}")
        return block_s
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s={block_s} must be a power of two >= 16 for triton")
    return min(block_s, max(16, int(2 ** np.ceil(np.log2(max(S, 1))))))


def decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, *, mode="causal",
                     block_s=DEFAULT_BLOCK_S, interpret=None, backend="tpu", impl="pallas"):
    """Attention of T new queries over each row's valid cache prefix plus the new tokens.

    Args:
      q: [B, T, N, H] queries (f32 or bf16; T small, e.g. 1..17), already rotated.
      k_cache, v_cache: [B, K, S, H] one layer of the cache, same dtype as q or not (the
        dots run in the cache's dtype pairing as given, accumulating in f32). Slots
        0..lengths[b]-1 are valid; slots at or past lengths[b] are never read into the
        result (they may hold anything, NaN included).
      lengths: i32[B] valid cache length per row; 0 allowed; values are clipped to 0..S.
      k_new, v_new: [B, T, K, H] keys/values of the T query tokens themselves.
      mode: "causal": query t sees cache slots < lengths[b] and new tokens 0..t;
        "block": it sees cache slots < lengths[b] and all T new tokens.
      block_s: S tile of the kernel (see `pick_block_s`); cost follows lengths, not S.
      interpret: Pallas interpret mode: None = on CPU only (jax.default_backend() ==
        "cpu"); True/False; or a `pltpu.InterpretParams` (TPU backend).
      backend: "tpu" (Mosaic, grid over S tiles) or "triton" (GPU, loop over S tiles).
      impl: "pallas" or "reference" (the jnp reference, same result up to rounding).

    GQA: N = K * R; query head n uses KV head n // R. Scale 1/sqrt(H), f32 softmax.

    Returns: [B, T, N, H] in q.dtype.

    Raises: ValueError on bad shapes (N not a multiple of K, k_new not [B, T, K, H], ...),
    an unknown mode, backend or impl, or a bad block_s.

    Differentiable (reverse mode) w.r.t. q, k_cache, v_cache, k_new, v_new: the
    backward pass is the reference's.
    """
    reference.check_args(q, k_cache, v_cache, lengths, k_new, v_new, mode)
    if impl not in ("pallas", "reference"):
        raise ValueError(f"impl={impl!r}: expected 'pallas' or 'reference'")
    S = k_cache.shape[2]
    bs = pick_block_s(S, block_s, backend)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)
    if impl == "reference":
        return decode_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new,
                                          mode=mode)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    fwd_kernel = kernel.KERNELS[backend]

    def ref(q, kc, vc, kn, vn, lengths):
        return decode_attention_reference(q, kc, vc, lengths, kn, vn, mode=mode)

    @jax.custom_vjp
    def attn(q, kc, vc, kn, vn, lengths):
        return fwd_kernel(q, kc, vc, lengths, kn, vn, causal=mode == "causal", block_s=bs,
                          interpret=interpret)

    def attn_fwd(q, kc, vc, kn, vn, lengths):
        return attn(q, kc, vc, kn, vn, lengths), (q, kc, vc, kn, vn, lengths)

    def attn_bwd(res, g):
        *diff, lengths = res
        _, vjp = jax.vjp(lambda *a: ref(*a, lengths), *diff)
        return (*vjp(g), None)

    attn.defvjp(attn_fwd, attn_bwd)
    return attn(q, k_cache, v_cache, k_new, v_new, lengths)


__all__ = ["decode_attention", "decode_attention_reference", "pick_block_s", "MODES",
           "BACKENDS", "DEFAULT_BLOCK_S", "kernel", "reference"]
