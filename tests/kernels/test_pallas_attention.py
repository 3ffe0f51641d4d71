"""pallas_kernels.attention: few-query attention into a long KV cache.

- The Pallas kernels in interpret mode (the TPU layout, also under the TPU interpreter
  whose uninitialised memory, e.g. a partial last tile's padding, reads as NaN and whose
  out-of-bounds reads raise; and the GPU/Triton loop layout) equal the jnp
  reference: lengths 0, 1, S and ragged; S not a multiple of the tile; GQA N/K of
  (1,1), (4,1), (8,4), (8,8); H 64 and 128; T 1, 8 and 17; causal and block; f32 and
  bf16. Cache slots past each row's length hold NaN, so any read into the result shows.
- The reference and kernel match an independent float64 numpy loop, and causal mode
  matches specjax.models.model's attention (new K/V written into the cache, slot <= position).
- The TPU kernel computes only the tiles below each row's length (tile counter, index map).
- Given the whole layer-major cache [L, B, K, S, H] and a layer (static or traced), both
  layouts read that layer in place and equal the reference on cache[layer]; the other
  layers hold NaN, so reading any of them shows.
- Gradients (custom_vjp with the reference's backward) match the reference's, and both
  match jax.grad of the attention written again from its definition in float64
  (`jax.enable_x64`), so the reference is not only compared with itself.
- Both layouts lower for TPU (Mosaic) and GPU (Triton) at a Qwen3-8B-like shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention import (
    decode_attention,
    decode_attention_reference,
    kernel,
    pick_block_s,
)
from specjax.export import export_for

TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
KERNELS = {
    "tpu": dict(backend="tpu", interpret=True),
    "triton": dict(backend="triton", interpret=True),
    # Slower (a callback per grid step): used on the cases with a partial last tile.
    "tpu-interpreter": dict(backend="tpu", interpret=TPU_INTERPRET),
}


def _inputs(B, T, N, K, S, H, lengths, dtype=jnp.float32, seed=0, poison=True):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H))
    kc, vc = rng.normal(size=(2, B, K, S, H))
    kn, vn = rng.normal(size=(2, B, T, K, H))
    lengths = np.asarray(lengths, np.int32)
    if poison:  # slots at or past the length must never be read into the result
        dead = np.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
        kc, vc = np.where(dead, np.nan, kc), np.where(dead, np.nan, vc)
    c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return c(q), c(kc), c(vc), jnp.asarray(lengths), c(kn), c(vn)


@functools.cache
def _jitted(mode, block_s, name):
    return jax.jit(functools.partial(decode_attention, mode=mode, block_s=block_s,
                                     **KERNELS[name]))


@functools.cache
def _reference(mode):
    return jax.jit(functools.partial(decode_attention_reference, mode=mode))


# (B, T, N, K, S, H, block_s, lengths, dtype)
CASES = [
    (4, 1, 1, 1, 200, 64, 64, [0, 1, 200, 77], jnp.float32),  # S % block_s != 0
    (4, 8, 4, 1, 256, 128, 128, [0, 1, 256, 130], jnp.float32),
    (2, 8, 8, 4, 72, 64, 32, [72, 33], jnp.float32),
    (2, 17, 8, 8, 48, 64, 16, [5, 48], jnp.float32),  # T = 17 (G = 16 verify block)
    (2, 1, 8, 8, 136, 128, 128, [1, 136], jnp.bfloat16),
    (3, 8, 8, 4, 100, 64, 128, [0, 57, 100], jnp.bfloat16),  # block_s > S: one tile
]


@pytest.mark.parametrize("mode", ["causal", "block"])
@pytest.mark.parametrize("B,T,N,K,S,H,block_s,lengths,dtype", CASES)
def test_kernel_equals_reference(mode, B, T, N, K, S, H, block_s, lengths, dtype):
    args = _inputs(B, T, N, K, S, H, lengths, dtype)
    want = np.asarray(_reference(mode)(*args), np.float32)
    assert np.isfinite(want).all()
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    # The slower TPU interpreter where a partial last tile has NaN padding (one mode:
    # the modes differ only in the new-token step).
    partial_tile = S % pick_block_s(S, block_s) != 0
    names = ["tpu", "triton"] + (["tpu-interpreter"] if partial_tile and mode == "causal" else [])
    for name in names:
        got = _jitted(mode, block_s, name)(*args)
        assert got.shape == (B, T, N, H) and got.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol, err_msg=name)


def _numpy_f64(q, kc, vc, lengths, kn, vn, mode):
    """Independent float64 loops: per row, query token and head, one plain softmax."""
    q, kc, vc, kn, vn = (np.asarray(a, np.float64) for a in (q, kc, vc, kn, vn))
    B, T, N, H = q.shape
    R = N // kc.shape[1]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        L = int(lengths[b])
        for t in range(T):
            u = t + 1 if mode == "causal" else T
            for n in range(N):
                keys = np.concatenate([kc[b, n // R, :L], kn[b, :u, n // R]])
                vals = np.concatenate([vc[b, n // R, :L], vn[b, :u, n // R]])
                s = keys @ q[b, t, n] / np.sqrt(H)
                p = np.exp(s - s.max())
                out[b, t, n] = p @ vals / p.sum()
    return out


@pytest.mark.parametrize("mode", ["causal", "block"])
def test_float64_numpy(mode):
    lengths = [0, 1, 40, 23]
    args = _inputs(4, 3, 4, 2, 40, 64, lengths, seed=3)
    want = _numpy_f64(*args[:3], lengths, *args[4:], mode)
    ref = _reference(mode)(*args)
    got = _jitted(mode, 16, "tpu")(*args)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_causal_matches_specjax_cache_attention():
    """Causal mode equals what specjax.models.model does today: write the T new K/V into the
    cache at slots lengths[b] + t, then attend over slots <= each query's position."""
    B, T, N, K, S, H = 2, 4, 4, 2, 48, 64
    lengths = np.array([0, 37], np.int32)
    q, kc, vc, ln, kn, vn = _inputs(B, T, N, K, S, H, lengths, poison=False, seed=5)
    pos = lengths[:, None] + np.arange(T)[None, :]  # [B, T]
    bi = np.arange(B)[:, None]
    k_all = kc.at[bi, :, pos].set(kn)  # [B, K, S, H]
    v_all = vc.at[bi, :, pos].set(vn)
    R = N // K
    qg = q.reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4)  # [B, K, R, T, H]
    scores = jnp.einsum("BKRTH,BKSH->BKRTS", qg, k_all) / np.sqrt(H)
    mask = np.arange(S)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), axis=-1)
    want = jnp.einsum("BKRTS,BKSH->BTKRH", probs, v_all).reshape(B, T, N, H)
    got = _jitted("causal", 16, "tpu")(q, kc, vc, ln, kn, vn)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_tiles_past_length_are_skipped():
    """The TPU kernel computes cdiv(length, block_s) tiles per (row, KV head) and no more,
    and its K/V index map re-uses the last needed tile for the skipped steps (no DMA)."""
    B, T, N, K, S, H, bs = 4, 2, 4, 2, 100, 64, 32
    lengths = [0, 1, 33, 100]
    q, kc, vc, ln, kn, vn = _inputs(B, T, N, K, S, H, lengths)
    out, counts = kernel.decode_attention_tpu(q, kc, vc, ln, kn, vn, causal=True,
                                              block_s=bs, interpret=True, count_tiles=True)
    want = -(-np.asarray(lengths) // bs)
    np.testing.assert_array_equal(np.asarray(counts), np.repeat(want[:, None], K, axis=1))
    np.testing.assert_allclose(np.asarray(out),
                               np.asarray(decode_attention_reference(q, kc, vc, ln, kn, vn)),
                               rtol=2e-5, atol=2e-5)
    idx = jax.vmap(lambda j, n: kernel.kv_tile_index(j, n, bs))
    js = jnp.array([0, 1, 2, 3, 0, 3, 0, 1, 2, 3], jnp.int32)
    ns = jnp.array([0, 0, 0, 0, 1, 1, 33, 33, 33, 100], jnp.int32)
    np.testing.assert_array_equal(np.asarray(idx(js, ns)), [0, 0, 0, 0, 0, 0, 0, 1, 1, 3])


@pytest.mark.parametrize("name", ["tpu", "triton"])
def test_layer_major_cache_read_in_place(name):
    """decode_attention(k_cache=[L, B, K, S, H], layer=l) equals the reference on layer l,
    for a static layer and for a traced one (as under `lax.scan` over layers)."""
    B, T, N, K, S, H, L = 2, 3, 4, 2, 40, 64, 3
    lengths = [7, 40]
    q, kc, vc, ln, kn, vn = _inputs(B, T, N, K, S, H, lengths, seed=7)
    nan = jnp.full((L, B, K, S, H), jnp.nan, jnp.float32)
    want = np.asarray(decode_attention_reference(q, kc, vc, ln, kn, vn))
    f = functools.partial(decode_attention, block_s=16, **KERNELS[name])
    traced_fn = jax.jit(lambda k_all, v_all, lay: f(q, k_all, v_all, ln, kn, vn, layer=lay))
    for layer in (0, 2):
        k_all, v_all = nan.at[layer].set(kc), nan.at[layer].set(vc)
        static = f(q, k_all, v_all, ln, kn, vn, layer=layer)
        traced = traced_fn(k_all, v_all, layer)
        ref = decode_attention_reference(q, k_all, v_all, ln, kn, vn, layer=layer)
        for got in (static, traced, ref):
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="L, B, K, S, H"):
        decode_attention(q, kc, vc, ln, kn, vn, layer=0)


