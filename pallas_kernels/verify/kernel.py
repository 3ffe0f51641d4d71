"""Pallas kernels for the two vocabulary passes of verification.

Grid (B, nT): rows are independent ("parallel"), the V tiles of a row run in order
("arbitrary") and fold into per-position accumulators held in the output blocks, which
stay resident across a row's tiles (the TPU accumulator pattern). Each grid step reads one
[G+1, tile] block of target logits (and [G, tile] of draft probabilities or logits), so
nothing of size [B, G+1, V] is ever written: the softmaxes, the residuals and the noise
exist only tile by tile. The last tile of a V that is not a multiple of the tile is
partial; its lanes past V are masked before use (`tiles.scaled`, `tiles.draft_tile`).

Block shapes respect the TPU (8, 128) rule: the second-to-last block dim is G+1 or G
(the full array dim) and the last is the tile (a multiple of 128) or 1 (the full dim of
the per-position accumulators). On GPU, the same kernels lower through Triton (one
program per grid point runs in order on TPU only, so `backend="triton"` uses a grid over
rows and loops over the tiles inside the kernel instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.verify import tiles


def _compiler_params(backend):
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=1)
    return None


def _col(R):
    """BlockSpec of a per-position accumulator or input, f32/i32[B, R, 1]."""
    return pl.BlockSpec((1, R, 1), lambda b, j: (b, 0, 0))


def _tile_spec(R, tile):
    return pl.BlockSpec((1, R, tile), lambda b, j: (b, 0, j))


def stats_pass(tl, dl, *, inv_t, tile, greedy, interpret=False, backend="tpu"):
    """Kernel version of `reference.stats_pass` (same arguments and results)."""
    B, G1, V = tl.shape
    nT = pl.cdiv(V, tile)
    with_draft = dl is not None and not greedy

    def kernel(*refs):
        j = pl.program_id(1)
        y = tiles.lane_ids(j, tile)
        if greedy:
            tl_ref, am_ref, ai_ref = refs

            @pl.when(j == 0)
            def _():
                am_ref[0] = jnp.full((G1, 1), tiles.NEG_INF, jnp.float32)
                ai_ref[0] = jnp.zeros((G1, 1), jnp.int32)

            zt = tiles.scaled(tl_ref[0], y, V, 1.0)
            m, i = tiles.fold_argmax(am_ref[0], ai_ref[0], *tiles.tile_argmax(zt, y))
            am_ref[0], ai_ref[0] = m, i
            return
        if with_draft:
            tl_ref, dl_ref, mt_ref, st_ref, md_ref, sd_ref = refs
            acc = ((tl_ref, mt_ref, st_ref, G1), (dl_ref, md_ref, sd_ref, G1 - 1))
        else:
            tl_ref, mt_ref, st_ref = refs
            acc = ((tl_ref, mt_ref, st_ref, G1),)
        for in_ref, m_ref, s_ref, R in acc:

            @pl.when(j == 0)
            def _(m_ref=m_ref, s_ref=s_ref, R=R):
                m_ref[0] = jnp.full((R, 1), tiles.NEG_INF, jnp.float32)
                s_ref[0] = jnp.zeros((R, 1), jnp.float32)

            z = tiles.scaled(in_ref[0], y, V, inv_t)
            m, s = tiles.fold_max_sumexp(m_ref[0], s_ref[0], *tiles.tile_max_sumexp(z))
            m_ref[0], s_ref[0] = m, s

    in_specs = [_tile_spec(G1, tile)] + ([_tile_spec(G1 - 1, tile)] if with_draft else [])
    f32 = lambda R: jax.ShapeDtypeStruct((B, R, 1), jnp.float32)  # noqa: E731
    if greedy:
        out_shape = (f32(G1), jax.ShapeDtypeStruct((B, G1, 1), jnp.int32))
    else:
        out_shape = (f32(G1), f32(G1)) + ((f32(G1 - 1), f32(G1 - 1)) if with_draft else ())
    out_specs = tuple(_col(o.shape[1]) for o in out_shape)
    out = pl.pallas_call(
        kernel, grid=(B, nT), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, compiler_params=_compiler_params(backend),
        name="verify_stats",
    )(*([tl, dl] if with_draft else [tl]))
    out = tuple(o[:, :, 0] for o in out)
    if greedy:
        return {"amax": out[1]}
    return dict(zip(("m_t", "s_t", "m_d", "s_d"), out, strict=False))


def residual_pass(tl, draft_src, *, mode, x, lse_t, lse_d, c, seeds, inv_t, tile,
                  interpret=False, backend="tpu"):
    """Kernel version of `reference.residual_pass` (same arguments and results)."""
    B, G1, V = tl.shape
    G = G1 - 1
    nT = pl.cdiv(V, tile)
    has_src = mode != "onehot"
    if lse_d is None:
        lse_d = jnp.zeros((B, G), jnp.float32)

    def kernel(*refs):
        if has_src:
            tl_ref, src_ref, x_ref, lt_ref, ld_ref, c_ref, seed_ref, *outs = refs
        else:
            tl_ref, x_ref, lt_ref, ld_ref, c_ref, seed_ref, *outs = refs
            src_ref = None
        mass_ref, rm_ref, ri_ref, fm_ref, fi_ref = outs
        j = pl.program_id(1)
        y = tiles.lane_ids(j, tile)

        @pl.when(j == 0)
        def _():
            mass_ref[0] = jnp.zeros((G1, 1), jnp.float32)
            for m_ref, i_ref in ((rm_ref, ri_ref), (fm_ref, fi_ref)):
                m_ref[0] = jnp.full((G1, 1), tiles.NEG_INF, jnp.float32)
                i_ref[0] = jnp.zeros((G1, 1), jnp.int32)

        zt = tiles.scaled(tl_ref[0], y, V, inv_t)
        raw = None if src_ref is None else src_ref[0]
        q = tiles.draft_tile(mode, raw, x_ref[0], ld_ref[0], y, V, inv_t)
        mass, rm, ri, fm, fi = tiles.residual_tile(zt, lt_ref[0], c_ref[0], q, seed_ref[0], y)
        mass_ref[0] = mass_ref[0] + mass
        rm_ref[0], ri_ref[0] = tiles.fold_argmax(rm_ref[0], ri_ref[0], rm, ri)
        fm_ref[0], fi_ref[0] = tiles.fold_argmax(fm_ref[0], fi_ref[0], fm, fi)

    col = lambda a: a[:, :, None]  # noqa: E731
    args = [tl] + ([draft_src] if has_src else []) + [
        col(x.astype(jnp.int32)), col(lse_t), col(lse_d), col(c),
        seeds.astype(jnp.uint32).reshape(B, 1, 1)]
    in_specs = [_tile_spec(G1, tile)] + ([_tile_spec(G, tile)] if has_src else []) + [
        _col(G), _col(G1), _col(G), _col(G1), _col(1)]
    f32 = jax.ShapeDtypeStruct((B, G1, 1), jnp.float32)
    i32 = jax.ShapeDtypeStruct((B, G1, 1), jnp.int32)
    out_shape = (f32, f32, i32, f32, i32)
    out = pl.pallas_call(
        kernel, grid=(B, nT), in_specs=in_specs, out_specs=tuple(_col(G1) for _ in out_shape),
        out_shape=out_shape, interpret=interpret, compiler_params=_compiler_params(backend),
        name="verify_residual",
    )(*args)
    return tuple(o[:, :, 0] for o in out)



# ----------------------------------------------------------------------------- GPU (Triton)
# Triton runs grid points in parallel, so a row's tiles cannot fold into a revisited
# output block there. Instead one program per (row, position) loops over the V tiles of
# its [V] row; every array is [1, tile] (Triton wants power-of-two shapes).


def _row_spec(V, rows, tile):
    """BlockSpec of one position's full row of a [B, rows, V] array, padded to whole
    tiles (Pallas pads a block that overhangs the array; lanes past V are masked);
    program (b, i) reads position min(i, rows - 1) (the bonus position has no draft row)."""
    return pl.BlockSpec((1, 1, pl.cdiv(V, tile) * tile),
                        lambda b, i: (b, jnp.minimum(i, rows - 1), 0))


def _pos_spec(rows):
    return pl.BlockSpec((1, 1, 1), lambda b, i: (b, jnp.minimum(i, rows - 1), 0))


def _row_tile(ref, j, tile):
    return ref[0, :, pl.ds(j * tile, tile)]


def stats_pass_rows(tl, dl, *, inv_t, tile, greedy, interpret=False, backend="triton"):
    """`stats_pass` with a (B, G+1) grid and the V loop inside the kernel (GPU)."""
    B, G1, V = tl.shape
    nT = pl.cdiv(V, tile)
    with_draft = dl is not None and not greedy

    def kernel(*refs):
        neg = jnp.full((1, 1), tiles.NEG_INF, jnp.float32)
        zero = jnp.zeros((1, 1), jnp.float32)
        if greedy:
            tl_ref, am_ref, ai_ref = refs

            def body(j, carry):
                y = tiles.lane_ids(j, tile)
                zt = tiles.scaled(_row_tile(tl_ref, j, tile), y, V, 1.0)
                return tiles.fold_argmax(*carry, *tiles.tile_argmax(zt, y))

            m, i = jax.lax.fori_loop(0, nT, body, (neg, jnp.zeros((1, 1), jnp.int32)))
            am_ref[0], ai_ref[0] = m, i
            return
        tl_ref, *rest = refs
        dl_ref = rest.pop(0) if with_draft else None

        def body(j, carry):
            y = tiles.lane_ids(j, tile)
            out = tiles.fold_max_sumexp(*carry[:2], *tiles.tile_max_sumexp(
                tiles.scaled(_row_tile(tl_ref, j, tile), y, V, inv_t)))
            if dl_ref is None:
                return out
            return out + tiles.fold_max_sumexp(*carry[2:], *tiles.tile_max_sumexp(
                tiles.scaled(_row_tile(dl_ref, j, tile), y, V, inv_t)))

        carry = (neg, zero) * (2 if with_draft else 1)
        for ref, val in zip(rest, jax.lax.fori_loop(0, nT, body, carry), strict=True):
            ref[0] = val

    in_specs = [_row_spec(V, G1, tile)] + ([_row_spec(V, G1 - 1, tile)] if with_draft else [])
    f32 = jax.ShapeDtypeStruct((B, G1, 1), jnp.float32)
    if greedy:
        out_shape = (f32, jax.ShapeDtypeStruct((B, G1, 1), jnp.int32))
    else:
        out_shape = (f32, f32) * (2 if with_draft else 1)
    out = pl.pallas_call(
        kernel, grid=(B, G1), in_specs=in_specs,
        out_specs=tuple(_pos_spec(G1) for _ in out_shape), out_shape=out_shape,
        interpret=interpret, compiler_params=_compiler_params(backend),
        name="verify_stats_rows",
    )(*([tl, dl] if with_draft else [tl]))
    out = tuple(o[:, :, 0] for o in out)
    if greedy:
        return {"amax": out[1]}
    # The draft rows' program G read position G-1 again: drop that duplicate.
    names = ("m_t", "s_t", "m_d", "s_d")
    return {n: (o[:, :-1] if n.endswith("_d") else o) for n, o in zip(names, out, strict=False)}


def residual_pass_rows(tl, draft_src, *, mode, x, lse_t, lse_d, c, seeds, inv_t, tile,
                       interpret=False, backend="triton"):
    """`residual_pass` with a (B, G+1) grid and the V loop inside the kernel (GPU)."""
    B, G1, V = tl.shape
    G = G1 - 1
    nT = pl.cdiv(V, tile)
    has_src = mode != "onehot"
    if lse_d is None:
        lse_d = jnp.zeros((B, G), jnp.float32)

    def kernel(*refs):
        if has_src:
            tl_ref, src_ref, x_ref, lt_ref, ld_ref, c_ref, seed_ref, *outs = refs
        else:
            tl_ref, x_ref, lt_ref, ld_ref, c_ref, seed_ref, *outs = refs
            src_ref = None
        is_draft_row = pl.program_id(1) < G
        lt, cc, seed = lt_ref[0], c_ref[0], seed_ref[0]

        def body(j, carry):
            y = tiles.lane_ids(j, tile)
            zt = tiles.scaled(_row_tile(tl_ref, j, tile), y, V, inv_t)
            raw = None if src_ref is None else _row_tile(src_ref, j, tile)
            q = tiles.draft_tile(mode, raw, x_ref[0], ld_ref[0], y, V, inv_t)
            q = jnp.where(is_draft_row, q, 0.0)
            mass, rm, ri, fm, fi = tiles.residual_rows(zt, lt, cc, q, seed, y)
            cm, crm, cri, cfm, cfi = carry
            return (cm + mass, *tiles.fold_argmax(crm, cri, rm, ri),
                    *tiles.fold_argmax(cfm, cfi, fm, fi))

        neg = jnp.full((1, 1), tiles.NEG_INF, jnp.float32)
        zi = jnp.zeros((1, 1), jnp.int32)
        res = jax.lax.fori_loop(0, nT, body, (jnp.zeros((1, 1), jnp.float32), neg, zi, neg, zi))
        for ref, val in zip(outs, res, strict=True):
            ref[0] = val

    col = lambda a: a[:, :, None]  # noqa: E731
    args = [tl] + ([draft_src] if has_src else []) + [
        col(x.astype(jnp.int32)), col(lse_t), col(lse_d), col(c),
        seeds.astype(jnp.uint32).reshape(B, 1, 1)]
    in_specs = [_row_spec(V, G1, tile)] + ([_row_spec(V, G, tile)] if has_src else []) + [
        _pos_spec(G), _pos_spec(G1), _pos_spec(G), _pos_spec(G1),
        pl.BlockSpec((1, 1, 1), lambda b, i: (b, 0, 0))]
    f32 = jax.ShapeDtypeStruct((B, G1, 1), jnp.float32)
    i32 = jax.ShapeDtypeStruct((B, G1, 1), jnp.int32)
    out_shape = (f32, f32, i32, f32, i32)
    out = pl.pallas_call(
        kernel, grid=(B, G1), in_specs=in_specs,
        out_specs=tuple(_pos_spec(G1) for _ in out_shape), out_shape=out_shape,
        interpret=interpret, compiler_params=_compiler_params(backend),
        name="verify_residual_rows",
    )(*args)
    return tuple(o[:, :, 0] for o in out)
