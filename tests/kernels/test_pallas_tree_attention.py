"""pallas_kernels.attention.decode_attention(mode="tree"): draft-tree verification.

The T new tokens are the nodes of a draft tree; query t sees the row's cache slots <
lengths[b] and new token u iff tree_mask[b, t, u] (node u is t or an ancestor of t), the
diagonal always. Masks are built from random parent pointers (parents[i] < i).

- Both layouts in interpret mode (TPU grid, Triton loop), single pass and split-S, equal
  the jnp reference: lengths 0, 1, S and ragged; S not a multiple of the tile; GQA; T 1
  to 33; f32 and bf16; a layer-major cache read in place (other layers NaN). Cache slots
  past each row's length hold NaN, so any read into the result shows.
- The reference and the kernel match an independent float64 numpy loop.
- A lower-triangular mask gives exactly causal mode, an all-true one exactly block mode
  (kernels and reference); integer masks equal bool ones; the diagonal is visible even
  where the mask says false (rows of unused nodes, all false, stay finite at length 0).
- Gradients (custom_vjp: the kernel forward, the reference's backward) and autodiff
  through the reference match a backward derived by hand in float64 numpy (itself
  checked against central differences of the float64 forward).
- Both layouts lower for TPU (Mosaic) and GPU (Triton) at a Qwen3-8B shape with 64 tree
  nodes, with a traced layer of the layer-major cache, single pass and split-S.
- Bad arguments raise ValueError (one line).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention import decode_attention, decode_attention_reference
from specjax.export import export_for

TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
KERNELS = {
    "tpu": dict(backend="tpu", interpret=True),
    "triton": dict(backend="triton", interpret=True),
    "tpu-interpreter": dict(backend="tpu", interpret=TPU_INTERPRET),
}


def random_parents(B, T, rng):
    """i32[B, T]: node 0 is the root (-1), node i > 0 has a random parent < i."""
    par = np.full((B, T), -1, np.int32)
    for i in range(1, T):
        par[:, i] = rng.integers(0, i, size=B)
    return par


def ancestor_mask(parents):
    """bool[B, T, T]: [b, t, u] = u is t or one of its ancestors (numpy, by walking up)."""
    B, T = parents.shape
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        for t in range(T):
            u = t
            while u >= 0:
                mask[b, t, u] = True
                u = parents[b, u]
    return mask


def _inputs(B, T, N, K, S, H, lengths, dtype=jnp.float32, seed=0, poison=True):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H))
    kc, vc = rng.normal(size=(2, B, K, S, H))
    kn, vn = rng.normal(size=(2, B, T, K, H))
    lengths = np.asarray(lengths, np.int32)
    if poison:  # slots at or past the length must never be read into the result
        dead = np.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
        kc, vc = np.where(dead, np.nan, kc), np.where(dead, np.nan, vc)
    mask = ancestor_mask(random_parents(B, T, rng))
    c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return c(q), c(kc), c(vc), jnp.asarray(lengths), c(kn), c(vn), jnp.asarray(mask)


def _tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)


@functools.cache
def _jitted(name, block_s, num_splits, mode="tree"):
    return jax.jit(functools.partial(decode_attention, mode=mode, block_s=block_s,
                                     num_splits=num_splits, **KERNELS[name]))


def _call(name, block_s, num_splits, args, mode="tree"):
    q, kc, vc, ln, kn, vn, mask = args
    f = _jitted(name, block_s, num_splits, mode)
    return f(q, kc, vc, ln, kn, vn, tree_mask=mask) if mode == "tree" else \
        f(q, kc, vc, ln, kn, vn)


def _reference(args, mode="tree"):
    q, kc, vc, ln, kn, vn, mask = args
    kw = dict(tree_mask=mask) if mode == "tree" else {}
    return decode_attention_reference(q, kc, vc, ln, kn, vn, mode=mode, **kw)


# (B, T, N, K, S, H, block_s, lengths, dtype, splits)
CASES = {
    # 5 tiles, the last partial; GQA R = 2; split 3 -> chunks of 2 tiles, 3 splits.
    "f32-gqa-T7": (3, 7, 4, 2, 72, 64, 16, [0, 33, 72], jnp.float32, (1, 3)),
    # T = 1 (the root alone: the mask is [[1]]); MHA.
    "f32-T1": (2, 1, 2, 2, 48, 64, 16, [1, 48], jnp.float32, (1, 2)),
    # 17 nodes (Triton pads the new tokens to 32, the TPU kernel to 24), R = 4.
    "bf16-T17": (2, 17, 8, 2, 64, 64, 32, [0, 40], jnp.bfloat16, (1, 2)),
}
SLOW_CASES = {
    "f32-T33-R8": (2, 33, 8, 1, 100, 64, 32, [100, 7], jnp.float32, (1, 2, 4)),
    "bf16-T64-H128": (2, 64, 4, 4, 136, 128, 128, [1, 136], jnp.bfloat16, (1,)),
    "f32-T12-onetile": (3, 12, 4, 2, 50, 64, 128, [0, 50, 13], jnp.float32, (1,)),
}


def _check_case(B, T, N, K, S, H, block_s, lengths, dtype, splits, names=("tpu", "triton")):
    args = _inputs(B, T, N, K, S, H, lengths, dtype)
    want = np.asarray(_reference(args), np.float32)
    assert np.isfinite(want).all()
    for name in names:
        for P in splits:
            got = _call(name, block_s, P, args)
            assert got.shape == (B, T, N, H) and got.dtype == dtype, name
            np.testing.assert_allclose(np.asarray(got, np.float32), want, **_tol(dtype),
                                       err_msg=f"{name} P={P}")


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_reference(case):
    _check_case(*CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_kernel_equals_reference_more_shapes(case):
    _check_case(*SLOW_CASES[case])


def test_under_tpu_interpreter():
    """Partial last tile with NaN padding, a split past a row's length, an empty row: no
    out-of-bounds read and no uninitialised memory reaches the result in tree mode."""
    B, T, N, K, S, H, block_s, lengths, dtype, _ = CASES["f32-gqa-T7"]
    _check_case(B, T, N, K, S, H, block_s, lengths, dtype, (1, 3), names=("tpu-interpreter",))


def _numpy_f64(q, kc, vc, lengths, kn, vn, mask):
    """Independent float64 loops: per row, query token and head, one plain softmax over
    the cache prefix and the new tokens the mask (or the diagonal) lets it see."""
    q, kc, vc, kn, vn = (np.asarray(a, np.float64) for a in (q, kc, vc, kn, vn))
    mask = np.asarray(mask)
    B, T, N, H = q.shape
    R = N // kc.shape[1]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        L = int(lengths[b])
        for t in range(T):
            us = [u for u in range(T) if mask[b, t, u] or u == t]
            for n in range(N):
                keys = np.concatenate([kc[b, n // R, :L], kn[b, us, n // R]])
                vals = np.concatenate([vc[b, n // R, :L], vn[b, us, n // R]])
                s = keys @ q[b, t, n] / np.sqrt(H)
                p = np.exp(s - s.max())
                out[b, t, n] = p @ vals / p.sum()
    return out


def test_float64_numpy():
    lengths = [0, 1, 40, 23]
    args = _inputs(4, 6, 4, 2, 40, 32, lengths, seed=3)
    want = _numpy_f64(*args[:3], lengths, *args[4:])
    np.testing.assert_allclose(np.asarray(_reference(args)), want, rtol=1e-5, atol=1e-5)
    got = _call("tpu", 16, 2, args)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_triangular_is_causal_and_all_true_is_block():
    """Exactly equal (same masked scores, same order of sums), per layout, with and
    without split-S, and in the reference."""
    B, T = 2, 6
    args = _inputs(B, T, 4, 2, 40, 32, [0, 29], seed=4)
    tril = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    full = jnp.ones((B, T, T), bool)
    for mode, mask in (("causal", tril), ("block", full)):
        targs = (*args[:6], mask)
        np.testing.assert_array_equal(np.asarray(_reference(targs)),
                                      np.asarray(_reference(args, mode)), err_msg=mode)
        for name in ("tpu", "triton"):
            for P in (1, 2):
                np.testing.assert_array_equal(
                    np.asarray(_call(name, 16, P, targs)),
                    np.asarray(_call(name, 16, P, args, mode)), err_msg=f"{mode} {name} {P}")
    # A chain of nodes (parents[i] = i - 1) is the triangular mask.
    chain = ancestor_mask(np.broadcast_to(np.arange(T) - 1, (B, T)))
    np.testing.assert_array_equal(chain, np.asarray(tril))


def test_integer_masks_and_forced_diagonal():
    """int8 / int32 masks (nonzero = visible) equal the bool mask; a mask with its
    diagonal cleared, or unused nodes whose rows are all false (as
    specjax.core.tree.ancestor_mask leaves them), equals the mask with the diagonal
    set, and stays finite at length 0."""
    args = _inputs(2, 5, 4, 2, 40, 32, [0, 17], seed=6)
    q, kc, vc, ln, kn, vn, mask = args
    want = np.asarray(_call("tpu", 16, 1, args))
    for dt in (jnp.int8, jnp.int32):
        got = _call("tpu", 16, 1, (*args[:6], (mask.astype(dt) * 3)))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(dt))
    no_diag = mask & ~jnp.eye(5, dtype=bool)
    for name in ("tpu", "triton"):
        got = _call(name, 16, 2, (*args[:6], no_diag))
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(_reference((*args[:6], no_diag))), want,
                               rtol=2e-5, atol=2e-5)
    unused = mask.at[:, 3:].set(False)  # nodes 3, 4 unused: their rows see nothing
    for name in ("tpu", "triton"):
        got = np.asarray(_call(name, 16, 2, (*args[:6], unused)))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, np.asarray(_reference((*args[:6], unused))),
                                   rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("name", ["tpu", "triton"])
def test_layer_major_cache_read_in_place(name):
    """tree mode over [L, B, K, S, H] with a traced layer equals the reference on that
    layer; the other layers hold NaN."""
    B, T, N, K, S, H, L, layer = 2, 5, 4, 2, 40, 32, 3, 2
    q, kc, vc, ln, kn, vn, mask = _inputs(B, T, N, K, S, H, [7, 40], seed=7)
    want = np.asarray(_reference((q, kc, vc, ln, kn, vn, mask)))
    nan = jnp.full((L, B, K, S, H), jnp.nan, jnp.float32)
    k_all, v_all = nan.at[layer].set(kc), nan.at[layer].set(vc)
    f = jax.jit(lambda k_all, v_all, lay: decode_attention(
        q, k_all, v_all, ln, kn, vn, mode="tree", tree_mask=mask, layer=lay, block_s=16,
        num_splits=2, **KERNELS[name]))
    np.testing.assert_allclose(np.asarray(f(k_all, v_all, layer)), want, rtol=2e-5, atol=2e-5)


def _numpy_f64_grads(q, kc, vc, lengths, kn, vn, mask, w):
    """(loss, [dq, dk_cache, dv_cache, dk_new, dv_new]) of loss = sum(out * w), out the
    attention of `_numpy_f64`, with the backward derived by hand in float64 numpy (no
    autodiff): per row b, query t and head n, with the keys Kt and values Vt it sees
    (cache slots < lengths[b], then its visible nodes), s = Kt q / sqrt(H),
    p = softmax(s), o = p Vt: dp = Vt w, ds = p (dp - p . dp), dq = Kt^T ds / sqrt(H),
    dKt = ds q^T / sqrt(H), dVt = p w^T, scattered back to the slots and nodes they came
    from. Cache slots past a length get no gradient."""
    q, kc, vc, kn, vn, w = (np.asarray(a, np.float64) for a in (q, kc, vc, kn, vn, w))
    mask = np.asarray(mask)
    B, T, N, H = q.shape
    R = N // kc.shape[1]
    grads = [np.zeros_like(a) for a in (q, kc, vc, kn, vn)]
    dq, dkc, dvc, dkn, dvn = grads
    loss = 0.0
    for b in range(B):
        L = int(lengths[b])
        for t in range(T):
            us = [u for u in range(T) if mask[b, t, u] or u == t]
            for n in range(N):
                k = n // R
                keys = np.concatenate([kc[b, k, :L], kn[b, us, k]])
                vals = np.concatenate([vc[b, k, :L], vn[b, us, k]])
                s = keys @ q[b, t, n] / np.sqrt(H)
                p = np.exp(s - s.max())
                p /= p.sum()
                g = w[b, t, n]
                loss += (p @ vals) @ g
                dp = vals @ g
                ds = p * (dp - p @ dp)
                dq[b, t, n] += keys.T @ ds / np.sqrt(H)
                dkeys, dvals = np.outer(ds, q[b, t, n]) / np.sqrt(H), np.outer(p, g)
                dkc[b, k, :L] += dkeys[:L]
                dvc[b, k, :L] += dvals[:L]
                dkn[b, us, k] += dkeys[L:]
                dvn[b, us, k] += dvals[L:]
    return loss, grads


@pytest.mark.timeout(120)
def test_gradient_matches_float64_re_derivation():
    """The Pallas path's gradients (custom_vjp: the kernel forward, the reference's
    backward) and autodiff through the jnp reference, in f32, against the backward
    derived by hand in float64 numpy (`_numpy_f64_grads`), itself checked against
    central differences of the float64 forward. GQA (N 4, K 2), a random tree per row,
    lengths 0, ragged and full; finite garbage past each length must get zero
    gradient."""
    B, T, N, K, S, H = 3, 5, 4, 2, 40, 16
    lengths = np.array([0, 29, 40], np.int32)
    q, kc, vc, ln, kn, vn, mask = _inputs(B, T, N, K, S, H, lengths, seed=1, poison=False)
    dead = np.broadcast_to(np.arange(S)[None, None, :, None] >= lengths[:, None, None, None],
                           kc.shape)
    kc, vc = jnp.where(dead, 30.0, kc), jnp.where(dead, -30.0, vc)
    w = np.random.default_rng(2).normal(size=q.shape)
    args = (q, kc, vc, kn, vn)

    def f64(*xs):
        return _numpy_f64_grads(*xs[:3], lengths, *xs[3:], mask, w)

    loss64, want = f64(*args)
    assert not want[1][dead].any() and not want[2][dead].any()
    # the hand-derived backward against central differences of the float64 forward
    rng, eps = np.random.default_rng(3), 1e-6
    for i, a in enumerate(args):
        for _ in range(3):
            idx = tuple(int(rng.integers(d)) for d in a.shape)
            moved = []
            for sign in (1, -1):
                x = np.array(a, np.float64)
                x[idx] += sign * eps
                moved.append(f64(*args[:i], x, *args[i + 1:])[0])
            np.testing.assert_allclose(want[i][idx], (moved[0] - moved[1]) / (2 * eps),
                                       rtol=1e-5, atol=1e-7, err_msg=f"arg {i} at {idx}")
    w32 = jnp.asarray(w, jnp.float32)
    for name, fn in [
        ("pallas", functools.partial(decode_attention, block_s=16, interpret=True,
                                     num_splits=2)),
        ("reference", decode_attention_reference),
    ]:
        def loss(q, kc, vc, kn, vn, fn=fn):
            return jnp.sum(fn(q, kc, vc, ln, kn, vn, mode="tree", tree_mask=mask) * w32)

        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
        np.testing.assert_allclose(float(got[0]), loss64, rtol=1e-5, err_msg=name)
        for label, a, b in zip(("q", "k_cache", "v_cache", "k_new", "v_new"), got[1], want,
                               strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name} d{label}")
        # cache slots past the length get exactly zero gradient
        assert not np.asarray(got[1][1])[dead].any() and not np.asarray(got[1][2])[dead].any()


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "triton")])
def test_lowers_for_tpu_and_gpu_at_qwen3_8b_shape(platform, backend):
    """Qwen3-8B attention (N 32, K 8, H 128), 64 tree nodes, B 2, bf16, over the
    layer-major cache [36, B, K, 4104, H] with a traced layer, as the loop calls it:
    lowers (Mosaic tpu_custom_call / Triton) with one pass and with 8 splits, and the
    kernel takes the row's folded mask, i32 [B, T*R, T]."""
    B, T, N, K, S, H = 2, 64, 32, 8, 4104, 128
    spec = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    args = (spec((B, T, N, H), dt), spec((36, B, K, S, H), dt), spec((36, B, K, S, H), dt),
            spec((B,), jnp.int32), spec((B, T, K, H), dt), spec((B, T, K, H), dt),
            spec((B, T, T), jnp.bool_), spec((), jnp.int32))
    marker = "tpu_custom_call" if platform == "tpu" else "triton"
    for P in (1, 8):
        def f(q, kc, vc, lengths, kn, vn, mask, layer, P=P):
            return decode_attention(q, kc, vc, lengths, kn, vn, mode="tree", tree_mask=mask,
                                    interpret=False, backend=backend, layer=layer,
                                    num_splits=P)

        exported = export_for(jax.jit(f), platform, *args)
        text = exported.mlir_module()
        assert marker in text, P
        assert f"tensor<{B}x{T * N // K}x{T}xi32>" in text, P
        assert exported.out_avals[0].shape == (B, T, N, H)


def test_bad_arguments_raise():
    q, kc, vc, ln, kn, vn, mask = _inputs(2, 3, 4, 2, 32, 32, [3, 32], poison=False)

    def raises(match, **kw):
        for impl in ("pallas", "reference"):
            with pytest.raises(ValueError, match=match) as e:
                decode_attention(q, kc, vc, ln, kn, vn, impl=impl, **kw)
            assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match=match):
            decode_attention_reference(q, kc, vc, ln, kn, vn, **kw)

    raises("tree_mask is required", mode="tree")
    raises("only for mode='tree'", mode="causal", tree_mask=mask)
    raises("only for mode='tree'", mode="block", tree_mask=mask)
    raises(r"tree_mask \(2, 3\)", mode="tree", tree_mask=mask[:, 0])
    raises(r"\[B, T, T\] = \(2, 3, 3\)", mode="tree", tree_mask=mask[:1])
    raises(r"tree_mask \(2, 3, 2\)", mode="tree", tree_mask=mask[..., :2])
    raises("bool or integer", mode="tree", tree_mask=mask.astype(jnp.float32))
    raises("mode", mode="forest", tree_mask=mask)