@pytest.mark.parametrize("mode", ["causal", "block"])
def test_gradient_matches_reference(mode):
    args = _inputs(2, 3, 4, 2, 40, 64, [0, 29], seed=1, poison=False)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 4, 64)), jnp.float32)
    diff = (0, 1, 2, 4, 5)

    def loss(fn, q, kc, vc, ln, kn, vn):
        return jnp.sum(fn(q, kc, vc, ln, kn, vn) * w)

    ref = functools.partial(decode_attention_reference, mode=mode)
    pal = functools.partial(decode_attention, mode=mode, block_s=16, interpret=True)
    g_ref = jax.grad(functools.partial(loss, ref), argnums=diff)(*args)
    g_pal = jax.jit(jax.grad(functools.partial(loss, pal), argnums=diff))(*args)
    for a, b in zip(g_pal, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # Cache slots past the length get zero gradient.
    assert not np.asarray(g_pal[1])[1, :, 29:].any() and not np.asarray(g_pal[2])[0].any()


def _attention_f64(q, kc, vc, lengths, kn, vn, mode):
    """Few-query attention written again from its definition, in jnp (float64 under
    `jax.enable_x64`), for autodiff: query t of row b, head n (KV head n // R) takes the
    softmax of q . k / sqrt(H) over the row's cache slots < lengths[b] and the new tokens
    u (u <= t when causal, all T for block), and those weights times the values."""
    B, T, N, H = q.shape
    K, S = kc.shape[1], kc.shape[2]
    R = N // K
    keys = jnp.concatenate([jnp.repeat(kc, R, axis=1).transpose(0, 2, 1, 3),
                            jnp.repeat(kn, R, axis=2)], axis=1)  # [B, S+T, N, H]
    vals = jnp.concatenate([jnp.repeat(vc, R, axis=1).transpose(0, 2, 1, 3),
                            jnp.repeat(vn, R, axis=2)], axis=1)
    scores = jnp.einsum("btnh,bsnh->bnts", q, keys) / np.sqrt(H)
    cache_ok = jnp.broadcast_to((np.arange(S)[None, :] < lengths[:, None])[:, None, None, :],
                                (B, 1, T, S))
    new_ok = np.tril(np.ones((T, T), bool)) if mode == "causal" else np.ones((T, T), bool)
    ok = jnp.concatenate([cache_ok, jnp.broadcast_to(new_ok, (B, 1, T, T))], axis=-1)
    scores = jnp.where(ok, scores, -jnp.inf)
    e = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    return jnp.einsum("bnts,bsnh->btnh", e / e.sum(axis=-1, keepdims=True), vals)


@pytest.mark.parametrize("mode", ["causal", "block"])
def test_gradient_matches_float64_autodiff(mode):
    """The custom backward of the Pallas path (and autodiff through the jnp reference)
    against jax.grad of `_attention_f64` in float64: no specjax or pallas_kernels code on
    the expected side. GQA (N 4, K 2), lengths 0 and ragged, finite garbage past each
    length (it must get zero gradient)."""
    lengths = np.array([0, 29, 40], np.int32)
    q, kc, vc, _, kn, vn = (np.asarray(a, np.float64) if a.ndim else a for a in
                            _inputs(3, 3, 4, 2, 40, 16, lengths, seed=4, poison=False))
    dead = np.broadcast_to(np.arange(40)[None, None, :, None] >= lengths[:, None, None, None],
                           kc.shape)
    kc, vc = np.where(dead, 50.0, kc), np.where(dead, -50.0, vc)
    w = np.random.default_rng(5).normal(size=q.shape)
    diff = (0, 1, 2, 3, 4)

    with jax.enable_x64(True):
        def loss64(q, kc, vc, kn, vn):
            return jnp.sum(_attention_f64(q, kc, vc, jnp.asarray(lengths), kn, vn, mode) * w)

        args64 = [jnp.asarray(a, jnp.float64) for a in (q, kc, vc, kn, vn)]
        want_out = np.asarray(_attention_f64(*args64[:3], jnp.asarray(lengths), *args64[3:],
                                             mode))
        want = [np.asarray(g) for g in jax.grad(loss64, argnums=diff)(*args64)]
    assert want_out.dtype == np.float64 and all(g.dtype == np.float64 for g in want)
    assert not want[1][dead].any() and not want[2][dead].any()

    args = [jnp.asarray(a, jnp.float32) for a in (q, kc, vc, kn, vn)]
    w32 = jnp.asarray(w, jnp.float32)
    for name, fn in [
        ("pallas", functools.partial(decode_attention, mode=mode, block_s=16, interpret=True)),
        ("reference", functools.partial(decode_attention, mode=mode, impl="reference")),
    ]:
        def loss(q, kc, vc, kn, vn, fn=fn):
            return jnp.sum(fn(q, kc, vc, jnp.asarray(lengths), kn, vn) * w32)

        out = fn(*args[:3], jnp.asarray(lengths), *args[3:])
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5,
                                   err_msg=name)
        got = jax.jit(jax.grad(loss, argnums=diff))(*args)
        for label, a, b in zip(("q", "k_cache", "v_cache", "k_new", "v_new"), got, want,
                               strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name} d{label}")


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "triton")])
def test_lowers_for_tpu_and_gpu_at_qwen3_8b_shape(platform, backend):
    """Qwen3-8B attention (N 32, K 8, H 128), S 4096, T 8, B 2, bf16: both modes lower
    (Mosaic tpu_custom_call / Triton), checked without the hardware; so does causal mode
    over the layer-major cache [36, B, K, S', H] with a traced layer (S' = 4104, not a
    multiple of the tile, as a decoding loop's capacity max_length + G + 1)."""
    B, T, N, K, S, H = 2, 8, 32, 8, 4096, 128
    spec = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    args = (spec((B, T, N, H), dt), spec((B, K, S, H), dt), spec((B, K, S, H), dt),
            spec((B,), jnp.int32), spec((B, T, K, H), dt), spec((B, T, K, H), dt))
    marker = "tpu_custom_call" if platform == "tpu" else "triton"
    for mode in ("causal", "block"):
        f = functools.partial(decode_attention, mode=mode, interpret=False, backend=backend)
        assert marker in export_for(jax.jit(f), platform, *args).mlir_module(), mode
    cache = spec((36, B, K, S + 8, H), dt)
    def f(q, kc, vc, lengths, kn, vn, layer):  # a traced layer index
        return decode_attention(q, kc, vc, lengths, kn, vn, mode="causal", interpret=False,
                                backend=backend, layer=layer)

    exported = export_for(jax.jit(f), platform, args[0], cache, cache, *args[3:],
                          spec((), jnp.int32))
    assert marker in exported.mlir_module()


