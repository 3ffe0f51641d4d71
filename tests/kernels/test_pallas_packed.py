"""pallas_kernels.attention.packed: attention with a key limit per query (training layouts).

- The Pallas kernels in interpret mode (TPU layout; Triton layout; and the TPU layout
  under the TPU interpreter, whose uninitialised memory, e.g. a partial last tile's
  padding, reads as NaN and whose out-of-bounds reads raise) equal the jnp reference in
  o and lse for causal limits (t+1), packed-block limits (sorted anchors repeated G+1
  times, DFlash) and random limits including 0 and S; T*R and S not multiples of the
  tiles; GQA (N, K) in (1,1), (4,1), (8,4); H 64 and 128; f32 and bf16. Key/value slots
  no query sees hold NaN, so any read into a result shows.
- The reference matches an independent float64 numpy loop.
- Gradients (q, k, v) of a loss using both o and lse through the Pallas backward equal
  jax.grad of the reference, for both layouts; queries that see nothing get zero dq, and
  slots nobody sees zero dk/dv, with no NaN anywhere.
- The backward materialises nothing of size [T, S] outside the kernels.
- The TPU kernels compute only the S tiles below each query tile's largest limit
  (forward, dq) and only the query tiles that see an S tile (dk/dv): tile counters.
- Forward and jax.grad lower for TPU (Mosaic) and GPU (Triton) at a Qwen3-8B shape.
- Bad arguments raise ValueError.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.extend.core import ClosedJaxpr, Jaxpr

from pallas_kernels.attention import packed_kernel
from pallas_kernels.attention.packed import packed_attention, pick_blocks
from pallas_kernels.attention.packed_reference import packed_attention_reference
from specjax.export import export_for

TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
KERNELS = {
    "tpu": dict(backend="tpu", interpret=True),
    "triton": dict(backend="triton", interpret=True),
    # Slower (a callback per grid step): used on a few cases with partial tiles.
    "tpu-interpreter": dict(backend="tpu", interpret=TPU_INTERPRET),
}
F32_TOL = dict(rtol=2e-5, atol=2e-5)
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _limits(kind, B, T, S, rng):
    """i32[B, T] limits: causal t+1; packed blocks (sorted anchors, each repeated G+1 = 5
    times, T a multiple of 5); random in 0..S with a 0 and an S in every row."""
    if kind == "causal":
        return np.minimum(np.arange(T)[None, :] + 1, S).repeat(B, 0).astype(np.int32)
    if kind == "packed":
        anchors = np.sort(rng.integers(0, S + 1, size=(B, T // 5)), axis=1)
        anchors[:, 0] = 0  # a block at the sequence start sees no context
        return anchors.repeat(5, axis=1).astype(np.int32)
    lim = rng.integers(0, S + 1, size=(B, T))
    lim[:, 0], lim[:, -1] = 0, S
    return lim.astype(np.int32)


def _inputs(B, T, N, K, S, H, kind, dtype=jnp.float32, seed=0, poison=True):
    rng = np.random.default_rng(seed)
    limit = _limits(kind, B, T, S, rng)
    q = rng.normal(size=(B, T, N, H))
    k, v = rng.normal(size=(2, B, K, S, H))
    if poison:  # slots no query of the row sees must never be read into any result
        dead = np.arange(S)[None, None, :, None] >= limit.max(1)[:, None, None, None]
        k, v = np.where(dead, np.nan, k), np.where(dead, np.nan, v)
    c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return c(q), c(k), c(v), jnp.asarray(limit)


@functools.cache
def _jitted(name, block_q, block_s):
    return jax.jit(functools.partial(packed_attention, block_q=block_q, block_s=block_s,
                                     **KERNELS[name]))


_reference = jax.jit(packed_attention_reference)


def _assert_close(got, want, tol, msg=""):
    """o or lse: same -inf positions (lse), finite values within tol."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), msg
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=msg)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], **tol, err_msg=msg)


