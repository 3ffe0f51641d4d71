"""drafters.attend.attend with an attention kernel and with `Blocks` sources.

- With kernel=fn every `Limit` source goes through fn(q, k, v, limit) ->
  (o, lse) and is merged with the other sources (bool masks, the queries' own blocks,
  the TTT diagonal) by log-sum-exp; the result and its gradient equal the one-softmax jnp
  path. fn here is a plain float64-free jnp implementation of the contract written for
  this test (not the code under test), so the merge itself is what is checked; the
  Pallas kernel behind the contract has its own tests (tests/kernels/test_pallas_packed.py).
- A `Blocks(size)` source equals the same keys under the block-diagonal bool mask.
- Queries that see nothing through the kernel (limit 0) give no NaN, in values or
  gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.attend import Blocks, Limit, attend


def contract_attention(q, k, v, limit):
    """(o [B,T,N,H], lse f32[B,T,N]) of q over slots s < limit[b, t] (jnp, explicit)."""
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    R = N // K
    kk = jnp.repeat(k, R, axis=1)  # [B,N,S,H]
    vv = jnp.repeat(v, R, axis=1)
    s = jnp.einsum("BTNH,BNSH->BNTS", q, kk) / np.sqrt(H)
    see = jnp.arange(S)[None, None, :] < limit[:, :, None]  # [B,T,S]
    s = jnp.where(see[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(see[:, None], jnp.exp(s - m_safe), 0.0)
    den = jnp.sum(p, axis=-1)
    o = jnp.einsum("BNTS,BNSH->BTNH", p, vv) / jnp.where(den > 0, den, 1.0).transpose(
        0, 2, 1)[..., None]
    lse = jnp.where(den > 0, jnp.log(jnp.where(den > 0, den, 1.0)) + m_safe[..., 0], -jnp.inf)
    return o.astype(q.dtype), lse.transpose(0, 2, 1)


def _data(seed=0, B=2, T=6, N=4, K=2, H=8, S=20):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return f, f(B, T, N, H), f(B, K, S, H), f(B, K, S, H)


@pytest.mark.parametrize("extra", ["none", "bool", "blocks", "diag", "all"])
def test_kernel_merge_equals_one_softmax(extra):
    f, q, k, v = _data()
    B, T, N, H = q.shape
    K = k.shape[1]
    pos = jnp.asarray([[-1, 0, 3, 4, 19, 7], [2, 2, 2, 9, 9, 9]], jnp.int32)  # -1: none
    own_k, own_v = f(B, T, K, H), f(B, T, K, H)
    sources = [(k, v, Limit(pos))]
    diag = []
    if extra in ("bool", "all"):
        rng = np.random.default_rng(1)
        sources.append((f(B, K, 5, H), f(B, K, 5, H), jnp.asarray(rng.random((B, T, 5)) < .5)))
    if extra in ("blocks", "all"):
        sources.append((own_k, own_v, Blocks(3)))
    if extra in ("diag", "all"):
        diag = [(f(B, T, K, H), f(B, T, K, H))]
    if extra == "none":  # the kernel alone; no key at all for row 0's query 0: skip it
        pos = pos.at[0, 0].set(0)
        sources = [(k, v, Limit(pos))]

    def run(kernel, q, k, v):
        srcs = [(k, v, sources[0][2]), *sources[1:]]
        return attend(q, srcs, diag, kernel=kernel)

    w = f(B, T, N * H)
    loss = lambda kernel: lambda q, k, v: jnp.sum(run(kernel, q, k, v) * w)  # noqa: E731
    want = run(None, q, k, v)
    got = run(contract_attention, q, k, v)
    live = np.ones((B, T), bool)
    if extra in ("none", "diag", "bool"):  # a query with no visible key at all is unused
        live = np.asarray(pos >= 0) | (extra in ("diag",))
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live],
                               rtol=2e-5, atol=2e-5)
    assert np.all(np.isfinite(np.asarray(got)))
    g_want = jax.grad(loss(None), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(loss(contract_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_want, strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        if extra in ("blocks", "all"):  # every query sees something: gradients comparable
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_blocks_equal_block_diagonal_mask():
    f, q, _, _ = _data(seed=3, T=8)
    B, T, N, H = q.shape
    K = 2
    k, v = f(B, T, K, H), f(B, T, K, H)
    ctx_k, ctx_v = f(B, K, 5, H), f(B, K, 5, H)
    ctx = (ctx_k, ctx_v, Limit(jnp.full((B, T), 2, jnp.int32)))
    bid = jnp.arange(T) // 4
    mask = jnp.broadcast_to(bid[:, None] == bid[None, :], (B, T, T))
    want = attend(q, [ctx, (k.swapaxes(1, 2), v.swapaxes(1, 2), mask)])
    got = attend(q, [ctx, (k, v, Blocks(4))])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="multiple of the block size"):
        attend(q, [(k, v, Blocks(3))])
    # causal blocks (JetSpec's head) equal the block-diagonal mask cut to u <= t
    causal = mask & (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])
    want = attend(q, [ctx, (k.swapaxes(1, 2), v.swapaxes(1, 2), causal)])
    got = attend(q, [ctx, (k, v, Blocks(4, causal=True))])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.allclose(np.asarray(got), np.asarray(attend(q, [ctx, (k, v, Blocks(4))])))


def test_kernel_is_explicit():
    calls = []

    def spy(q, k, v, limit):
        calls.append(limit.shape)
        return contract_attention(q, k, v, limit)

    _, q, k, v = _data()
    pos = jnp.zeros(q.shape[:2], jnp.int32)
    attend(q, [(k, v, Limit(pos))], kernel=spy)
    attend(q, [(k, v, Limit(pos))])  # no kernel: the jnp path
    assert calls == [q.shape[:2]]
