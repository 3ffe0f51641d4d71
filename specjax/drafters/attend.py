"""Attention of a drafter's queries over several key/value sources under ONE softmax:
a long memory or cache read up to a per-query limit (`Limit`), the queries' own block
(`Blocks`), a short source with a boolean mask, and the training-time-test diagonal.

Shapes follow docs/design.md section 2; keys and values are [B,K,S,H] like one layer of
the target cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.drafter import AttentionKernel
from specjax.models.attention import DEFAULT_CHUNK, cache_attention_stats

NEG = -1e30


class Limit(NamedTuple):
    """A source mask given by position: slot s is visible to query t of row b iff
    s <= pos[b, t] (pos i32[B,T]), and, with a window, s >= lo[b, t] (lo i32[B,T] or
    None: `window_lo`). Long sources given this way are read in chunks from the smallest
    lo to the largest visible slot (`specjax.models.attention`), so their cost follows the
    context, or the window; with a `kernel` an unwindowed Limit source goes through it
    instead (a windowed one stays on the jnp path: the kernel has no lower bound)."""

    pos: jax.Array
    lo: jax.Array | None = None


def window_lo(pos, window: int | None):
    """The first visible slot of a draft window of `window` slots ending at pos i32[...]
    (None: no window): pos - window + 1, at least 0. `--draft-window` (docs/long_context.md)."""
    if window is None:
        return None
    return jnp.maximum(pos - (window - 1), 0).astype(jnp.int32)


def windowed(pos, window: int | None) -> Limit:
    """Limit(pos) read through a draft window of `window` slots (None: all of them)."""
    return Limit(pos, window_lo(pos, window))


class Blocks(NamedTuple):
    """A source of the queries' own keys (k, v [B,T,K,H], like a `diag` entry) packed in
    aligned blocks of `size` entries: query t sees entry u iff t // size == u // size
    (bidirectional inside a block, nothing across blocks; T a multiple of size), and with
    `causal` only if also u <= t (JetSpec's block-causal attention). The block-wise
    objective's packed blocks: it costs T * size scores, not T * T."""

    size: int
    causal: bool = False


ATTEND_CHUNK = DEFAULT_CHUNK  # sources with S > this and a Limit mask are chunked

def attend(q, sources: Sequence[tuple], diag: Sequence[tuple] = (),
           kernel: AttentionKernel | None = None):
    """Attention of q [B,T,N,H] over several key/value sources under ONE softmax.

    Args:
      sources: (k, v, mask) each. k, v [B,K,S,H] (any S per source) with mask a
        bool[B,T,S] or a `Limit` (slots <= pos[b, t] visible; a Limit source longer than
        ATTEND_CHUNK slots is read in chunks up to its largest visible slot, and with a
        `kernel` every Limit source goes through it); or the queries' own k, v [B,T,K,H]
        with mask a `Blocks` (aligned bidirectional blocks).
      diag: (k [B,T,K,H], v [B,T,K,H]) each: query t sees only entry t of each (the
        training-time-test diagonal: later steps at the same position).
      kernel: None (the jnp path) or fn(q [B,T,N,H], k [B,K,S,H], v [B,K,S,H], limit
        i32[B,T]) -> (o [B,T,N,H], lse f32[B,T,N]), where query t sees slots
        s < limit[b, t] and lse is the log-sum-exp of its scores (-inf when it sees
        nothing), such as `pallas_kernels.attention.packed_attention`: it computes every
        `Limit` source, and the other sources are merged with it by log-sum-exp. The
        caller's static configuration picks it (`specjax.decoding.kernel_policy`), so a jit cache
        entry never mixes the two paths.
    Returns: [B,T,N*H] in q's dtype. Scores and softmax in f32. A query with no visible
      key at all returns zeros (or, on the one-softmax path, the mean of the values it
      masked); callers never use it.
    """
    B, T, N, H = q.shape
    K = (sources[0][0].shape[1] if sources else diag[0][0].shape[2])
    if sources and isinstance(sources[0][2], Blocks):
        K = sources[0][0].shape[2]
    R = N // K
    scale = 1.0 / np.sqrt(H)
    qg = q.reshape(B, T, K, R, H)
    scores, values, parts, kernel_parts = [], [], [], 0
    for k, v, mask in sources:
        if isinstance(mask, Blocks):
            parts.append(_blocks_part(qg, k, v, mask.size, scale, mask.causal))
            continue
        if isinstance(mask, Limit):
            if kernel is not None and mask.lo is None:
                o, lse = kernel(q, k, v, jnp.maximum(mask.pos + 1, 0).astype(jnp.int32))
                lse = lse.reshape(B, T, K, R).transpose(0, 2, 3, 1)  # [B,K,R,T]
                parts.append((lse, jnp.where(jnp.isfinite(lse), 1.0, 0.0),
                              o.astype(jnp.float32).reshape(B, T, K, R, H)))
                kernel_parts += 1
                continue
            if k.shape[2] > ATTEND_CHUNK:
                qf = qg.transpose(0, 2, 3, 1, 4).reshape(B, K, R * T, H)  # row r*T + t
                lo = None if mask.lo is None else jnp.tile(mask.lo, (1, R))
                m, l, acc = cache_attention_stats(qf, k, v, jnp.tile(mask.pos, (1, R)),
                                                  chunk=ATTEND_CHUNK, dot_dtype=q.dtype,
                                                  q_lo=lo)
                parts.append((m.reshape(B, K, R, T), l.reshape(B, K, R, T),
                              acc.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)))
                continue
            slots = jnp.arange(k.shape[2])[None, None, :]
            lo = mask.lo
            mask = slots <= mask.pos[:, :, None]
            if lo is not None:
                mask = mask & (slots >= lo[:, :, None])
        s = jnp.einsum("BTKRH,BKSH->BKRTS", qg, k, preferred_element_type=jnp.float32) * scale
        scores.append(jnp.where(mask[:, None, None], s, NEG))
        values.append(("full", v))
    for k, v in diag:
        s = jnp.einsum("BTKRH,BTKH->BKRT", qg, k, preferred_element_type=jnp.float32) * scale
        scores.append(s[..., None])
        values.append(("diag", v))
    if not parts:
        probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
        return _weighted(probs, scores, values, q.dtype).reshape(B, T, N * H)
    if len(parts) == 1 and not scores and kernel_parts == 1:
        return parts[0][2].astype(q.dtype).reshape(B, T, N * H)  # normalised already
    # Merge the parts and the short sources under one softmax: each contributes
    # (max m, sum exp(s - m), sum exp(s - m) v); rescale all to the joint max.
    if scores:
        cat = jnp.concatenate(scores, axis=-1)
        m = jnp.max(cat, axis=-1)
        p = jnp.exp(cat - m[..., None])
        parts.append((m, jnp.sum(p, axis=-1),
                      _weighted(p, scores, values, jnp.float32)))
    top = parts[0][0]
    for m, _, _ in parts[1:]:
        top = jnp.maximum(top, m)
    # only for range: the result does not depend on it (nor, then, does its gradient)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    num, den = 0.0, 0.0
    for m, l, acc in parts:
        w = jnp.exp(m - top)  # [B,K,R,T]; m = -inf (nothing seen): 0
        num = num + acc * w.transpose(0, 3, 1, 2)[..., None]
        den = den + l * w
    den = jnp.where(den > 0, den, 1.0)  # nothing visible at all: zeros, not NaN
    out = num / den.transpose(0, 3, 1, 2)[..., None]
    return out.astype(q.dtype).reshape(B, T, N * H)


