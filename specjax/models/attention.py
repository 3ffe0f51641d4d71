"""Attention of a few new queries into a KV cache, at a cost that follows the context.

The cache is static-shape (capacity S, `specjax.models.kv_cache`), but a row only ever needs
its slots up to its current position. `cache_attention` reads the cache in chunks of
`chunk` slots inside a `lax.fori_loop` whose trip count is the number of chunks holding
any visible slot of any row (flash-decoding's online softmax over chunks: a running
max, sum and weighted value per query), so decoding with a 160-token context costs the
same at capacity 160 and at capacity 32k, and a long prefill needs scores for one chunk
at a time ([B, K, Q, chunk] instead of [B, K, Q, S]).

When S <= chunk there is one chunk and the plain softmax path runs (no loop). The
attention of a row depends only on that row (a fully masked chunk is an exact no-op),
but neither path makes a one-token and an 8-token forward bitwise equal in general:
with bf16 matmuls on XLA:CPU the demo target's row 0 differed in 2 of 42 positions
unchunked and 1 of 42 chunked (positions 240-261 and 495-514). In the exact mode
(`cache_attention(..., rows=)`, `specjax.models.invariant`) the query rows go in tiles of
`rows`, reading chunks of `invariant.CHUNK` slots from slot 0 whatever the capacity,
which makes them equal. The
Pallas kernel in `pallas_kernels/attention` does the same on TPU/GPU with per-row tile
skipping; this is the jnp path every backend can run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import invariant

DEFAULT_CHUNK = 256
NEG = -1e30


def cache_attention(q, k, v, q_pos, *, chunk: int = DEFAULT_CHUNK, dot_dtype=None,
                    layer=None, rows: int | None = None):
    """Attention of folded queries over one layer of a KV cache, slot <= query position.

    Args:
      q: [B, K, Q, H] queries, folded per KV head (GQA: Q = R * T query rows), already
        rotated; any float dtype.
      k, v: [B, K, S, H] one layer of the cache, with the new tokens already written;
        or the whole layer-major cache [L, B, K, S, H] with `layer` (an int or i32
        scalar) naming the layer: chunks are then sliced from it in place (slicing the
        layer first would copy all S slots of it on XLA:CPU, every step).
      q_pos: i32[B, Q] the absolute position of each query row; it sees slots
        0..q_pos (a causal mask by position, as `specjax.models.model` uses). Every q_pos must
        be >= 0 (slot 0 is visible to every query, so no row's softmax is empty).
      chunk: slots per chunk (> 0). S <= chunk: one unchunked pass.
      dot_dtype: dtype of the two attention dots (default: q's); scores, softmax and
        accumulation are f32.
      rows: None, or the exact mode's tile (`specjax.models.invariant`): the Q query rows
        go in tiles of `rows`, each read in chunks of `invariant.CHUNK` slots from slot 0
        (ValueError unless S is a multiple of CHUNK).

    Returns:
      f32 [B, K, Q, H].

    Cost: ceil((max q_pos + 1) / chunk) chunks of [B, K, Q, chunk] scores; slots past
    the largest visible position are never read. Raises ValueError on chunk <= 0.
    """
    if chunk <= 0:
        raise ValueError(f"chunk={chunk} must be positive")
    if rows is not None:  # the exact mode (specjax.models.invariant)
        if k.shape[-2] % invariant.CHUNK:
            raise ValueError(f"batch-invariant attention needs a cache capacity that is a "
                             f"multiple of {invariant.CHUNK}, not {k.shape[-2]}")

        def one(tile):  # q [rows, B, K, H], q_pos [rows, B]: chunks of CHUNK slots from 0
            qi, pi = tile
            m, l, acc = cache_attention_stats(jnp.moveaxis(qi, 0, 2), k, v, pi.T,
                                              chunk=invariant.CHUNK, dot_dtype=dot_dtype,
                                              layer=layer)
            return jnp.moveaxis(acc / l[..., None], 2, 0)  # [rows, B, K, H]

        out = invariant.per_row(one, (jnp.moveaxis(q, 2, 0), q_pos.T), rows)  # [Q,B,K,H]
        return jnp.moveaxis(out, 0, 2)
    S = k.shape[-2]
    qd, rows, scores_of, values_of = _parts(q, q_pos, dot_dtype, layer)

    if S <= chunk:
        k, v = rows(k, 0, S), rows(v, 0, S)
        probs = jax.nn.softmax(scores_of(k, jnp.arange(S)), axis=-1)
        return values_of(probs, v)

    m, l, acc = _chunk_loop(qd, k, v, q_pos, chunk, rows, scores_of, values_of)
    return acc / l[..., None]


def _chunk_loop(qd, k, v, q_pos, chunk, rows, scores_of, values_of, q_lo=None):
    """Online-softmax statistics (m, l, acc) f32 [B,K,Q], [B,K,Q], [B,K,Q,H] over the
    chunks that hold a visible slot (see `cache_attention`); with q_lo i32[B,Q] (the
    first visible slot of each query) the chunks wholly below every query's q_lo are
    skipped too."""
    B, K, Q, H = qd.shape
    S = k.shape[-2]
    n_chunks = (jnp.max(q_pos) + chunk) // chunk  # chunks holding a visible slot
    n_chunks = jnp.clip(n_chunks, 1, -(-S // chunk))
    first = 0 if q_lo is None else jnp.clip(jnp.min(q_lo) // chunk, 0, n_chunks - 1)

    def body(i, carry):
        m, l, acc = carry
        # The last chunk may overhang S: its start is clamped to S - chunk, and slots
        # below i * chunk (already folded in by the previous chunk) are masked out.
        start = jnp.minimum(i * chunk, S - chunk)
        kc, vc = rows(k, start, chunk), rows(v, start, chunk)
        slots = start + jnp.arange(chunk)
        s = scores_of(kc, slots)
        s = jnp.where(slots[None, None, None, :] >= i * chunk, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l_new = alpha * l + jnp.sum(p, axis=-1)
        acc_new = alpha[..., None] * acc + values_of(p, vc)
        return m_new, l_new, acc_new

    init = (jnp.full((B, K, Q), NEG, jnp.float32), jnp.zeros((B, K, Q), jnp.float32),
            jnp.zeros((B, K, Q, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, n_chunks, body, init)
    return m, l, acc


def cache_attention_stats(q, k, v, q_pos, *, chunk: int = DEFAULT_CHUNK, dot_dtype=None,
                          layer=None, q_lo=None):
    """The unnormalised online-softmax statistics of `cache_attention` (same arguments),
    for callers that merge several key/value sources under one softmax. q_lo: None, or
    i32[B,Q] the first visible slot of each query (a window: slots q_lo..q_pos; the
    chunks below every query's q_lo are not read).

    Returns (m, l, acc): f32 [B,K,Q] running max of the scores, f32 [B,K,Q] sum of
    exp(score - m), f32 [B,K,Q,H] sum of exp(score - m) * value; the attention is
    acc / l. Always chunked (a single chunk when S <= chunk)."""
    if chunk <= 0:
        raise ValueError(f"chunk={chunk} must be positive")
    chunk = min(chunk, k.shape[-2])
    qd, rows, scores_of, values_of = _parts(q, q_pos, dot_dtype, layer, q_lo)
    return _chunk_loop(qd, k, v, q_pos, chunk, rows, scores_of, values_of, q_lo)


def _parts(q, q_pos, dot_dtype, layer, q_lo=None):
    """(q in the dot dtype, rows(x, start, size) -> [B,K,size,H] slots of the layer,
    scores_of(k_chunk, slots) -> masked f32 scores [B,K,Q,size], values_of(p, v_chunk)
    -> f32 [B,K,Q,H])."""
    dt = dot_dtype or q.dtype
    B, K, Q, H = q.shape
    scale = np.float32(1.0 / np.sqrt(H))
    qd = q.astype(dt)

    def rows(x, start, size):
        if layer is None:
            return jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)
        zero = jnp.zeros((), jnp.int32)
        idx = (jnp.asarray(layer, jnp.int32), zero, zero, jnp.asarray(start, jnp.int32), zero)
        return jax.lax.dynamic_slice(x, idx, (1, B, K, size, H))[0]

    def scores_of(kc, slots):
        s = jnp.einsum("BKQH,BKSH->BKQS", qd, kc.astype(dt),
                       preferred_element_type=jnp.float32) * scale
        seen = slots[None, None, None, :] <= q_pos[:, None, :, None]
        if q_lo is not None:
            seen = seen & (slots[None, None, None, :] >= q_lo[:, None, :, None])
        return jnp.where(seen, s, NEG)

    def values_of(p, vc):
        return jnp.einsum("BKQS,BKSH->BKQH", p.astype(dt), vc.astype(dt),
                          preferred_element_type=jnp.float32)

    return qd, rows, scores_of, values_of
