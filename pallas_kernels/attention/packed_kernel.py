"""Pallas kernels of `packed_attention`: forward, dq and dk/dv (flash attention 2, Dao
2023, with flash-decoding's skipping of the KV tiles past a query tile's limit).

Layout (both backends). The R = N/K query heads of a KV head are folded into rows: per
(row b, KV head k) the queries are one [Mp, H] matrix, row i = t*R + r being query t of
head k*R + r (M = T*R rows, padded with zero rows to Mp, a multiple of the row tile bq).
Every row carries its own key limit, lim[b, i] = limit[b, i // R] (padded rows: 0), so
row i sees slots s < lim[b, i]. Keys and values stay in their [B, K, S, H] layout.

Visibility is always a PREFIX of the slots. So for a row tile with tile maximum
tmax = max lim over its rows, exactly the S tiles 0 .. cdiv(tmax, bs) - 1 matter; the
others are skipped (no compute; on TPU also no DMA: the K/V index map clamps to the last
needed tile, a repeated block index makes the pipeline skip the copy). Conversely, for
the dk/dv pass, S tile j is needed by the row tiles with tmax > j*bs; these are listed
per (b, j) in the wrapper (active tiles first, in order; the list's tail repeats the last
active tile, so skipped steps re-use the resident block) with their count.

NaN safety: inside a tile, entries (row, slot) with slot >= lim[row] are masked with
`where` (never multiplied): scores to -inf, probabilities and dS to 0. Where a masked
entry would still meet a matrix product's other operand (V rows in P.V, K rows in dS.K),
the slots at or past the tile's tmax (seen by no row of the tile, e.g. NaN-poisoned or,
on TPU, the uninitialised padding of a partial last tile) are zeroed first. The dk/dv
pass works transposed (slots on sublanes, rows on lanes: S^T = K Q^T, dV = P^T dO,
dK = dS^T Q), so masked slots there are whole rows of its results, written as zeros.

Forward (online softmax over the S tiles, running max m, sum l, accumulator acc, f32):
o = acc / l and lse = m + log l; a row that sees nothing gets o = 0, lse = -inf.
Backward with the saved lse and di = rowsum(dO * O) - g_lse (the lse cotangent folds
into the flash-attention delta): P = exp(S - lse), dP = dO V^T, dS = P * (dP - di),
dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.

TPU (Mosaic): grids (B, K, nQ, nS) for the forward and dq (the S axis "arbitrary",
accumulating in VMEM scratch) and (B, K, nS, nQ) for dk/dv, with scalar prefetch of the
tile maxima (forward, dq) or of the row-tile lists and counts (dk/dv). Block shapes obey
the (8, 128) rule: K/V blocks [bs, H] (bs a multiple of 8 or S), row blocks [bq, H],
per-row limits / lse / di as [bq, 1] columns and, in the transposed dk/dv pass, as
[1, bq] rows (so bq is a multiple of 128 or the whole padded row count).

GPU (Triton): there is no resident accumulator across grid steps, so the grids are
(B, K, nQ) for the forward and dq, each program looping over its cdiv(tmax, bs) S tiles,
and (B, K, nS) for dk/dv, looping over the listed row tiles. Tiles come from whole
arrays left in HBM (`pl.ANY`) through masked loads (slots past tmax, or past S, are never
touched); blocks are powers of two >= 16.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.attention.kernel import _dot_nn, _dot_nt

NEG_INF = float("-inf")


class Plan(NamedTuple):
    """Static geometry of one call: shapes (letters as in the module doc) and tiles."""

    B: int
    T: int
    N: int
    K: int
    S: int
    H: int
    bq: int  # row tile (rows of the folded [Mp, H] query matrix)
    bs: int  # slot tile

    @property
    def R(self) -> int:
        return self.N // self.K

    @property
    def M(self) -> int:
        return self.T * self.R

    @property
    def nQ(self) -> int:
        return -(-self.M // self.bq)

    @property
    def Mp(self) -> int:
        return self.nQ * self.bq

    @property
    def nS(self) -> int:
        return -(-self.S // self.bs)

    @property
    def scale(self) -> float:
        return 1.0 / float(self.H) ** 0.5


# ----------------------------------------------------------------------------- layout


def fold_rows(x, plan: Plan):
    """[B, T, N, X] -> [B, K, Mp, X]: row t*R + r is head k*R + r of query t; zero pad."""
    B, T, N, X = x.shape
    K, R = plan.K, plan.R
    x = x.reshape(B, T, K, R, X).transpose(0, 2, 1, 3, 4).reshape(B, K, T * R, X)
    return jnp.pad(x, ((0, 0), (0, 0), (0, plan.Mp - plan.M), (0, 0)))


def unfold_rows(x, plan: Plan):
    """Inverse of `fold_rows` (padding rows dropped): [B, K, Mp, X] -> [B, T, N, X]."""
    B, K, _, X = x.shape
    x = x[:, :, :plan.M].reshape(B, K, plan.T, plan.R, X)
    return x.transpose(0, 2, 1, 3, 4).reshape(B, plan.T, plan.N, X)


def row_limits(limit, plan: Plan):
    """i32[B, T] (already clipped to 0..S) -> i32[B, Mp]: row t*R + r gets limit[b, t];
    padding rows get 0 (they see nothing)."""
    lim = jnp.repeat(limit.astype(jnp.int32), plan.R, axis=1)
    return jnp.pad(lim, ((0, 0), (0, plan.Mp - plan.M)))


def tile_max(lim_rows, plan: Plan):
    """i32[B, Mp] -> i32[B, nQ], the largest limit of each row tile."""
    return lim_rows.reshape(plan.B, plan.nQ, plan.bq).max(axis=-1)


def q_tile_lists(tmax, plan: Plan):
    """Row tiles that see each S tile: (list i32[B, nS, nQ], count i32[B, nS]).

    Row tile i sees S tile j iff tmax[b, i] > j*bs. The list holds those tiles first,
    in increasing order, then repeats the last of them (tile 0 when there is none), so
    the steps past the count re-use the resident block. Limits need not be sorted."""
    starts = jnp.arange(plan.nS, dtype=jnp.int32) * plan.bs
    active = tmax[:, None, :] > starts[None, :, None]  # [B, nS, nQ]
    count = active.sum(axis=-1).astype(jnp.int32)
    order = jnp.argsort(jnp.logical_not(active).astype(jnp.int32), axis=-1,
                        stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    steps = jnp.arange(plan.nQ, dtype=jnp.int32)
    return jnp.where(steps < count[..., None], order, last), count


def kv_tile_index(j, tmax, bs):
    """The S tile grid step j loads: j while j < cdiv(tmax, bs), else the last needed
    tile (0 when tmax is 0); repeated block indices issue no copy."""
    # lax.div, not //: jnp's floor division lowers through `sign`, which Mosaic lowers
    # only after querying the TPU generation (exporting from a CPU host fails).
    last = jnp.maximum(jax.lax.div(tmax + bs - 1, bs) - 1, 0)
    return jnp.minimum(j, last)


# ----------------------------------------------------------------------------- tile math


def _iota(shape, axis, start=0):
    return start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _fwd_tile(carry, q, k, v, lim, start, tmax, scale):
    """Online-softmax fold of one S tile. q [bq, H], k/v [bs, H], lim i32[bq, 1]; carry
    (m [bq, 1], l [bq, 1], acc [bq, H]) f32. Rows may see none of the tile."""
    m, l, acc = carry
    s = _dot_nt(q, k) * scale
    s = jnp.where(_iota(s.shape, 1, start) < lim, s, NEG_INF)
    v = jnp.where(_iota(v.shape, 0, start) < tmax, v, jnp.zeros_like(v))
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)  # no -inf - -inf for empty rows
    alpha = jnp.exp(m - m_use)
    p = jnp.exp(s - m_use)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc_new = alpha * acc + _dot_nn(p.astype(v.dtype), v)
    return m_new, l_new, acc_new


def _fwd_finish(m, l, acc):
    """(o f32 [bq, H], lse f32 [bq, 1]); rows that saw nothing: o = 0, lse = -inf."""
    seen = l > 0.0
    l_use = jnp.where(seen, l, 1.0)
    return acc / l_use, jnp.where(seen, m + jnp.log(l_use), NEG_INF)


def _dq_tile(dq, q, k, v, do, lse, di, lim, start, tmax, scale):
    """dq [bq, H] f32 += dS K over one S tile (unscaled). lse, di f32 [bq, 1]."""
    s = _dot_nt(q, k) * scale
    vis = _iota(s.shape, 1, start) < lim
    p = jnp.where(vis, jnp.exp(s - lse), 0.0)
    dp = _dot_nt(do, v)
    ds = jnp.where(vis, p * (dp - di), 0.0)
    k = jnp.where(_iota(k.shape, 0, start) < tmax, k, jnp.zeros_like(k))
    return dq + _dot_nn(ds.astype(k.dtype), k)


def _dkv_tile(dk, dv, q, k, v, do, lse, di, lim, start, scale):
    """dk, dv [bs, H] f32 += dS^T Q (unscaled), P^T dO over one row tile, computed
    transposed: lse, di f32 [1, bq], lim i32[1, bq]."""
    st = _dot_nt(k, q) * scale  # [bs, bq]
    vis = _iota(st.shape, 0, start) < lim
    pt = jnp.where(vis, jnp.exp(st - lse), 0.0)
    dv = dv + _dot_nn(pt.astype(do.dtype), do)
    dpt = _dot_nt(v, do)
    dst = jnp.where(vis, pt * (dpt - di), 0.0)
    dk = dk + _dot_nn(dst.astype(q.dtype), q)
    return dk, dv


# ----------------------------------------------------------------------------- TPU


def _tpu():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu


def _count_spec(block, index_map, shape):
    """A (1, 1, 1, 1) i32 tile counter per program (tests: proves the skipping)."""
    return pl.BlockSpec(block, index_map), jax.ShapeDtypeStruct(shape, jnp.int32)


def _row_grid_maps(nQ, bs):
    """Index maps of the grid (b, h, i, j) over row tile i and S tile j, with the tile
    maxima tm scalar-prefetched (forward and dq): rows [bq, *] of tile i; the K/V tile j,
    clamped to tile i's last needed one (`kv_tile_index`); the limits [bq, 1] of tile i."""

    def row_map(b, h, i, j, tm):
        return b, h, i, 0

    def kv_map(b, h, i, j, tm):
        return b, h, kv_tile_index(j, tm[b * nQ + i], bs), 0

    def lim_map(b, h, i, j, tm):
        return b, i, 0

    return row_map, kv_map, lim_map