# (B, T, N, K, S, H, Triton block_q, block_s, limit kind, dtype, with the TPU interpreter)
# TPU row tiles are 128 rows (T*R = 288 or 320: 3 tiles, the last partial; T*R <= 128:
# one tile of T*R rounded up to 8).
CASES = [
    (2, 40, 1, 1, 40, 64, 16, 16, "causal", jnp.float32, True),  # S % 16 != 0
    (1, 72, 4, 1, 72, 128, 128, 32, "causal", jnp.float32, False),  # 3 row tiles on TPU
    (2, 40, 8, 4, 50, 64, 32, 16, "packed", jnp.float32, True),
    (1, 80, 4, 1, 64, 64, 128, 16, "packed", jnp.bfloat16, False),  # 3 row tiles on TPU
    (3, 9, 8, 4, 100, 64, 128, 32, "random", jnp.float32, False),  # unsorted limits
    (2, 17, 4, 1, 300, 128, 64, 128, "random", jnp.bfloat16, False),  # few queries, long S
    (2, 6, 4, 1, 24, 64, 128, 128, "random", jnp.float32, False),  # one tile each way
]


@pytest.mark.parametrize("B,T,N,K,S,H,block_q,block_s,kind,dtype,interp", CASES)
def test_forward_equals_reference(B, T, N, K, S, H, block_q, block_s, kind, dtype, interp):
    q, k, v, limit = _inputs(B, T, N, K, S, H, kind, dtype)
    o_ref, lse_ref = _reference(q, k, v, limit)
    assert not np.isnan(np.asarray(o_ref, np.float32)).any()
    assert np.isneginf(np.asarray(lse_ref)).any() == (np.asarray(limit) == 0).any()
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    for name in ["tpu", "triton"] + (["tpu-interpreter"] if interp else []):
        bq = block_q if name == "triton" else 128
        o, lse = _jitted(name, bq, block_s)(q, k, v, limit)
        assert o.shape == (B, T, N, H) and o.dtype == dtype, name
        assert lse.shape == (B, T, N) and lse.dtype == jnp.float32, name
        _assert_close(o, o_ref, tol, f"{name} o")
        _assert_close(lse, lse_ref, dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32
                      else dict(rtol=1e-3, atol=1e-3), f"{name} lse")
    # A query that sees nothing gets exactly o = 0.
    dead = np.asarray(limit) == 0
    assert not np.asarray(o, np.float32)[dead].any()


