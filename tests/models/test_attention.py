"""specjax.models.attention.cache_attention: chunked attention into the KV cache whose cost follows
the context. Checked against float64 numpy, for slots never read past the last chunk
in use, and through the model: chunked decoding equals unchunked decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.attention import cache_attention
from specjax.models.model import Transformer
from specjax.testing.tiny import tiny_config


def _numpy_f64(q, k, v, q_pos):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, K, Q, H = q.shape
    out = np.zeros((B, K, Q, H))
    for b in range(B):
        for h in range(K):
            for i in range(Q):
                n = int(q_pos[b, i]) + 1
                s = k[b, h, :n] @ q[b, h, i] / np.sqrt(H)
                p = np.exp(s - s.max())
                out[b, h, i] = p @ v[b, h, :n] / p.sum()
    return out


@pytest.mark.parametrize("S,chunk", [(50, 16), (64, 16), (40, 64), (100, 7)])
def test_matches_float64(S, chunk):
    rng = np.random.default_rng(S + chunk)
    B, K, Q, H = 3, 2, 5, 16
    q = rng.normal(size=(B, K, Q, H))
    k, v = rng.normal(size=(2, B, K, S, H))
    q_pos = rng.integers(0, S, size=(B, Q)).astype(np.int32)
    q_pos[0] = 0  # a row that sees slot 0 only
    q_pos[1, 0] = S - 1  # and one query that sees everything
    got = cache_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
                          jnp.asarray(q_pos), chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), _numpy_f64(q, k, v, q_pos),
                               rtol=2e-5, atol=2e-5)


def test_chunks_past_the_context_are_never_read():
    """NaN in every chunk that starts after the largest query position: reading any of
    them would poison the result (0 * NaN), and nothing is."""
    rng = np.random.default_rng(0)
    B, K, Q, H, S, chunk = 2, 2, 3, 8, 256, 32
    q_pos = np.array([[3, 4, 5], [30, 40, 70]], np.int32)  # chunks 0..2 in use
    k, v = rng.normal(size=(2, B, K, S, H))
    k[:, :, 96:], v[:, :, 96:] = np.nan, np.nan
    q = rng.normal(size=(B, K, Q, H))
    got = np.asarray(cache_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                     jnp.asarray(q_pos), chunk=chunk))
    assert np.isfinite(got).all()
    k[:, :, 96:], v[:, :, 96:] = 0.0, 0.0
    np.testing.assert_allclose(got, _numpy_f64(q, k, v, q_pos), rtol=2e-5, atol=2e-5)


def test_bad_chunk_raises():
    x = jnp.zeros((1, 1, 1, 4))
    with pytest.raises(ValueError, match="chunk"):
        cache_attention(x, x, x, jnp.zeros((1, 1), jnp.int32), chunk=0)


def test_model_chunked_equals_unchunked():
    """A prefill and several decode steps of the tiny target at capacity 96 with chunks of
    16 slots give the logits of one unchunked pass (and hence the same greedy tokens)."""
    cfg = tiny_config(300)
    chunked = Transformer(cfg, rngs=nnx.Rngs(0), attention_chunk=16)
    plain = Transformer(cfg, rngs=nnx.Rngs(0), attention_chunk=10**6)
    B, S, Tp = 2, 96, 37
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 300, size=(B, Tp)), jnp.int32)
    caches = [m.init_cache(B, S) for m in (chunked, plain)]
    fns = [jax.jit(lambda t, p, c, m=m: m(t, p, c)) for m in (chunked, plain)]
    pos = jnp.broadcast_to(jnp.arange(Tp, dtype=jnp.int32), (B, Tp))
    outs = [f(tokens, pos, c) for f, c in zip(fns, caches, strict=True)]
    np.testing.assert_allclose(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)
    caches = [o.cache for o in outs]
    nxt = jnp.argmax(outs[1].logits[:, -1], -1)[:, None].astype(jnp.int32)
    lengths = jnp.array([Tp, Tp - 20], jnp.int32)  # ragged rows: one rewound
    caches = [c.rewind(lengths) for c in caches]
    for _ in range(40):  # crosses several chunk boundaries
        p = caches[1].lengths[:, None]
        outs = [f(nxt, p, c) for f, c in zip(fns, caches, strict=True)]
        np.testing.assert_allclose(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)
        caches = [o.cache for o in outs]
        nxt = jnp.argmax(outs[1].logits[:, -1], -1)[:, None].astype(jnp.int32)
        assert bool((jnp.argmax(outs[0].logits[:, -1], -1) == nxt[:, 0]).all())

