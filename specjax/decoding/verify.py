"""Verification rules: greedy, token-level rejection sampling, block verification.

All three take the same arguments, for a batch of B rows and draft length G:
  draft: i32[B,G]     draft tokens x_1..x_G
  q:     f32[B,G,V]   drafter distributions q_1..q_G (filtered; one-hot if greedy)
  p:     f32[B,G+1,V] target distributions p_1..p_{G+1} (filtered; p_{G+1} = bonus)
  key:   PRNG key
and return `Verdict(num_accepted i32[B] in 0..G, next_token i32[B])`: the row
emits x_1..x_tau and then `next_token` (the correction, or the bonus if tau == G).

Rules exactly as docs/design.md section 4 states them:
- greedy: longest prefix with x_i == argmax p_i.
- token: Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1); Chen et al. 2023.
- block: Sun et al., "Block Verification Accelerates Speculative Decoding"
  (arXiv 2403.10444, Algorithm 2).

`Verdict`'s fields carry jaxtyping shape annotations: documentation, not checked at run
time in the library (tests/core/test_shapes.py checks real verdicts).
"""

# ruff: noqa: F722  (jaxtyping's shape strings are not Python expressions)

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax.core.drafter import take_rows
from specjax.core.sampling import sample


class Verdict(NamedTuple):
    num_accepted: Int[Array, " B"]  # tau in 0..G
    next_token: Int[Array, " B"]  # the correction, or the bonus if tau == G


def _token_probs(dist, draft):
    """dist[b, i, draft[b, i]] for dist [B,G,V], draft i32[B,G] -> f32[B,G]."""
    return jnp.take_along_axis(dist, draft[..., None], axis=-1)[..., 0]


def normalize_or(residual, fallback):
    """norm(residual) per row; rows whose residual mass is 0 use `fallback`."""
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), fallback)


def verify_greedy(draft, q, p, key) -> Verdict:
    """Accept the longest prefix with x_i == argmax p_i; emit argmax p_{tau+1}."""
    del q, key
    G = draft.shape[1]
    target = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [B,G+1]
    match = draft == target[:, :G]
    tau = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    return Verdict(tau, take_rows(target, tau))


def verify_token(draft, q, p, key) -> Verdict:
    """Token-level rejection sampling: accept x_i w.p. min(1, p_i(x_i)/q_i(x_i)); at the
    first rejection sample norm(max(p_i - q_i, 0)); if all accepted, the bonus from p_{G+1}."""
    G = draft.shape[1]
    k_accept, k_next = jax.random.split(key)
    px, qx = _token_probs(p[:, :G], draft), _token_probs(q, draft)
    u = jax.random.uniform(k_accept, px.shape)
    accept = u * qx < px  # u < p/q without dividing; never accepts p(x) = 0
    tau = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)  # q_{G+1} = 0: bonus = p
    p_t, q_t = take_rows(p, tau), take_rows(q_pad, tau)
    dist = normalize_or(jnp.maximum(p_t - q_t, 0.0), p_t)
    return Verdict(tau, sample(k_next, dist))


def block_weights(draft, q, p):
    """Block verification's clipped ratios w and acceptance weights h, both f32[B,G].

    w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)), w_0 = 1;
    h_i = A_i / (A_i + 1 - w_i) with A_i = sum_y max(w_i p_{i+1}(y) - q_{i+1}(y), 0) for
    i < G (h_i = 1 where the denominator is 0), and h_G = w_G.
    """
    G = draft.shape[1]
    px, qx = _token_probs(p[:, :G], draft), _token_probs(q, draft)
    ratio = jnp.where(qx > 0, px / jnp.where(qx > 0, qx, 1.0), jnp.where(px > 0, jnp.inf, 0.0))
    ws, w = [], jnp.ones_like(px[:, 0])
    for i in range(G):  # G is static and small
        w = jnp.minimum(1.0, w * ratio[:, i])
        ws.append(w)
    w = jnp.stack(ws, axis=1)  # [B,G]
    if G > 1:
        a = jnp.sum(jnp.maximum(w[:, :-1, None] * p[:, 1:G] - q[:, 1:G], 0.0), axis=-1)
        denom = a + (1.0 - w[:, :-1])  # add 1 - w first: h never rounds above 1
        h = jnp.where(denom > 0, a / jnp.where(denom > 0, denom, 1.0), 1.0)
        h = jnp.concatenate([h, w[:, -1:]], axis=1)
    else:
        h = w
    return w, h


def verify_block(draft, q, p, key) -> Verdict:
    """Block verification: tau = the largest i with u_i <= h_i (0 if none); next token
    from p_{G+1} if tau == G, else from norm(max(w_tau p_{tau+1} - q_{tau+1}, 0))."""
    G = draft.shape[1]
    k_accept, k_next = jax.random.split(key)
    w, h = block_weights(draft, q, p)
    u = jax.random.uniform(k_accept, h.shape)
    passed = u < h  # u_i <= h_i up to a measure-zero set; never passes h = 0
    idx = jnp.arange(1, G + 1, dtype=jnp.int32)
    tau = jnp.max(jnp.where(passed, idx[None, :], 0), axis=1).astype(jnp.int32)
    w0 = jnp.concatenate([jnp.ones_like(w[:, :1]), w], axis=1)  # w_0..w_G
    q_pad = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)
    p_t, q_t, w_t = take_rows(p, tau), take_rows(q_pad, tau), take_rows(w0, tau)
    dist = normalize_or(jnp.maximum(w_t[:, None] * p_t - q_t, 0.0), p_t)
    return Verdict(tau, sample(k_next, dist))


VERIFIERS = {"greedy": verify_greedy, "token": verify_token, "block": verify_block}
