"""Pallas kernels for few-query attention into a long KV cache (flash decoding).

Layout (both backends): the R = N/K query heads of a KV head are folded into rows, so
per (row b, KV head k) the queries are one [T*R, H] block; row i = t*R + r is query
token t = i // R of head k*R + r. New token u is visible to row i in causal mode iff
u <= t, i.e. u*R <= i (no integer division in the kernel).

Tree mode (`tree_mask` given, a draft tree's [B, T, T] visibility with the diagonal set):
the wrapper expands it once per call to the folded rows, i32 [B, M, Tn] with
[b, t*R + r, u] = tree_mask[b, t, u] (`_tree_rows`: rows repeated R times, padded new
tokens 0, padded query rows 1). Its block is the row's [M, Tn], index (b, 0, 0) for every
KV head, split and S step (the TPU pipeline copies it once per row), and the kernels read
it only where they fold the new tokens in (`_new_scores`: the last S step, the last
split). Causal and block modes take no such input: their kernels are unchanged.

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

Split-S (flash-decoding), `num_splits` > 1: with few programs (B*K small) the grids
above leave most cores idle on a long row, so the S axis is also cut into P contiguous
chunks of whole tiles, chunk = cdiv(nS, num_splits) tiles, P = cdiv(nS, chunk) <=
num_splits (`split_tiles`: no split starts past S), each processed by an independent
program that writes its partial online-softmax state to HBM: m and l f32 [B, K, P, M, 1]
and the unnormalised accumulator f32 [B, K, P, M, H]. Only the last split folds the T
new tokens in, so every row has a finite m somewhere. `combine_splits` (jnp, outside the
kernel) then rescales the partials by exp(m_p - max_p m_p), sums them and normalises.
- TPU: grid (B, K, P, chunk), dimension semantics ("parallel", "parallel", "parallel",
  "arbitrary"); step i of split p is global tile j = p*chunk + i, computed only while
  j*block_s < lengths[b], and the index map clamps j with `kv_tile_index` as above, so a
  split whose chunk lies wholly past the length computes nothing, issues no DMA and
  writes m = -inf, l = 0, acc = 0 (or, as the last split, just the new tokens' state).
- Triton: grid (B, K, P); each program loops over the tiles of its chunk below the
  length (a trip count of max(0, min((p+1)*chunk, cdiv(lengths[b], block_s)) - p*chunk)).
With P = 1 (the default for most shapes, see `decode_attention`) neither kernel writes
partials: the single-pass code paths above, unchanged. Splitting changes only the order
of the f32 sums, so results agree up to f32 rounding.

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


def _new_scores(q, kn, scale, causal, R, T_valid, see=None):
    """Scores of the new tokens [M, Tn]: causal (u*R <= row) and/or padded (u >= T_valid)
    masked; in tree mode `see` (i32 [M, Tn], the row's `_tree_rows` block) masks where 0."""
    s = _dot_nt(q, kn) * scale
    u = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    keep = u < T_valid
    if causal:
        keep = keep & (u * R <= jax.lax.broadcasted_iota(jnp.int32, s.shape, 0))
    if see is not None:
        keep = keep & (see != 0)
    return jnp.where(keep, s, NEG_INF)


def _tree_rows(tree_mask, R, Mp, Tp):
    """bool [B, T, T] (diagonal set) -> i32 [B, Mp, Tp]: row t*R + r is tree_mask[b, t]
    (the folded query layout), new-token columns past T are 0 (also masked by T_valid),
    query rows past T*R (padding, dropped) are 1 so that they too see a key."""
    B, T, _ = tree_mask.shape
    rows = jnp.repeat(tree_mask.astype(jnp.int32), R, axis=1)  # [B, T*R, T]
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, Tp - T)))
    return jnp.pad(rows, ((0, 0), (0, Mp - T * R), (0, 0)), constant_values=1)


# ----------------------------------------------------------------------------- split-S


def split_tiles(nS, num_splits):
    """(chunk, P): the S tiles per split, chunk = cdiv(nS, num_splits), and the number of
    splits the kernels run, P = cdiv(nS, chunk) <= num_splits, so that no split starts at
    or past S (e.g. nS 10, num_splits 6 -> chunk 2, P 5). P == 1 means the single pass.
    Raises ValueError unless num_splits is an int >= 1."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
            or num_splits < 1:
        raise ValueError(f"num_splits={num_splits!r} must be an int >= 1")
    chunk = -(-nS // int(num_splits))
    return chunk, -(-nS // chunk)


def combine_splits(m, l, acc):
    """Merges P partial online-softmax states by log-sum-exp rescaling and normalises.

    m, l: f32 [B, K, P, M, 1] (running max and sum of each split, -inf / 0 where a split
    saw nothing), acc: f32 [B, K, P, M, H] (unnormalised). Every row must have a finite
    m in some split (the split that folded the new tokens in). Returns f32 [B, K, M, H]."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)  # a split with m = -inf weighs 0 (its l and acc are 0 too)
    return jnp.sum(w * acc, axis=2) / jnp.sum(w * l, axis=2)


