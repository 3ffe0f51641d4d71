"""Per-tile math shared by the verification kernel and its jnp reference.

Both walk the vocabulary in tiles of `tile` lanes and fold each tile into running
per-position statistics in the same order, with the same operations, so the Pallas
kernel (`kernel.py`) and the jnp reference (`reference.py`) give identical results.
What is checked against an independent reference (specjax.decoding.verify and float64 numpy
enumeration, tests/kernels/test_pallas_verify.py) is the rule these statistics implement.

Arrays in a tile: rows are draft positions (G+1 target rows, G draft rows), lanes are
token ids y = j * tile + lane. Lanes at or past V are masked (padding or, in a kernel,
whatever lies past the array's end), never read into a result.

Randomness: the next token is drawn by an exponential race (argmax of log r(y) + g(y),
g Gumbel = -log E(y), E ~ Exp(1)), which is order-free over tiles. g(y) comes from a
counter-based hash of (row seed, y), so the kernel generates it per tile and never reads
a [B, V] noise array; the reference computes the same hash.
"""

from __future__ import annotations

import jax.numpy as jnp

NEG_INF = float("-inf")
INT_MAX = 2**31 - 1


def _mix32(x):
    """lowbias32 (C. Wellons' integer hash), u32 -> u32, a bijection with good avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel(seed, y):
    """f32 Gumbel noise g(y) = -log(-log U(seed, y)) with U in (0, 1).

    seed: u32 broadcastable to y; y: i32 token ids. The same (seed, y) always gives the
    same g; different y are (pseudo-)independent.
    """
    h = _mix32(_mix32(seed) ^ y.astype(jnp.uint32))
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / 16777216.0)  # (0, 1), 24 bits
    return -jnp.log(-jnp.log(u))


def lane_ids(j, tile):
    """i32[1, tile]: the token ids of tile j."""
    return j * tile + jnp.arange(tile, dtype=jnp.int32)[None, :]


def scaled(logits, y, V, inv_t):
    """f32[R, tile]: logits * inv_t, -inf on lanes y >= V."""
    return jnp.where(y < V, logits.astype(jnp.float32) * inv_t, NEG_INF)


def _safe(m):
    return jnp.where(m == NEG_INF, 0.0, m)


def tile_max_sumexp(z):
    """Per row of z f32[R, tile]: (max f32[R,1], sum exp(z - max) f32[R,1]); 0 sum for an
    all -inf row."""
    m = jnp.max(z, axis=-1, keepdims=True)
    return m, jnp.sum(jnp.exp(z - _safe(m)), axis=-1, keepdims=True)


def fold_max_sumexp(m, s, tm, ts):
    """Online log-sum-exp: folds a tile's (tm, ts) into the running (m, s)."""
    m_new = jnp.maximum(m, tm)
    base = _safe(m_new)
    return m_new, s * jnp.exp(m - base) + ts * jnp.exp(tm - base)


def tile_argmax(vals, y):
    """Per row of vals f32[R, tile]: (max f32[R,1], first lane id attaining it i32[R,1])."""
    m = jnp.max(vals, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(vals == m, y, INT_MAX), axis=-1, keepdims=True)
    return m, idx


def fold_argmax(best, best_idx, tm, tidx):
    """Keeps the running best unless the tile is strictly better (earlier tiles win ties,
    so the result is the first maximiser, as jnp.argmax)."""
    upd = tm > best
    return jnp.where(upd, tm, best), jnp.where(upd, tidx, best_idx)


def draft_tile(mode, raw, x, lse_d, y, V, inv_t):
    """f32[G, tile]: the drafter's filtered probabilities q_1..q_G on one tile.

    mode "probs": raw f32[G, tile] are the probabilities; "logits": raw are logits at the
    target's temperature, lse_d f32[G, 1] their log-sum-exp (of logits * inv_t);
    "onehot": q_i is one-hot at x f32/i32[G, 1] (raw unused, may be None).
    """
    if mode == "onehot":
        return (y == x).astype(jnp.float32)
    if mode == "probs":
        return jnp.where(y < V, raw.astype(jnp.float32), 0.0)
    return jnp.exp(scaled(raw, y, V, inv_t) - _safe(lse_d))


def residual_rows(zt, lse_t, c, q, seed, y):
    """One tile of the residual pass for R candidate rows.

    zt: f32[R, tile] scaled target logits (-inf past V); lse_t, c: f32[R, 1] their
    log-sum-exp and weights (token rule 1, block rule w_j); q: f32[R, tile] the draft
    probabilities of the same positions, or None for the bonus row (q = 0);
    seed: u32[1, 1]; y: i32[1, tile].
    Row j's residual is r_j = max(c_j p_j - q_j, 0). Returns per row (each [R, 1]): the
    residual mass sum_y r_j(y); the race (max f32, argmax i32) of log r_j(y) + g(y), a
    sample from norm(r_j); and the race of z_j(y) + g(y), a sample from p_j itself (the
    fallback for rows whose residual mass is 0).
    """
    r = c * jnp.exp(zt - _safe(lse_t))
    r = jnp.maximum(r if q is None else r - q, 0.0)
    g = gumbel(seed, y)
    mass = jnp.sum(r, axis=-1, keepdims=True)
    lr = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), NEG_INF)
    return (mass, *tile_argmax(lr + g, y), *tile_argmax(zt + g, y))


def residual_tile(zt, lse_t, c, q, seed, y):
    """`residual_rows` over all G+1 candidate rows of a tile: zt, lse_t, c have G+1 rows,
    q f32[G, tile] the draft rows (the last row, the bonus, has q = 0)."""
    G = q.shape[0]
    head = residual_rows(zt[:G], lse_t[:G], c[:G], q, seed, y)
    tail = residual_rows(zt[G:], lse_t[G:], c[G:], None, seed, y)
    return tuple(jnp.concatenate([a, b], axis=0) for a, b in zip(head, tail, strict=True))