def forward_tpu(qf, k, v, lim, tmax, *, plan: Plan, interpret=False, count_tiles=False):
    """Forward, grid (B, K, nQ, nS), tile maxima scalar-prefetched.

    qf [B, K, Mp, H] (folded, `fold_rows`), k, v [B, K, S, H], lim i32[B, Mp]
    (`row_limits`), tmax i32[B, nQ] (`tile_max`). Returns (o [B, K, Mp, H] in qf.dtype,
    lse f32[B, K, Mp, 1]) and, with count_tiles, i32[B, K, nQ]: the S tiles each
    program computed."""
    pltpu = _tpu()
    B, K, H, bq, bs, nQ, nS = plan.B, plan.K, plan.H, plan.bq, plan.bs, plan.nQ, plan.nS
    scale = plan.scale

    row_map, kv_map, lim_map = _row_grid_maps(nQ, bs)

    def kernel(tm_ref, q_ref, k_ref, v_ref, lim_ref, o_ref, lse_ref, *rest):
        cnt_ref, (m_sc, l_sc, acc_sc) = (rest[0], rest[1:]) if count_tiles else (None, rest)
        b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        tmax = tm_ref[b * nQ + i]

        @pl.when(j == 0)
        def _init():
            m_sc[...] = jnp.full((bq, 1), NEG_INF, jnp.float32)
            l_sc[...] = jnp.zeros((bq, 1), jnp.float32)
            acc_sc[...] = jnp.zeros((bq, H), jnp.float32)
            if cnt_ref is not None:
                cnt_ref[...] = jnp.zeros_like(cnt_ref)

        @pl.when(j * bs < tmax)
        def _tile():
            carry = (m_sc[...], l_sc[...], acc_sc[...])
            m, l, acc = _fwd_tile(carry, q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], lim_ref[0],
                                  j * bs, tmax, scale)
            m_sc[...], l_sc[...], acc_sc[...] = m, l, acc
            if cnt_ref is not None:
                cnt_ref[...] = cnt_ref[...] + 1

        @pl.when(j == nS - 1)
        def _finish():
            o, lse = _fwd_finish(m_sc[...], l_sc[...], acc_sc[...])
            o_ref[0, 0] = o.astype(o_ref.dtype)
            lse_ref[0, 0] = lse

    out_specs = [pl.BlockSpec((1, 1, bq, H), row_map), pl.BlockSpec((1, 1, bq, 1), row_map)]
    out_shape = [jax.ShapeDtypeStruct(qf.shape, qf.dtype),
                 jax.ShapeDtypeStruct((B, K, plan.Mp, 1), jnp.float32)]
    if count_tiles:
        spec, shape = _count_spec((1, 1, 1, 1), row_map, (B, K, nQ, 1))
        out_specs.append(spec)
        out_shape.append(shape)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, K, nQ, nS),
        in_specs=[pl.BlockSpec((1, 1, bq, H), row_map),
                  pl.BlockSpec((1, 1, bs, H), kv_map),
                  pl.BlockSpec((1, 1, bs, H), kv_map),
                  pl.BlockSpec((1, bq, 1), lim_map)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                        pltpu.VMEM((bq, H), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="packed_attention_fwd",
    )(tmax.reshape(-1), qf, k, v, lim.reshape(B, plan.Mp, 1))
    if count_tiles:
        return out[0], out[1], out[2][..., 0]
    return out[0], out[1]


def dq_tpu(qf, k, v, dof, lse, di, lim, tmax, *, plan: Plan, interpret=False,
           count_tiles=False):
    """dq, grid (B, K, nQ, nS) as the forward. dof [B, K, Mp, H] (folded dO), lse and di
    f32[B, K, Mp, 1]. Returns dq [B, K, Mp, H] in qf.dtype (and i32[B, K, nQ] counts)."""
    pltpu = _tpu()
    B, K, H, bq, bs, nQ, nS = plan.B, plan.K, plan.H, plan.bq, plan.bs, plan.nQ, plan.nS
    scale = plan.scale

    row_map, kv_map, lim_map = _row_grid_maps(nQ, bs)

    def kernel(tm_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, lim_ref, dq_ref, *rest):
        cnt_ref, (dq_sc,) = (rest[0], rest[1:]) if count_tiles else (None, rest)
        b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
        tmax = tm_ref[b * nQ + i]

        @pl.when(j == 0)
        def _init():
            dq_sc[...] = jnp.zeros((bq, H), jnp.float32)
            if cnt_ref is not None:
                cnt_ref[...] = jnp.zeros_like(cnt_ref)

        @pl.when(j * bs < tmax)
        def _tile():
            dq_sc[...] = _dq_tile(dq_sc[...], q_ref[0, 0], k_ref[0, 0], v_ref[0, 0],
                                  do_ref[0, 0], lse_ref[0, 0], di_ref[0, 0], lim_ref[0],
                                  j * bs, tmax, scale)
            if cnt_ref is not None:
                cnt_ref[...] = cnt_ref[...] + 1

        @pl.when(j == nS - 1)
        def _finish():
            dq_ref[0, 0] = (dq_sc[...] * scale).astype(dq_ref.dtype)

    row, col = pl.BlockSpec((1, 1, bq, H), row_map), pl.BlockSpec((1, 1, bq, 1), row_map)
    out_specs = [pl.BlockSpec((1, 1, bq, H), row_map)]
    out_shape = [jax.ShapeDtypeStruct(qf.shape, qf.dtype)]
    if count_tiles:
        spec, shape = _count_spec((1, 1, 1, 1), row_map, (B, K, nQ, 1))
        out_specs.append(spec)
        out_shape.append(shape)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, K, nQ, nS),
        in_specs=[row, pl.BlockSpec((1, 1, bs, H), kv_map), pl.BlockSpec((1, 1, bs, H), kv_map),
                  row, col, col, pl.BlockSpec((1, bq, 1), lim_map)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bq, H), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="packed_attention_dq",
    )(tmax.reshape(-1), qf, k, v, dof, lse, di, lim.reshape(B, plan.Mp, 1))
    if count_tiles:
        return out[0], out[1][..., 0]
    return out[0]


