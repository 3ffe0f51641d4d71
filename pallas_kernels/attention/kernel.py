"""Pallas kernels for few-query attention into a long KV cache (flash decoding).

Layout (both backends): the R = N/K query heads of a KV head are folded into rows, so
per (row b, KV head k) the queries are one [T*R, H] block; row i = t*R + r is query
token t = i // R of head k*R + r. New token u is visible to row i in causal mode iff
u <= t, i.e. u*R <= i (no integer division in the kernel).

The cache comes in layer-major, [L, B, K, S, H] (specjax's `KVCache.k`), with the layer
to read as an i32 scalar (static or traced, e.g. under `lax.scan` over layers): the
kernels address that layer's tiles in place, so no [B, K, S, H] copy of the layer is
made before the call.

TPU (`backend="tpu"`, Mosaic): grid (B, K, nS) with nS = cdiv(S, block_s). The S axis
is "arbitrary" and folds tiles into an online softmax (running max m, sum l,
accumulator o, f32 VMEM scratch). Per-row valid lengths and the layer come in by
scalar prefetch:
tiles at or past lengths[b] are skipped with `pl.when`, and the K/V index_map clamps
the tile index to the row's last needed tile, so a skipped step re-uses the resident
block and issues no DMA: cost follows the context, not the capacity. The last grid
step folds the T new tokens in and writes o / l. Block shapes obey the (8, 128) rule:
K/V blocks are [block_s, H] (block_s a multiple of 8, H the full dim), queries and
outputs [T*R, H] and the new tokens [Tn, H] (T padded to a multiple of 8) are full dims.

GPU (`backend="triton"`): Triton runs grid points in parallel, so there is no resident
accumulator across grid steps: the grid is (B, K) and each program loops over its row's
valid tiles (a dynamic trip count of cdiv(lengths[b], block_s)), loading them from the
whole cache (viewed as [L*B*K, S, H], left in HBM: `pl.ANY`) at row (layer*B + b)*K + k
with masked loads. Triton wants
power-of-two block shapes with dots of at least 16 x 16, so the wrapper pads the query
rows and the new tokens (padded new tokens are masked out; padded rows are dropped).

Within a tile, lanes at or past lengths[b] (including the padding of a partial last
tile when S is not a multiple of block_s) are masked in the scores AND zeroed in V, so
NaN or stale values there never reach the result (0 * NaN would).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

NEG_INF = float("-inf")


def _fold_q(q, K, R):
    """[B, T, N, H] -> [B, K, T*R, H], row t*R + r is head k*R + r of token t."""
    B, T, N, H = q.shape
    return q.reshape(B, T, K, R, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, H)


def _unfold_o(o, T, R):
    """Inverse of `_fold_q`: [B, K, T*R, H] -> [B, T, N, H]."""
    B, K, _, H = o.shape
    return o.reshape(B, K, T, R, H).transpose(0, 2, 1, 3, 4).reshape(B, T, K * R, H)


def _dot_nt(a, b):
    """a [M, H] . b [N, H]^T -> f32 [M, N], in the inputs' dtype (MXU/tensor cores)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    """a [M, N] . b [N, H] -> f32 [M, H]."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _online_step(m, l, acc, s, v):
    """One online-softmax fold: scores s f32 [M, n] (masked entries -inf, at least one
    finite per row or m already finite), values v [n, H] (masked rows zero)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)  # m = -inf (nothing seen yet) -> 0
    p = jnp.exp(s - m_new)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc_new = alpha * acc + _dot_nn(p.astype(v.dtype), v)
    return m_new, l_new, acc_new


def _tile_scores(q, k, v, start, length, scale):
    """Scores of a cache tile with lanes >= length masked, and V with those rows zeroed."""
    n = k.shape[0]
    s = _dot_nt(q, k) * scale
    cols = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(cols < length, s, NEG_INF)
    rows = start + jax.lax.broadcasted_iota(jnp.int32, (n, v.shape[1]), 0)
    v = jnp.where(rows < length, v, jnp.zeros_like(v))
    return s, v


def _new_scores(q, kn, scale, causal, R, T_valid):
    """Scores of the new tokens [M, Tn]: causal (u*R <= row) and/or padded (u >= T_valid)."""
    s = _dot_nt(q, kn) * scale
    u = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    keep = u < T_valid
    if causal:
        keep = keep & (u * R <= jax.lax.broadcasted_iota(jnp.int32, s.shape, 0))
    return jnp.where(keep, s, NEG_INF)


# ----------------------------------------------------------------------------- TPU


def kv_tile_index(j, length, block_s):
    """The S tile that grid step j loads: j itself while j < cdiv(length, block_s), else
    the row's last needed tile (tile 0 when length is 0). A repeated block index makes the
    Pallas pipeline skip the copy, so steps past the length cost no HBM traffic."""
    # lax.div, not //: jnp's floor division lowers through `sign`, which Mosaic lowers
    # only after querying the TPU generation (so exporting from a CPU host fails).
    last = jnp.maximum(jax.lax.div(length + block_s - 1, block_s) - 1, 0)
    return jnp.minimum(j, last)


def _layer_major(k_cache, v_cache, layer):
    """([L, B, K, S, H] caches, i32 layer): a [B, K, S, H] cache becomes L = 1, layer 0."""
    if k_cache.ndim == 4:
        return k_cache[None], v_cache[None], jnp.zeros((), jnp.int32)
    return k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(())


def decode_attention_tpu(q, k_cache, v_cache, lengths, k_new, v_new, *, causal, block_s,
                         interpret=False, count_tiles=False, layer=None):
    """Grid (B, K, nS) kernel with scalar-prefetched lengths and layer (see the module doc).

    Arguments as `decode_attention` (validated there): k_cache, v_cache [B, K, S, H], or
    [L, B, K, S, H] with `layer` (i32 scalar) naming the one to read; lengths already
    clipped to 0..S and block_s a multiple of 8 or equal to S. count_tiles=True (tests)
    also returns i32[B, K], the number of cache tiles each program actually computed."""
    from jax.experimental.pallas import tpu as pltpu

    B, T, N, H = q.shape
    k_cache, v_cache, layer = _layer_major(k_cache, v_cache, layer)
    _, _, K, S, _ = k_cache.shape
    R = N // K
    M = T * R
    nS = pl.cdiv(S, block_s)
    scale = 1.0 / float(np.sqrt(H))
    qf = _fold_q(q, K, R)  # [B, K, M, H]
    # New tokens padded to a multiple of 8 rows (masked out in `_new_scores`, V zero):
    # with T = 1 a bf16 [M, H] x [1, H]^T dot fails Mosaic's verifier (jax 0.10.2).
    Tn = -(-T // 8) * 8
    pad_t = ((0, 0), (0, 0), (0, Tn - T), (0, 0))
    kn = jnp.pad(k_new.transpose(0, 2, 1, 3), pad_t)  # [B, K, Tn, H]
    vn = jnp.pad(v_new.transpose(0, 2, 1, 3), pad_t)

    def kv_index(b, h, j, len_ref, layer_ref):
        return layer_ref[0], b, h, kv_tile_index(j, len_ref[b], block_s), 0

    def fixed(b, h, j, len_ref, layer_ref):  # q, new tokens, output: one block per (b, h)
        return b, h, 0, 0

    def kernel(len_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref, *rest):
        cnt_ref, (m_sc, l_sc, acc_sc) = (rest[0], rest[1:]) if count_tiles else (None, rest)
        b, j = pl.program_id(0), pl.program_id(2)
        length = len_ref[b]

        @pl.when(j == 0)
        def _init():
            m_sc[...] = jnp.full((M, 1), NEG_INF, jnp.float32)
            l_sc[...] = jnp.zeros((M, 1), jnp.float32)
            acc_sc[...] = jnp.zeros((M, H), jnp.float32)
            if cnt_ref is not None:
                cnt_ref[...] = jnp.zeros_like(cnt_ref)

        @pl.when(j * block_s < length)
        def _tile():
            s, v = _tile_scores(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], j * block_s,
                                length, scale)
            m, l, acc = _online_step(m_sc[...], l_sc[...], acc_sc[...], s, v)
            m_sc[...], l_sc[...], acc_sc[...] = m, l, acc
            if cnt_ref is not None:
                cnt_ref[...] = cnt_ref[...] + 1

        @pl.when(j == nS - 1)
        def _finish():
            s = _new_scores(q_ref[0, 0], kn_ref[0, 0], scale, causal, R, T)
            m, l, acc = _online_step(m_sc[...], l_sc[...], acc_sc[...], s, vn_ref[0, 0])
            o_ref[0, 0] = (acc / l).astype(o_ref.dtype)

    out_specs = pl.BlockSpec((1, 1, M, H), fixed)
    out_shape = jax.ShapeDtypeStruct((B, K, M, H), q.dtype)
    if count_tiles:
        out_specs = (out_specs, pl.BlockSpec((1, 1, 1, 1), fixed))
        out_shape = (out_shape, jax.ShapeDtypeStruct((B, K, 1, 1), jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, K, nS),
        in_specs=[
            pl.BlockSpec((1, 1, M, H), fixed),
            pl.BlockSpec((None, 1, 1, block_s, H), kv_index),  # layer axis squeezed
            pl.BlockSpec((None, 1, 1, block_s, H), kv_index),
            pl.BlockSpec((1, 1, Tn, H), fixed),
            pl.BlockSpec((1, 1, Tn, H), fixed),
        ],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((M, 1), jnp.float32), pltpu.VMEM((M, 1), jnp.float32),
                        pltpu.VMEM((M, H), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention",
    )(lengths, layer.reshape(1), qf, k_cache, v_cache, kn, vn)
    if count_tiles:
        return _unfold_o(out[0], T, R), out[1][:, :, 0, 0]
    return _unfold_o(out, T, R)


# ----------------------------------------------------------------------------- GPU (Triton)


def _pow2_at_least(n, lo):
    return max(lo, int(pl.next_power_of_2(n)))


def decode_attention_triton(q, k_cache, v_cache, lengths, k_new, v_new, *, causal, block_s,
                            interpret=False, layer=None):
    """Grid (B, K) kernel looping over the valid S tiles inside (see the module doc).

    Arguments as `decode_attention_tpu`; block_s must be a power of two >= 16."""
    from jax.experimental.pallas import triton as pltriton

    B, T, N, H = q.shape
    k_cache, v_cache, layer = _layer_major(k_cache, v_cache, layer)
    L, _, K, S, _ = k_cache.shape
    R = N // K
    M = T * R
    Mp, Tp = _pow2_at_least(M, 16), _pow2_at_least(T, 16)
    scale = 1.0 / float(np.sqrt(H))
    qf = jnp.pad(_fold_q(q, K, R), ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
    pad_t = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
    kn = jnp.pad(k_new.transpose(0, 2, 1, 3), pad_t)  # [B, K, Tp, H]
    vn = jnp.pad(v_new.transpose(0, 2, 1, 3), pad_t)
    lens = lengths.reshape(B, 1)
    layer_arr = layer.reshape(1, 1)
    kc = k_cache.reshape(L * B * K, S, H)  # a free view of the layer-major cache
    vc = v_cache.reshape(L * B * K, S, H)

    def kernel(len_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref):
        length = len_ref[0, 0]
        qb = q_ref[0, 0]
        row = (layer_ref[0, 0] * B + pl.program_id(0)) * K + pl.program_id(1)

        def body(j, carry):
            start = j * block_s
            # Masked loads: Triton reads raw pointers, so rows past the length (and past S,
            # where the last tile overhangs the array) must not be touched at all.
            slots = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_s, H), 1)
            keep = slots < length
            tile = (pl.ds(row, 1), pl.ds(start, block_s), slice(None))
            kt = pltriton.load(k_ref.at[tile], mask=keep, other=0)[0]
            vt = pltriton.load(v_ref.at[tile], mask=keep, other=0)[0]
            s, vt = _tile_scores(qb, kt, vt, start, length, scale)
            return _online_step(*carry, s, vt)

        carry = (jnp.full((Mp, 1), NEG_INF, jnp.float32), jnp.zeros((Mp, 1), jnp.float32),
                 jnp.zeros((Mp, H), jnp.float32))
        n_tiles = jax.lax.div(length + block_s - 1, block_s)
        m, l, acc = jax.lax.fori_loop(0, n_tiles, body, carry)
        s = _new_scores(qb, kn_ref[0, 0], scale, causal, R, T)
        m, l, acc = _online_step(m, l, acc, s, vn_ref[0, 0])
        o_ref[0, 0] = (acc / l).astype(o_ref.dtype)

    out = pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[
            pl.BlockSpec((1, 1), lambda b, h: (b, 0)),
            pl.BlockSpec((1, 1), lambda b, h: (0, 0)),
            pl.BlockSpec((1, 1, Mp, H), lambda b, h: (b, h, 0, 0)),
            # The whole cache, addressed in the kernel (pl.ds slices: integer indexing,
            # `ref.at[0, ...]`, breaks the interpreter's discharge of masked loads).
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec((1, 1, Tp, H), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((1, 1, Tp, H), lambda b, h: (b, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((1, 1, Mp, H), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, Mp, H), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention_triton",
    )(lens, layer_arr, qf, kc, vc, kn, vn)
    return _unfold_o(out[:, :, :M], T, R)


KERNELS = {"tpu": decode_attention_tpu, "triton": decode_attention_triton}