# ----------------------------------------------------------------------------- TPU


def kv_tile_index(j, length, block_s):
    """The S tile that grid step j loads: j itself while j < cdiv(length, block_s), else
    the row's last needed tile (tile 0 when length is 0). A repeated block index makes the
    Pallas pipeline skip the copy, so steps past the length cost no HBM traffic.

    With split-S, j is the global tile p * chunk + i of split p's step i: a split whose
    chunk lies wholly past the length maps every step to the row's last needed tile, the
    block the previous grid step (the end of split p - 1) already holds, so it issues no
    DMA either."""
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
                         interpret=False, count_tiles=False, layer=None, num_splits=1,
                         tree_mask=None):
    """Grid (B, K, nS) kernel with scalar-prefetched lengths and layer, or with
    num_splits > 1 the split-S grid (B, K, P, chunk) plus `combine_splits` (module doc).

    Arguments as `decode_attention` (validated there): k_cache, v_cache [B, K, S, H], or
    [L, B, K, S, H] with `layer` (i32 scalar) naming the one to read; lengths already
    clipped to 0..S and block_s a multiple of 8 or equal to S; num_splits an int >= 1
    (see `split_tiles`); tree_mask None (causal / block: `causal`) or bool [B, T, T] with
    the diagonal set (tree mode; `causal` must be False). count_tiles=True (tests) also
    returns the number of cache tiles each program actually computed: i32[B, K], or
    i32[B, K, P] with splits."""
    from jax.experimental.pallas import tpu as pltpu

    B, T, N, H = q.shape
    k_cache, v_cache, layer = _layer_major(k_cache, v_cache, layer)
    _, _, K, S, _ = k_cache.shape
    R = N // K
    M = T * R
    nS = pl.cdiv(S, block_s)
    chunk, P = split_tiles(nS, num_splits)
    split = P > 1
    scale = 1.0 / float(np.sqrt(H))
    qf = _fold_q(q, K, R)  # [B, K, M, H]
    # New tokens padded to a multiple of 8 rows (masked out in `_new_scores`, V zero):
    # with T = 1 a bf16 [M, H] x [1, H]^T dot fails Mosaic's verifier (jax 0.10.2).
    Tn = -(-T // 8) * 8
    pad_t = ((0, 0), (0, 0), (0, Tn - T), (0, 0))
    kn = jnp.pad(k_new.transpose(0, 2, 1, 3), pad_t)  # [B, K, Tn, H]
    vn = jnp.pad(v_new.transpose(0, 2, 1, 3), pad_t)
    tree = tree_mask is not None

    if split:  # grid (B, K, P, chunk): step i of split p is global tile p * chunk + i
        grid, steps = (B, K, P, chunk), chunk

        def kv_index(b, h, p, i, len_ref, layer_ref):
            return layer_ref[0], b, h, kv_tile_index(p * chunk + i, len_ref[b], block_s), 0

        def fixed(b, h, p, i, len_ref, layer_ref):
            return b, h, 0, 0

        def per_split(b, h, p, i, len_ref, layer_ref):  # partials, tile counts
            return b, h, p, 0, 0

        def per_row(b, h, p, i, len_ref, layer_ref):  # the tree mask
            return b, 0, 0
    else:
        grid, steps = (B, K, nS), nS

        def kv_index(b, h, j, len_ref, layer_ref):
            return layer_ref[0], b, h, kv_tile_index(j, len_ref[b], block_s), 0

        def fixed(b, h, j, len_ref, layer_ref):  # q, new tokens, output: one per (b, h)
            return b, h, 0, 0

        def per_row(b, h, j, len_ref, layer_ref):  # the tree mask: one per row b
            return b, 0, 0

    n_out = (3 if split else 1) + count_tiles

    def kernel(len_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, *rest):
        see_ref, rest = (rest[0], rest[1:]) if tree else (None, rest)
        outs, (m_sc, l_sc, acc_sc) = rest[:n_out], rest[n_out:]
        cnt_ref = outs[-1] if count_tiles else None
        b, i = pl.program_id(0), pl.program_id(len(grid) - 1)
        p = pl.program_id(2) if split else None
        j = p * chunk + i if split else i  # the global S tile of this step
        length = len_ref[b]

        @pl.when(i == 0)
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

        def fold_new():
            see = None if see_ref is None else see_ref[0]
            s = _new_scores(q_ref[0, 0], kn_ref[0, 0], scale, causal, R, T, see)
            return _online_step(m_sc[...], l_sc[...], acc_sc[...], s, vn_ref[0, 0])

        @pl.when(i == steps - 1)
        def _finish():
            if not split:
                m, l, acc = fold_new()
                outs[0][0, 0] = (acc / l).astype(outs[0].dtype)
                return

            @pl.when(p == P - 1)  # one split folds the new tokens in
            def _new():
                m_sc[...], l_sc[...], acc_sc[...] = fold_new()

            m_ref, l_ref, acc_ref = outs[:3]
            m_ref[0, 0, 0] = m_sc[...]
            l_ref[0, 0, 0] = l_sc[...]
            acc_ref[0, 0, 0] = acc_sc[...]

    f32 = jnp.float32
    if split:
        out_specs = [pl.BlockSpec((1, 1, 1, M, 1), per_split),
                     pl.BlockSpec((1, 1, 1, M, 1), per_split),
                     pl.BlockSpec((1, 1, 1, M, H), per_split)]
        out_shape = [jax.ShapeDtypeStruct((B, K, P, M, 1), f32),
                     jax.ShapeDtypeStruct((B, K, P, M, 1), f32),
                     jax.ShapeDtypeStruct((B, K, P, M, H), f32)]
        cnt_spec = pl.BlockSpec((1, 1, 1, 1, 1), per_split)
        cnt_shape = jax.ShapeDtypeStruct((B, K, P, 1, 1), jnp.int32)
    else:
        out_specs = [pl.BlockSpec((1, 1, M, H), fixed)]
        out_shape = [jax.ShapeDtypeStruct((B, K, M, H), q.dtype)]
        cnt_spec = pl.BlockSpec((1, 1, 1, 1), fixed)
        cnt_shape = jax.ShapeDtypeStruct((B, K, 1, 1), jnp.int32)
    if count_tiles:
        out_specs, out_shape = out_specs + [cnt_spec], out_shape + [cnt_shape]
    in_specs = [
        pl.BlockSpec((1, 1, M, H), fixed),
        pl.BlockSpec((None, 1, 1, block_s, H), kv_index),  # layer axis squeezed
        pl.BlockSpec((None, 1, 1, block_s, H), kv_index),
        pl.BlockSpec((1, 1, Tn, H), fixed),
        pl.BlockSpec((1, 1, Tn, H), fixed),
    ]
    inputs = [qf, k_cache, v_cache, kn, vn]
    if tree:  # [M, Tn] i32, full dims (the (8, 128) rule holds for any M, Tn)
        in_specs.append(pl.BlockSpec((1, M, Tn), per_row))
        inputs.append(_tree_rows(tree_mask, R, M, Tn))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((M, 1), f32), pltpu.VMEM((M, 1), f32),
                        pltpu.VMEM((M, H), f32)],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",) * (len(grid) - 1) + ("arbitrary",)),
        interpret=interpret,
        name=("decode_attention_split" if split else "decode_attention")
        + ("_tree" if tree else ""),
    )(lengths, layer.reshape(1), *inputs)
    o = combine_splits(*out[:3]).astype(q.dtype) if split else out[0]
    o = _unfold_o(o, T, R)
    if count_tiles:
        cnt = out[-1]
        return o, (cnt[:, :, :, 0, 0] if split else cnt[:, :, 0, 0])
    return o