def dkv_tpu(qf, k, v, dof, lse, di, lim, qlist, qcount, *, plan: Plan, interpret=False,
            count_tiles=False):
    """dk, dv, grid (B, K, nS, nQ), the listed row tiles (`q_tile_lists`) scalar-prefetched.

    Arguments as `dq_tpu` with qlist i32[B, nS, nQ], qcount i32[B, nS] instead of tmax.
    Returns dk, dv [B, K, S, H] in k.dtype (zeros for slots nobody sees) and, with
    count_tiles, i32[B, K, nS]: the row tiles each program computed."""
    pltpu = _tpu()
    B, K, H, bq, bs, nQ, nS = plan.B, plan.K, plan.H, plan.bq, plan.bs, plan.nQ, plan.nS
    Mp, scale = plan.Mp, plan.scale

    def qi(b, j, i, ql):
        return ql[(b * nS + j) * nQ + i]

    def row_map(b, h, j, i, ql, qc):
        return b, h, qi(b, j, i, ql), 0

    def lane_map(b, h, j, i, ql, qc):  # lse, di as [1, bq] rows of [B, K, 1, Mp]
        return b, h, 0, qi(b, j, i, ql)

    def lim_map(b, h, j, i, ql, qc):
        return b, 0, qi(b, j, i, ql)

    def kv_map(b, h, j, i, ql, qc):
        return b, h, j, 0

    def kernel(ql_ref, qc_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, lim_ref,
               dk_ref, dv_ref, *rest):
        cnt_ref, (dk_sc, dv_sc) = (rest[0], rest[1:]) if count_tiles else (None, rest)
        b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

        @pl.when(i == 0)
        def _init():
            dk_sc[...] = jnp.zeros((bs, H), jnp.float32)
            dv_sc[...] = jnp.zeros((bs, H), jnp.float32)
            if cnt_ref is not None:
                cnt_ref[...] = jnp.zeros_like(cnt_ref)

        @pl.when(i < qc_ref[b * nS + j])
        def _tile():
            dk, dv = _dkv_tile(dk_sc[...], dv_sc[...], q_ref[0, 0], k_ref[0, 0], v_ref[0, 0],
                               do_ref[0, 0], lse_ref[0, 0], di_ref[0, 0], lim_ref[0],
                               j * bs, scale)
            dk_sc[...], dv_sc[...] = dk, dv
            if cnt_ref is not None:
                cnt_ref[...] = cnt_ref[...] + 1

        @pl.when(i == nQ - 1)
        def _finish():
            dk_ref[0, 0] = (dk_sc[...] * scale).astype(dk_ref.dtype)
            dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)

    row, lane = pl.BlockSpec((1, 1, bq, H), row_map), pl.BlockSpec((1, 1, 1, bq), lane_map)
    kv = pl.BlockSpec((1, 1, bs, H), kv_map)
    out_specs = [kv, kv]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2
    if count_tiles:
        spec, shape = _count_spec((1, 1, 1, 1), kv_map, (B, K, nS, 1))
        out_specs.append(spec)
        out_shape.append(shape)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, K, nS, nQ),
        in_specs=[row, kv, kv, row, lane, lane, pl.BlockSpec((1, 1, bq), lim_map)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bs, H), jnp.float32), pltpu.VMEM((bs, H), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="packed_attention_dkv",
    )(qlist.reshape(-1), qcount.reshape(-1), qf, k, v, dof, lse.reshape(B, K, 1, Mp),
      di.reshape(B, K, 1, Mp), lim.reshape(B, 1, Mp))
    if count_tiles:
        return out[0], out[1], out[2][..., 0]
    return out[0], out[1]