def _numpy_f64(q, k, v, limit):
    """Independent float64 loops: per row, query and head, one plain softmax."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    R = N // k.shape[1]
    o, lse = np.zeros((B, T, N, H)), np.full((B, T, N), -np.inf)
    for b in range(B):
        for t in range(T):
            L = int(limit[b, t])
            for n in range(N):
                if L == 0:
                    continue
                s = k[b, n // R, :L] @ q[b, t, n] / np.sqrt(H)
                p = np.exp(s - s.max())
                o[b, t, n] = p @ v[b, n // R, :L] / p.sum()
                lse[b, t, n] = s.max() + np.log(p.sum())
    return o, lse


def test_float64_numpy():
    q, k, v, limit = _inputs(3, 10, 4, 2, 30, 64, "random", seed=3)
    want_o, want_lse = _numpy_f64(q, k, v, np.asarray(limit))
    for o, lse in (_reference(q, k, v, limit), _jitted("tpu", 128, 16)(q, k, v, limit),
                   packed_attention(q, k, v, limit, impl="reference")):
        _assert_close(o, want_o, dict(rtol=1e-5, atol=1e-5))
        _assert_close(lse, want_lse, dict(rtol=1e-5, atol=1e-5))


def _loss(fn, w1, w2, q, k, v, limit):
    o, lse = fn(q, k, v, limit)
    return (jnp.sum(o.astype(jnp.float32) * w1)
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w2))


# (backend, B, T, N, K, S, H, block_q, block_s, limit kind, dtype)
GRAD_CASES = [
    ("tpu", 2, 24, 4, 2, 40, 64, 128, 16, "random", jnp.float32),  # 2 row tiles, S partial
    ("triton", 2, 24, 4, 2, 40, 64, 32, 16, "random", jnp.float32),
    ("tpu", 1, 40, 8, 4, 48, 64, 128, 16, "packed", jnp.bfloat16),
    ("triton", 1, 40, 4, 1, 48, 128, 64, 32, "causal", jnp.float32),
    ("tpu-interpreter", 1, 20, 4, 2, 24, 64, 128, 16, "random", jnp.float32),
]


@pytest.mark.parametrize("name,B,T,N,K,S,H,block_q,block_s,kind,dtype", GRAD_CASES)
def test_gradient_equals_reference(name, B, T, N, K, S, H, block_q, block_s, kind, dtype):
    q, k, v, limit = _inputs(B, T, N, K, S, H, kind, dtype, seed=1)
    rng = np.random.default_rng(2)
    w1 = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(B, T, N)), jnp.float32)
    pal = functools.partial(packed_attention, block_q=block_q, block_s=block_s, **KERNELS[name])
    grad = lambda fn: jax.jit(jax.grad(functools.partial(_loss, fn, w1, w2),  # noqa: E731
                                       argnums=(0, 1, 2)))
    want = grad(packed_attention_reference)(q, k, v, limit)
    got = grad(pal)(q, k, v, limit)
    lim = np.asarray(limit)
    dead_slots = np.arange(S)[None, :] >= lim.max(1)[:, None]  # [B, S]
    for what, a, b in zip("qkv", got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype and np.isfinite(a).all() and np.isfinite(b).all(), what
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=what)
        else:  # bf16 operands of every product: compare relative to the gradient's scale
            np.testing.assert_allclose(a, b, rtol=0, atol=3e-2 * np.abs(b).max(), err_msg=what)
    assert not np.asarray(got[0], np.float32)[lim == 0].any()  # queries that see nothing
    for g in got[1:]:  # slots nobody sees
        assert not np.asarray(g, np.float32).transpose(0, 2, 1, 3)[dead_slots].any()


def test_backward_materialises_no_scores():
    """Outside the kernels, no array of the jitted gradient has B*N*T*S elements or more
    (the score matrix; everything else here is smaller)."""
    B, T, N, K, S, H = 1, 64, 4, 1, 256, 64
    q, k, v, limit = _inputs(B, T, N, K, S, H, "causal", poison=False)
    w1, w2 = jnp.ones((B, T, N, H)), jnp.ones((B, T, N))
    f = functools.partial(packed_attention, interpret=True)
    jaxpr = jax.make_jaxpr(jax.grad(functools.partial(_loss, f, w1, w2), argnums=(0, 1, 2)))(
        q, k, v, limit)
    n_calls, biggest = 0, 0

    def walk(jp):
        nonlocal n_calls, biggest
        for eqn in jp.eqns:
            for var in eqn.outvars:
                biggest = max(biggest, int(np.prod(var.aval.shape)))
            if eqn.primitive.name == "pallas_call":
                n_calls += 1
                continue  # the kernel body works on tiles in VMEM
            for p in jax.tree.leaves(list(eqn.params.values()),
                                     is_leaf=lambda x: isinstance(x, ClosedJaxpr | Jaxpr)):
                if isinstance(p, ClosedJaxpr | Jaxpr):
                    walk(p.jaxpr if isinstance(p, ClosedJaxpr) else p)

    walk(jaxpr.jaxpr)
    assert n_calls == 3  # forward, dq, dk/dv
    assert biggest < B * N * T * S, biggest


def test_tpu_kernels_skip_tiles_nobody_sees():
    """Forward and dq compute cdiv(tmax, bs) S tiles per row tile (tmax = the tile's
    largest limit) and dk/dv only the row tiles with tmax > the S tile's start; the
    results stay exact. Limits are packed blocks (sorted) in row 0 and unsorted in row 1."""
    B, T, N, K, S, H, bq, bs = 2, 80, 4, 2, 96, 64, 128, 16
    q, k, v, _ = _inputs(B, T, N, K, S, H, "packed", seed=4, poison=False)
    limit = np.zeros((B, T), np.int32)
    limit[0] = np.repeat([0, 5, 17, 17, 20, 25, 30, 35, 40, 45, 50, 55, 60, 70, 80, 94], 5)
    limit[1] = np.repeat([50, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 33], 5)
    limit = jnp.asarray(limit)
    plan = packed_kernel.Plan(B, T, N, K, S, H, *pick_blocks(T * N // K, S, H, bq, bs))
    assert (plan.bq, plan.bs, plan.nQ, plan.nS) == (128, 16, 2, 6)
    qf = packed_kernel.fold_rows(q, plan)
    lim = packed_kernel.row_limits(limit, plan)
    tmax = packed_kernel.tile_max(lim, plan)
    np.testing.assert_array_equal(np.asarray(tmax), [[60, 94], [50, 33]])
    of, lsef, counts = packed_kernel.forward_tpu(qf, k, v, lim, tmax, plan=plan,
                                                  interpret=True, count_tiles=True)
    want_tiles = -(-np.asarray(tmax) // bs)  # [B, nQ]
    np.testing.assert_array_equal(np.asarray(counts), np.repeat(want_tiles[:, None], K, 1))
    o_ref, lse_ref = packed_attention_reference(q, k, v, limit)
    _assert_close(packed_kernel.unfold_rows(of, plan), o_ref, F32_TOL)
    _assert_close(packed_kernel.unfold_rows(lsef, plan)[..., 0], lse_ref, F32_TOL)

    dof = qf[..., ::-1] * 0.5
    di = jnp.ones_like(lsef)
    _, dq_counts = packed_kernel.dq_tpu(qf, k, v, dof, lsef, di, lim, tmax, plan=plan,
                                        interpret=True, count_tiles=True)
    np.testing.assert_array_equal(np.asarray(dq_counts), np.asarray(counts))
    qlist, qcount = packed_kernel.q_tile_lists(tmax, plan)
    # Row 0: S tile j (start 16j) is seen by tile 0 (tmax 60) for j < 4, by tile 1 always;
    # row 1: by tile 0 (tmax 50) for j < 4 and by tile 1 (tmax 33) for j < 3.
    np.testing.assert_array_equal(np.asarray(qcount), [[2, 2, 2, 2, 1, 1], [2, 2, 2, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(qlist)[1, 3:], [[0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(np.asarray(qlist)[0, 4:], [[1, 1], [1, 1]])
    dk, dv, dkv_counts = packed_kernel.dkv_tpu(qf, k, v, dof, lsef, di, lim, qlist, qcount,
                                               plan=plan, interpret=True, count_tiles=True)
    np.testing.assert_array_equal(np.asarray(dkv_counts),
                                  np.repeat(np.asarray(qcount)[:, None], K, 1))
    assert not np.asarray(dk)[1, :, 50:].any() and not np.asarray(dv)[1, :, 50:].any()
    idx = jax.vmap(lambda j, m: packed_kernel.kv_tile_index(j, m, bs))
    js = jnp.array([0, 3, 0, 1, 2, 5], jnp.int32)
    ms = jnp.array([0, 0, 1, 17, 17, 96], jnp.int32)
    np.testing.assert_array_equal(np.asarray(idx(js, ms)), [0, 0, 0, 1, 1, 5])


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "triton")])
def test_lowers_for_tpu_and_gpu(platform, backend):
    """Qwen3-8B heads (N 32, K 8, H 128), bf16, checked without the hardware: the forward
    and jax.grad of a loss of (o, lse) lower to Mosaic tpu_custom_calls / Triton kernels
    for DFlash-like training (B 1, T 512 packed queries, S 256) and for inference (B 2,
    T 17 queries: one row tile of 72 rows on TPU; S 4100, not a multiple of the tile)."""
    names = ["packed_attention_fwd", "packed_attention_dq", "packed_attention_dkv"]
    spec, dt = jax.ShapeDtypeStruct, jnp.bfloat16
    N, K, H = 32, 8, 128
    for B, T, S in ((1, 512, 256), (2, 17, 4100)):
        args = (spec((B, T, N, H), dt), spec((B, K, S, H), dt), spec((B, K, S, H), dt),
                spec((B, T), jnp.int32))
        f = functools.partial(packed_attention, interpret=False, backend=backend)
        w1, w2 = jnp.ones((B, T, N, H), jnp.float32), jnp.ones((B, T, N), jnp.float32)
        g = jax.grad(functools.partial(_loss, f, w1, w2), argnums=(0, 1, 2))
        for fn, n_kernels in ((f, 1), (g, 3)):
            text = export_for(jax.jit(fn), platform, *args).mlir_module()
            if platform == "tpu":
                assert text.count("tpu_custom_call") == n_kernels, (T, n_kernels)
            for i, name in enumerate(names):
                assert (name in text) == (i < n_kernels), (T, name)


def test_bad_arguments_raise():
    q, k, v, limit = _inputs(2, 4, 4, 2, 64, 64, "random", poison=False)
    cases = [
        (dict(q=q[0]), "q .* must be \\[B, T, N, H\\]"),
        (dict(k=k[:, :, :, :32]), "k .* must be \\[B, K, S, H\\]"),
        (dict(v=v[:, :, :32]), "v .* must equal k"),
        (dict(q=q[:, :, :3]), "multiple of KV heads"),
        (dict(limit=limit[:, :3]), "limit"),
        (dict(limit=limit.astype(jnp.float32)), "integer"),
        (dict(k=k.astype(jnp.bfloat16)), "dtype"),
        (dict(q=q.astype(jnp.float16), k=k.astype(jnp.float16), v=v.astype(jnp.float16)),
         "float32 or bfloat16"),
        (dict(impl="cuda"), "impl"),
        (dict(backend="gpu"), "backend"),
        (dict(block_s=36), "multiple of 8"),
        (dict(block_q=0), "positive"),
        (dict(backend="triton", block_s=96), "power of two"),
        (dict(backend="triton", interpret=TPU_INTERPRET), "InterpretParams"),
        (dict(q=q[..., :48], k=k[..., :48], v=v[..., :48], backend="triton"), "H=48"),
    ]
    base = dict(q=q, k=k, v=v, limit=limit)
    for kw, match in cases:
        args = {**base, **kw}
        with pytest.raises(ValueError, match=match):
            packed_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("limit"),
                             **args)
    with pytest.raises(ValueError, match="multiple of 128"):
        pick_blocks(4 * 200, 64, 64, block_q=64)
    assert pick_blocks(68, 4096, 128) == (72, 128)
    assert pick_blocks(68, 100, 128, backend="triton") == (128, 128)
    assert pick_blocks(2048, 40, 64, 256, 64, "triton") == (256, 64)
    # triton tiles that did not fit an H100's shared memory are halved, the larger first:
    # f32 at H 64 asked 320 KiB with 128 x 128 tiles; bf16 at H 128 ran
    assert pick_blocks(4096, 1024, 64, backend="triton", itemsize=4) == (64, 64)
    assert pick_blocks(4096, 1024, 128, backend="triton", itemsize=4) == (32, 32)
    assert pick_blocks(4096, 4096, 128, backend="triton", itemsize=2) == (128, 128)
    assert pick_blocks(4096, 4096, 256, backend="triton", itemsize=2) == (64, 64)