# ----------------------------------------------------------------------------- GPU (Triton)


def _pow2_at_least(n, lo):
    return max(lo, int(pl.next_power_of_2(n)))


def decode_attention_triton(q, k_cache, v_cache, lengths, k_new, v_new, *, causal, block_s,
                            interpret=False, layer=None, num_splits=1, tree_mask=None):
    """Grid (B, K) kernel looping over the valid S tiles inside, or with num_splits > 1
    grid (B, K, P), each program looping over the valid tiles of its chunk, plus
    `combine_splits` (see the module doc).

    Arguments as `decode_attention_tpu`; block_s must be a power of two >= 16."""
    from jax.experimental.pallas import triton as pltriton

    B, T, N, H = q.shape
    k_cache, v_cache, layer = _layer_major(k_cache, v_cache, layer)
    L, _, K, S, _ = k_cache.shape
    R = N // K
    M = T * R
    Mp, Tp = _pow2_at_least(M, 16), _pow2_at_least(T, 16)
    chunk, P = split_tiles(pl.cdiv(S, block_s), num_splits)
    split = P > 1
    scale = 1.0 / float(np.sqrt(H))
    qf = jnp.pad(_fold_q(q, K, R), ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
    pad_t = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
    kn = jnp.pad(k_new.transpose(0, 2, 1, 3), pad_t)  # [B, K, Tp, H]
    vn = jnp.pad(v_new.transpose(0, 2, 1, 3), pad_t)
    lens = lengths.reshape(B, 1)
    layer_arr = layer.reshape(1, 1)
    kc = k_cache.reshape(L * B * K, S, H)  # a free view of the layer-major cache
    vc = v_cache.reshape(L * B * K, S, H)
    tree = tree_mask is not None

    def kernel(len_ref, layer_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, *outs):
        see_ref, outs = (outs[0], outs[1:]) if tree else (None, outs)

        def new_scores():  # the tree mask is loaded here, after the loop over S tiles
            see = None if see_ref is None else see_ref[0]
            return _new_scores(qb, kn_ref[0, 0], scale, causal, R, T, see)

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
        if not split:
            m, l, acc = jax.lax.fori_loop(0, n_tiles, body, carry)
            m, l, acc = _online_step(m, l, acc, new_scores(), vn_ref[0, 0])
            outs[0][0, 0] = (acc / l).astype(outs[0].dtype)
            return
        p = pl.program_id(2)
        lo = p * chunk  # tiles lo .. min(lo + chunk, n_tiles) - 1 (none if lo >= n_tiles)
        m, l, acc = jax.lax.fori_loop(lo, jnp.minimum(lo + chunk, n_tiles), body, carry)
        # The last split folds the new tokens in (computed everywhere, kept there: the new
        # scores always have a finite entry per row, so the discarded fold is finite too).
        m2, l2, acc2 = _online_step(m, l, acc, new_scores(), vn_ref[0, 0])
        last = p == P - 1
        m_ref, l_ref, acc_ref = outs
        m_ref[0, 0, 0] = jnp.where(last, m2, m)
        l_ref[0, 0, 0] = jnp.where(last, l2, l)
        acc_ref[0, 0, 0] = jnp.where(last, acc2, acc)

    if split:
        grid = (B, K, P)
        fixed = lambda b, h, p: (b, h, 0, 0)  # noqa: E731
        per_split = lambda b, h, p: (b, h, p, 0, 0)  # noqa: E731
        out_specs = [pl.BlockSpec((1, 1, 1, Mp, 1), per_split),
                     pl.BlockSpec((1, 1, 1, Mp, 1), per_split),
                     pl.BlockSpec((1, 1, 1, Mp, H), per_split)]
        out_shape = [jax.ShapeDtypeStruct((B, K, P, Mp, 1), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, P, Mp, 1), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, P, Mp, H), jnp.float32)]
    else:
        grid = (B, K)
        fixed = lambda b, h: (b, h, 0, 0)  # noqa: E731
        out_specs = [pl.BlockSpec((1, 1, Mp, H), fixed)]
        out_shape = [jax.ShapeDtypeStruct((B, K, Mp, H), q.dtype)]
    in_specs = [
        pl.BlockSpec((1, 1), lambda b, h, *_: (b, 0)),
        pl.BlockSpec((1, 1), lambda b, h, *_: (0, 0)),
        pl.BlockSpec((1, 1, Mp, H), fixed),
        # The whole cache, addressed in the kernel (pl.ds slices: integer indexing,
        # `ref.at[0, ...]`, breaks the interpreter's discharge of masked loads).
        pl.BlockSpec(memory_space=pl.ANY),
        pl.BlockSpec(memory_space=pl.ANY),
        pl.BlockSpec((1, 1, Tp, H), fixed),
        pl.BlockSpec((1, 1, Tp, H), fixed),
    ]
    inputs = [lens, layer_arr, qf, kc, vc, kn, vn]
    if tree:  # the row's [Mp, Tp] i32 mask, power-of-two dims as Triton wants
        in_specs.append(pl.BlockSpec((1, Mp, Tp), lambda b, h, *_: (b, 0, 0)))
        inputs.append(_tree_rows(tree_mask, R, Mp, Tp))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=("decode_attention_triton_split" if split else "decode_attention_triton")
        + ("_tree" if tree else ""),
    )(*inputs)
    o = combine_splits(*out).astype(q.dtype) if split else out[0]
    return _unfold_o(o[:, :, :M], T, R)


KERNELS = {"tpu": decode_attention_tpu, "triton": decode_attention_triton}