# ----------------------------------------------------------------------------- GPU (Triton)


def _triton_params(plan: Plan, backward: bool):
    """Warps as jax's Pallas GPU attention picks them (untuned here: no GPU was at hand):
    forward 4 up to H 64, else 8; backward 8 from 128 x 128 tiles on, else 4."""
    from jax.experimental.pallas import triton as pltriton

    big = plan.bq * plan.bs >= 128 * 128 if backward else plan.H > 64
    return pltriton.CompilerParams(num_warps=8 if big else 4, num_stages=2)


def _load_slots(ref, row, start, n, H, bound):
    """Tile [n, H] of ref [B*K, S, H] at (row, start), slots >= bound read as 0 (never
    touched: Triton loads raw pointers). pl.ds slices only: integer indexing breaks the
    interpreter's discharge of masked loads."""
    from jax.experimental.pallas import triton as pltriton

    keep = _iota((1, n, H), 1, start) < bound
    tile = (pl.ds(row, 1), pl.ds(start, n), slice(None))
    return pltriton.load(ref.at[tile], mask=keep, other=0)[0]


def forward_triton(qf, k, v, lim, tmax, *, plan: Plan, interpret=False):
    """Forward, grid (B, K, nQ), each program looping over its cdiv(tmax, bs) S tiles.
    Arguments and results as `forward_tpu` (no tile counter)."""
    B, K, S, H, bq, bs, nQ = plan.B, plan.K, plan.S, plan.H, plan.bq, plan.bs, plan.nQ
    scale = plan.scale

    def kernel(tm_ref, q_ref, k_ref, v_ref, lim_ref, o_ref, lse_ref):
        tmax = tm_ref[0, 0]
        row = pl.program_id(0) * K + pl.program_id(1)
        q, lim = q_ref[0, 0], lim_ref[0]

        def body(j, carry):
            start = j * bs
            kt = _load_slots(k_ref, row, start, bs, H, tmax)
            vt = _load_slots(v_ref, row, start, bs, H, tmax)
            return _fwd_tile(carry, q, kt, vt, lim, start, tmax, scale)

        carry = (jnp.full((bq, 1), NEG_INF, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
                 jnp.zeros((bq, H), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, jax.lax.div(tmax + bs - 1, bs), body, carry)
        o, lse = _fwd_finish(m, l, acc)
        o_ref[0, 0] = o.astype(o_ref.dtype)
        lse_ref[0, 0] = lse

    row_spec = pl.BlockSpec((1, 1, bq, H), lambda b, h, i: (b, h, i, 0))
    col_spec = pl.BlockSpec((1, 1, bq, 1), lambda b, h, i: (b, h, i, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, K, nQ),
        in_specs=[pl.BlockSpec((1, 1), lambda b, h, i: (b, i)), row_spec,
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((1, bq, 1), lambda b, h, i: (b, i, 0))],
        out_specs=[row_spec, col_spec],
        out_shape=[jax.ShapeDtypeStruct(qf.shape, qf.dtype),
                   jax.ShapeDtypeStruct((B, K, plan.Mp, 1), jnp.float32)],
        compiler_params=_triton_params(plan, backward=False),
        interpret=interpret,
        name="packed_attention_fwd_triton",
    )(tmax, qf, k.reshape(B * K, S, H), v.reshape(B * K, S, H), lim.reshape(B, plan.Mp, 1))
    return o, lse


def dq_triton(qf, k, v, dof, lse, di, lim, tmax, *, plan: Plan, interpret=False):
    """dq, grid (B, K, nQ) with a loop over the S tiles; arguments as `dq_tpu`."""
    B, K, S, H, bq, bs, nQ = plan.B, plan.K, plan.S, plan.H, plan.bq, plan.bs, plan.nQ
    scale = plan.scale

    def kernel(tm_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, lim_ref, dq_ref):
        tmax = tm_ref[0, 0]
        row = pl.program_id(0) * K + pl.program_id(1)
        q, do, lse, di, lim = q_ref[0, 0], do_ref[0, 0], lse_ref[0, 0], di_ref[0, 0], lim_ref[0]

        def body(j, dq):
            start = j * bs
            kt = _load_slots(k_ref, row, start, bs, H, tmax)
            vt = _load_slots(v_ref, row, start, bs, H, tmax)
            return _dq_tile(dq, q, kt, vt, do, lse, di, lim, start, tmax, scale)

        dq = jax.lax.fori_loop(0, jax.lax.div(tmax + bs - 1, bs), body,
                               jnp.zeros((bq, H), jnp.float32))
        dq_ref[0, 0] = (dq * scale).astype(dq_ref.dtype)

    row_spec = pl.BlockSpec((1, 1, bq, H), lambda b, h, i: (b, h, i, 0))
    col_spec = pl.BlockSpec((1, 1, bq, 1), lambda b, h, i: (b, h, i, 0))
    return pl.pallas_call(
        kernel,
        grid=(B, K, nQ),
        in_specs=[pl.BlockSpec((1, 1), lambda b, h, i: (b, i)), row_spec,
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  row_spec, col_spec, col_spec,
                  pl.BlockSpec((1, bq, 1), lambda b, h, i: (b, i, 0))],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(qf.shape, qf.dtype),
        compiler_params=_triton_params(plan, backward=True),
        interpret=interpret,
        name="packed_attention_dq_triton",
    )(tmax, qf, k.reshape(B * K, S, H), v.reshape(B * K, S, H), dof, lse, di,
      lim.reshape(B, plan.Mp, 1))


def dkv_triton(qf, k, v, dof, lse, di, lim, qlist, qcount, *, plan: Plan, interpret=False):
    """dk, dv, grid (B, K, nS), each program looping over its qcount listed row tiles;
    arguments and results as `dkv_tpu`. The outputs are written S-padded to nS*bs rows
    (every row written) and sliced back."""
    B, K, S, H, bq, bs, nQ, nS = plan.B, plan.K, plan.S, plan.H, plan.bq, plan.bs, plan.nQ, plan.nS
    Mp, scale = plan.Mp, plan.scale
    nQp = int(pl.next_power_of_2(nQ))  # Triton blocks are powers of two

    def kernel(ql_ref, qc_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, lim_ref,
               dk_ref, dv_ref):
        b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        row, start = b * K + h, j * bs
        kt = _load_slots(k_ref, row, start, bs, H, S)
        vt = _load_slots(v_ref, row, start, bs, H, S)

        def body(n, carry):
            r0 = ql_ref[0, 0, n] * bq
            rows = (pl.ds(row, 1), pl.ds(r0, bq), slice(None))
            lane = (pl.ds(row, 1), slice(None), pl.ds(r0, bq))
            return _dkv_tile(*carry, q_ref[rows][0], kt, vt, do_ref[rows][0], lse_ref[lane][0],
                             di_ref[lane][0], lim_ref[pl.ds(b, 1), :, pl.ds(r0, bq)][0],
                             start, scale)

        zero = jnp.zeros((bs, H), jnp.float32)
        dk, dv = jax.lax.fori_loop(0, qc_ref[0, 0], body, (zero, zero))
        dk_ref[0, 0] = (dk * scale).astype(dk_ref.dtype)
        dv_ref[0, 0] = dv.astype(dv_ref.dtype)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kv_spec = pl.BlockSpec((1, 1, bs, H), lambda b, h, j: (b, h, j, 0))
    padded = jax.ShapeDtypeStruct((B, K, nS * bs, H), k.dtype)
    ql = jnp.pad(qlist, ((0, 0), (0, 0), (0, nQp - nQ)))
    dk, dv = pl.pallas_call(
        kernel,
        grid=(B, K, nS),
        in_specs=[pl.BlockSpec((1, 1, nQp), lambda b, h, j: (b, j, 0)),
                  pl.BlockSpec((1, 1), lambda b, h, j: (b, j)),
                  any_spec, any_spec, any_spec, any_spec, any_spec, any_spec, any_spec],
        out_specs=[kv_spec, kv_spec],
        out_shape=[padded, padded],
        compiler_params=_triton_params(plan, backward=True),
        interpret=interpret,
        name="packed_attention_dkv_triton",
    )(ql, qcount, qf.reshape(B * K, Mp, H), k.reshape(B * K, S, H), v.reshape(B * K, S, H),
      dof.reshape(B * K, Mp, H), lse.reshape(B * K, 1, Mp), di.reshape(B * K, 1, Mp),
      lim.reshape(B, 1, Mp))
    return dk[:, :, :S], dv[:, :, :S]


KERNELS = {"tpu": (forward_tpu, dq_tpu, dkv_tpu),
           "triton": (forward_triton, dq_triton, dkv_triton)}