def test_bad_arguments_raise():
    q, kc, vc, ln, kn, vn = _inputs(2, 2, 4, 2, 64, 64, [3, 64], poison=False)
    with pytest.raises(ValueError, match="mode"):
        decode_attention(q, kc, vc, ln, kn, vn, mode="sliding")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q[:, :, :3], kc, vc, ln, kn, vn)
    with pytest.raises(ValueError, match="k_new"):
        decode_attention(q, kc, vc, ln, kn[:, :1], vn)
    with pytest.raises(ValueError, match="v_cache"):
        decode_attention(q, kc, vc[:, :, :32], ln, kn, vn)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(q, kc, vc, ln.astype(jnp.float32), kn, vn)
    with pytest.raises(ValueError, match="impl"):
        decode_attention(q, kc, vc, ln, kn, vn, impl="cuda")
    with pytest.raises(ValueError, match="backend"):
        decode_attention(q, kc, vc, ln, kn, vn, backend="gpu")
    with pytest.raises(ValueError, match="multiple of 8"):
        pick_block_s(4096, 100)
    with pytest.raises(ValueError, match="power of two"):
        pick_block_s(4096, 96, "triton")
    assert pick_block_s(100, 128) == 100 and pick_block_s(4096) == 128
    assert pick_block_s(40, 128, "triton") == 64 and pick_block_s(4096, 64, "triton") == 64
