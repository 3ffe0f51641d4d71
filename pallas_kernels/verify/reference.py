"""jnp reference of the verification kernel's two vocabulary passes.

The same tile functions as the kernel (`tiles.py`), folded over the tiles of each row in
the same order by `lax.fori_loop`, so `impl="reference"` and `impl="pallas"` give
identical accepted lengths and next tokens for the same key. It pads V up to a multiple
of the tile (a copy the kernel does not make): it is the portable path, not the fast one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.verify import tiles


def _pad(x, Vp, value):
    V = x.shape[-1]
    return x if V == Vp else jnp.pad(x, ((0, 0), (0, 0), (0, Vp - V)), constant_values=value)


def _tile(x, j, tile):
    return jax.lax.dynamic_slice_in_dim(x, j * tile, tile, axis=-1)


def stats_pass(tl, dl, *, inv_t, tile, greedy):
    """Per position: target (max, sumexp) of logits * inv_t, or the target argmax when
    greedy; the draft's (max, sumexp) when draft logits `dl` are given.

    tl: [B, G+1, V] target logits; dl: [B, G, V] draft logits or None.
    Returns a dict of [B, R] arrays: "m_t", "s_t" (and "m_d", "s_d"), or "amax".
    """
    V = tl.shape[-1]
    nT = -(-V // tile)
    Vp = nT * tile

    def row(tl_b, dl_b):
        G1 = tl_b.shape[0]

        def body(j, carry):
            y = tiles.lane_ids(j, tile)
            zt = tiles.scaled(_tile(tl_b, j, tile), y, V, 1.0 if greedy else inv_t)
            if greedy:
                return tiles.fold_argmax(*carry, *tiles.tile_argmax(zt, y))
            m, s = tiles.fold_max_sumexp(*carry[:2], *tiles.tile_max_sumexp(zt))
            if dl_b is None:
                return m, s
            zd = tiles.scaled(_tile(dl_b, j, tile), y, V, inv_t)
            return (m, s, *tiles.fold_max_sumexp(*carry[2:], *tiles.tile_max_sumexp(zd)))

        def init(R):
            return (jnp.full((R, 1), tiles.NEG_INF, jnp.float32),
                    jnp.zeros((R, 1), jnp.float32))

        if greedy:
            carry = (jnp.full((G1, 1), tiles.NEG_INF, jnp.float32),
                     jnp.zeros((G1, 1), jnp.int32))
        else:
            carry = init(G1) + (() if dl_b is None else init(G1 - 1))
        out = jax.lax.fori_loop(0, nT, body, carry)
        return tuple(o[:, 0] for o in out)

    tl_p = _pad(tl, Vp, 0)
    dl_p = None if dl is None else _pad(dl, Vp, 0)
    if dl_p is None:
        out = jax.vmap(lambda a: row(a, None))(tl_p)
    else:
        out = jax.vmap(row)(tl_p, dl_p)
    if greedy:
        return {"amax": out[1]}
    names = ("m_t", "s_t", "m_d", "s_d")
    return dict(zip(names, out, strict=False))


def residual_pass(tl, draft_src, *, mode, x, lse_t, lse_d, c, seeds, inv_t, tile):
    """Residual masses and exponential races per candidate position j = 0..G.

    tl: [B, G+1, V] target logits; draft_src: [B, G, V] draft probabilities (mode
    "probs") or logits ("logits"), None for "onehot" (then q_j is one-hot at x[:, j]);
    x: i32[B, G]; lse_t: f32[B, G+1]; lse_d: f32[B, G] or None; c: f32[B, G+1];
    seeds: u32[B]. Returns f32/i32 [B, G+1] arrays (mass, race_max, race_idx,
    fallback_max, fallback_idx), as `tiles.residual_tile` defines them.
    """
    V = tl.shape[-1]
    nT = -(-V // tile)
    Vp = nT * tile

    def row(tl_b, src_b, x_b, lse_t_b, lse_d_b, c_b, seed_b):
        G1 = tl_b.shape[0]

        def body(j, carry):
            y = tiles.lane_ids(j, tile)
            zt = tiles.scaled(_tile(tl_b, j, tile), y, V, inv_t)
            raw = None if src_b is None else _tile(src_b, j, tile)
            q = tiles.draft_tile(mode, raw, x_b[:, None], lse_d_b[:, None], y, V, inv_t)
            mass, rm, ri, fm, fi = tiles.residual_tile(zt, lse_t_b[:, None], c_b[:, None], q,
                                                       seed_b.reshape(1, 1), y)
            cm, crm, cri, cfm, cfi = carry
            return (cm + mass, *tiles.fold_argmax(crm, cri, rm, ri),
                    *tiles.fold_argmax(cfm, cfi, fm, fi))

        neg = jnp.full((G1, 1), tiles.NEG_INF, jnp.float32)
        zero_i = jnp.zeros((G1, 1), jnp.int32)
        carry = (jnp.zeros((G1, 1), jnp.float32), neg, zero_i, neg, zero_i)
        out = jax.lax.fori_loop(0, nT, body, carry)
        return tuple(o[:, 0] for o in out)

    tl_p = _pad(tl, Vp, 0)
    B, G1 = tl.shape[:2]
    src_p = None if draft_src is None else _pad(draft_src, Vp, 0)
    if lse_d is None:
        lse_d = jnp.zeros((B, G1 - 1), jnp.float32)
    if src_p is None:
        return jax.vmap(lambda a, *r: row(a, None, *r))(tl_p, x, lse_t, lse_d, c, seeds)
    return jax.vmap(row)(tl_p, src_p, x, lse_t, lse_d, c, seeds)

