"""Few-query attention into a long KV cache (flash decoding), Pallas kernel + jnp reference.

`decode_attention` attends T new query tokens (T small: a verify block or a draft
block) over one layer of specjax's layer-major cache (`specjax.models.kv_cache.KVCache.k[l]`,
[B, K, S, H], valid slots 0..lengths[b]-1; or the whole [L, B, K, S, H] cache plus a
`layer` index, read in place) plus the T tokens' own keys and values, which are NOT
read from the cache (slots >= lengths[b] are never read, so a caller may already have
written them there). Three masks over the new tokens: "causal" (query t sees new tokens
0..t: verification, autoregressive decoding), "block" (every query sees all T new
tokens: bidirectional block drafters) and "tree" (the T new tokens are the nodes of a
draft tree; query t sees new token u iff `tree_mask[b, t, u]`, its ancestors and
itself: draft-tree verification). `specjax.models.model.Transformer` calls it (causal,
layer-major) for its decode and verify forwards when `LoopConfig.kernels` is "pallas".

`impl="pallas"` runs `kernel.py` (TPU: Mosaic with scalar-prefetched lengths and tile
skipping; GPU: Triton, `backend="triton"`), `impl="reference"` runs `reference.py`.
`num_splits` (split-S, flash-decoding) cuts the S axis into chunks run by independent
programs whose partial softmax states are merged by log-sum-exp (`pick_num_splits`).
The Pallas path is wrapped in `jax.custom_vjp` whose backward is `jax.vjp` of the
reference (correct but not memory-efficient: it materialises [B, K, R, T, S] scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import kernel, reference
from pallas_kernels.attention.packed import packed_attention, packed_attention_reference
from pallas_kernels.attention.reference import (
    MODES,
    decode_attention_reference,
    tree_visibility,
)

BACKENDS = ("tpu", "triton")
DEFAULT_BLOCK_S = 128
# `pick_num_splits`: split S only when B*K < SPLIT_BELOW_PROGRAMS, into at most MAX_SPLITS
# chunks of at least MIN_TILES_PER_SPLIT tiles.
SPLIT_BELOW_PROGRAMS = 8
MAX_SPLITS = 8
MIN_TILES_PER_SPLIT = 4
# backend "triton": split until B*K*P reaches the streaming multiprocessors of an H100 /
# H200 (132), at most 32 splits, so that a small batch still occupies every SM
# (`scripts/device_round.sh` times both rules: step attention_time).
GPU_PROGRAMS = 132
MAX_SPLITS_GPU = 32


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


def pick_num_splits(B: int, K: int, S: int, block_s: int, backend: str = "tpu") -> int:
    """The number of S splits `decode_attention(num_splits=None)` asks for.

    With nS = cdiv(S, block_s) tiles (block_s the tile `pick_block_s` returned) and at
    most nS // MIN_TILES_PER_SPLIT splits (every split gets at least 4 tiles of the
    longest possible row):
    tpu: 1 when B*K >= SPLIT_BELOW_PROGRAMS (8), i.e. the (row, KV head) programs alone
      fill the chip's cores; else min(MAX_SPLITS, max(1, nS // 4)) = min(8, ...).
    triton: 1 when B*K >= GPU_PROGRAMS (132, the SMs of an H100 / H200); else
      min(MAX_SPLITS_GPU, max(1, nS // 4), cdiv(132, B*K)), enough programs to occupy
      every SM.
    The rule looks at the capacity S, not the lengths (static shapes only); the kernels
    then skip the tiles past each row's length whatever P is.
    """
    nS = -(-S // block_s)
    most = max(1, nS // MIN_TILES_PER_SPLIT)
    if backend == "triton":
        if B * K >= GPU_PROGRAMS:
            return 1
        return min(MAX_SPLITS_GPU, most, -(-GPU_PROGRAMS // (B * K)))
    if B * K >= SPLIT_BELOW_PROGRAMS:
        return 1
    return min(MAX_SPLITS, most)


def decode_attention(q, k_cache, v_cache, lengths, k_new, v_new, *, mode="causal",
                     block_s=DEFAULT_BLOCK_S, interpret=None, backend="tpu", impl="pallas",
                     layer=None, num_splits=None, tree_mask=None):
    """Attention of T new queries over each row's valid cache prefix plus the new tokens.

    Args:
      q: [B, T, N, H] queries (f32 or bf16; T small, e.g. 1..17), already rotated.
      k_cache, v_cache: [B, K, S, H] one layer of the cache, same dtype as q or not (the
        dots run in the cache's dtype pairing as given, accumulating in f32). Slots
        0..lengths[b]-1 are valid; slots at or past lengths[b] are never read into the
        result (they may hold anything, NaN included). Or, with `layer`, the whole
        layer-major cache [L, B, K, S, H] (`specjax.models.kv_cache.KVCache.k`).
      lengths: i32[B] valid cache length per row; 0 allowed; values are clipped to 0..S.
      k_new, v_new: [B, T, K, H] keys/values of the T query tokens themselves.
      mode: "causal": query t sees cache slots < lengths[b] and new tokens 0..t;
        "block": it sees cache slots < lengths[b] and all T new tokens;
        "tree": it sees cache slots < lengths[b] and new token u iff tree_mask[b, t, u]
        (a draft tree's ancestor mask). "causal" is "tree" with a lower-triangular mask,
        "block" is "tree" with an all-true one (the results are identical).
      block_s: S tile of the kernel (see `pick_block_s`); cost follows lengths, not S.
      interpret: Pallas interpret mode: None = on CPU only (jax.default_backend() ==
        "cpu"); True/False; or a `pltpu.InterpretParams` (TPU backend).
      backend: "tpu" (Mosaic, grid over S tiles) or "triton" (GPU, loop over S tiles).
      impl: "pallas" or "reference" (the jnp reference, same result up to rounding).
      layer: None, or an int / i32 scalar (traced is fine, e.g. under `lax.scan` over
        layers) naming the layer of a [L, B, K, S, H] cache to attend over: the kernels
        read that layer's tiles in place (scalar prefetch on TPU, pointer offsets in
        Triton), so no copy of the layer is made.
      num_splits: split-S (flash-decoding): None picks `pick_num_splits(B, K, S, tile,
        backend)` (tpu: 1 unless B*K < 8, then min(8, max(1, cdiv(S, tile) // 4)); triton:
        enough splits for B*K*P to reach 132 programs, at most 32); an int P >= 1 cuts
        the cdiv(S, tile) S tiles into chunks of cdiv(nS, P) whole tiles run by
        independent programs (at most P of them: cdiv(nS, chunk), none past S), each
        writing partial (m, l, acc) f32 [B, K, P, T*R, 1 | H] that a jnp log-sum-exp
        combine merges and normalises. P = 1 is the single-pass kernel (no partials).
        The result is the same up to f32 rounding for every P. Ignored by
        impl="reference" (but still validated).
      tree_mask: mode "tree" only (required there, a ValueError in the other modes):
        [B, T, T] bool, or an integer array read as != 0; [b, t, u] = query t sees new
        token u (node u is node t or one of its ancestors, e.g.
        `specjax.core.tree.ancestor_mask`). The diagonal is always visible whatever
        the mask holds (a node sees itself; so every query has a key, even with
        lengths[b] = 0, and unused nodes whose rows are all false stay finite). Per row,
        not per head: the kernels read it as one i32 [T*R, T] block per row (the folded
        query rows) when they fold the new tokens in. Not differentiated.

    GQA: N = K * R; query head n uses KV head n // R. Scale 1/sqrt(H), f32 softmax.

    Returns: [B, T, N, H] in q.dtype.

    Raises: ValueError on bad shapes (N not a multiple of K, k_new not [B, T, K, H],
    tree_mask not a bool / integer [B, T, T], ...), an unknown mode, backend or impl,
    tree_mask missing in mode "tree" or given in another mode, a bad block_s, or
    num_splits not None and not an int >= 1.

    Differentiable (reverse mode) w.r.t. q, k_cache, v_cache, k_new, v_new: the
    backward pass is the reference's.
    """
    reference.check_args(q, k_cache, v_cache, lengths, k_new, v_new, mode, layer, tree_mask)
    if impl not in ("pallas", "reference"):
        raise ValueError(f"impl={impl!r}: expected 'pallas' or 'reference'")
    S = k_cache.shape[-2]
    bs = pick_block_s(S, block_s, backend)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)
    if num_splits is None:
        num_splits = pick_num_splits(q.shape[0], k_cache.shape[-3], S, bs, backend)
    kernel.split_tiles(-(-S // bs), num_splits)  # raises on a bad num_splits
    if impl == "reference":
        return decode_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new,
                                          mode=mode, layer=layer, tree_mask=tree_mask)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    fwd_kernel = kernel.KERNELS[backend]
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    # bool [B, T, T] with the diagonal set (tree mode), else None: causal and block calls
    # build the kernels they always did, with no mask input.
    see = None if tree_mask is None else tree_visibility(jnp.asarray(tree_mask))

    def ref(q, kc, vc, kn, vn, lengths, layer, see):
        return decode_attention_reference(q, kc, vc, lengths, kn, vn, mode=mode, layer=layer,
                                          tree_mask=see)

    @jax.custom_vjp
    def attn(q, kc, vc, kn, vn, lengths, layer, see):
        return fwd_kernel(q, kc, vc, lengths, kn, vn, causal=mode == "causal", block_s=bs,
                          interpret=interpret, layer=layer, num_splits=num_splits,
                          tree_mask=see)

    def attn_fwd(q, kc, vc, kn, vn, lengths, layer, see):
        return (attn(q, kc, vc, kn, vn, lengths, layer, see),
                (q, kc, vc, kn, vn, lengths, layer, see))

    def attn_bwd(res, g):
        *diff, lengths, layer, see = res
        _, vjp = jax.vjp(lambda *a: ref(*a, lengths, layer, see), *diff)
        return (*vjp(g), None, None, None)

    attn.defvjp(attn_fwd, attn_bwd)
    return attn(q, k_cache, v_cache, k_new, v_new, lengths, layer, see)


__all__ = ["decode_attention", "decode_attention_reference", "packed_attention",
           "packed_attention_reference", "pick_block_s",
           "pick_num_splits", "tree_visibility", "MODES", "BACKENDS", "DEFAULT_BLOCK_S", "kernel", "reference"]