def _blocks_part(qg, k, v, size: int, scale, causal: bool = False):
    """(m, l, acc) of queries qg [B,T,K,R,H] over their own k, v [B,T,K,H] in aligned
    blocks of `size` (see `Blocks`; causal: entry u of a block only for queries t >= u):
    m, l f32[B,K,R,T], acc f32[B,T,K,R,H]."""
    B, T, K, R, H = qg.shape
    if T % size:
        raise ValueError(f"Blocks({size}): T={T} must be a multiple of the block size")
    A = T // size
    qb = qg.reshape(B, A, size, K, R, H)
    s = jnp.einsum("BATKRH,BAUKH->BKRATU", qb, k.reshape(B, A, size, K, H),
                   preferred_element_type=jnp.float32) * scale
    if causal:  # every query sees its own entry: m stays finite
        s = jnp.where(jnp.tril(jnp.ones((size, size), bool)), s, NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("BKRATU,BAUKH->BATKRH", p, v.reshape(B, A, size, K, H).astype(jnp.float32))
    return (m.reshape(B, K, R, T), jnp.sum(p, axis=-1).reshape(B, K, R, T),
            acc.reshape(B, T, K, R, H))


def _weighted(probs, scores, values, dtype):
    """sum over sources of probs [B,K,R,T,S_total] (split by each source's width) times
    its values -> [B,T,K,R,H]."""
    out, start = 0.0, 0
    for (how, v), s in zip(values, scores, strict=True):
        width = s.shape[-1]
        p = probs[..., start:start + width].astype(dtype)
        start += width
        if how == "full":
            out = out + jnp.einsum("BKRTS,BKSH->BTKRH", p, v)
        else:
            out = out + p[..., 0].transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :]
    return out
