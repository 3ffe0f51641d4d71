"""pallas_kernels.attention split-S (flash-decoding): `decode_attention(num_splits=P)`.

- For P in {2, 3, 4}, both layouts in interpret mode (TPU grid (B, K, P, chunk); Triton
  grid (B, K, P) with a loop per chunk) equal the jnp reference, with the tolerances of
  test_pallas_attention.py: lengths 0, 1, S and ragged; S not a multiple of the tile
  (and P not dividing the tile count, so the last chunk is short or a split is dropped);
  splits wholly past a row's length; causal and block; GQA (N/K 1/1 and 8/4); T 1 and 8;
  f32 and bf16. Cache slots past each length hold NaN, so any read into the result shows.
  One case runs under the TPU interpreter that raises on out-of-bounds reads and reads
  uninitialised memory (a partial last tile's padding, an unwritten partial) as NaN.
- The TPU split kernel computes only the tiles below each row's length, per split (tile
  counter), and reads a layer of the layer-major cache in place (other layers NaN).
- num_splits=None picks what `pick_num_splits` documents (and the kernel then runs the
  split grid, or the single pass); bad num_splits raise.
- Both layouts lower with P = 8 for TPU (Mosaic) and GPU (Triton) at a Qwen3-8B-like
  decode shape (B 1, T 8, N 32, K 8, H 128, S 32768, bf16).
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
    pick_num_splits,
)
from specjax.export import export_for

TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
KERNELS = {
    "tpu": dict(backend="tpu", interpret=True),
    "triton": dict(backend="triton", interpret=True),
    "tpu-interpreter": dict(backend="tpu", interpret=TPU_INTERPRET),
}


def _inputs(B, T, N, K, S, H, lengths, dtype=jnp.float32, seed=0):
    """Random inputs; cache slots at or past each row's length are NaN."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, N, H))
    kc, vc = rng.normal(size=(2, B, K, S, H))
    kn, vn = rng.normal(size=(2, B, T, K, H))
    lengths = np.asarray(lengths, np.int32)
    dead = np.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
    kc, vc = np.where(dead, np.nan, kc), np.where(dead, np.nan, vc)
    c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return c(q), c(kc), c(vc), jnp.asarray(lengths), c(kn), c(vn)


def _tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)


# (B, T, N, K, S, H, block_s, lengths, dtype)
CASES = {
    # 7 tiles (the last one partial); P 2/3/4 -> chunks 4/3/2 tiles; rows 0, 1 and 77
    # leave whole splits past their length.
    "f32-T1": (4, 1, 1, 1, 200, 64, 32, [0, 1, 200, 77], jnp.float32),
    # GQA R = 2, 5 tiles: P 4 -> chunk 2, so 3 splits run; row 33 ends in split 1.
    "bf16-gqa-T8": (2, 8, 8, 4, 72, 64, 16, [72, 33], jnp.bfloat16),
}


@functools.cache
def _jitted(mode, block_s, num_splits, name):
    return jax.jit(functools.partial(decode_attention, mode=mode, block_s=block_s,
                                     num_splits=num_splits, **KERNELS[name]))


def _check(case, mode, P, names):
    B, T, N, K, S, H, block_s, lengths, dtype = CASES[case]
    args = _inputs(B, T, N, K, S, H, lengths, dtype)
    want = np.asarray(decode_attention_reference(*args, mode=mode), np.float32)
    assert np.isfinite(want).all()
    for name in names:
        got = _jitted(mode, block_s, P, name)(*args)
        assert got.shape == (B, T, N, H) and got.dtype == dtype, name
        np.testing.assert_allclose(np.asarray(got, np.float32), want, **_tol(dtype),
                                   err_msg=f"{name} P={P}")


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_splits_equal_reference_causal(case, P):
    _check(case, "causal", P, ["tpu", "triton"])


@pytest.mark.parametrize("case", list(CASES))
def test_splits_equal_reference_block(case):
    # The modes differ only in the new-token fold, which one split does: one P suffices.
    _check(case, "block", 3, ["tpu", "triton"])


def test_splits_under_tpu_interpreter():
    """Partial last tile with NaN padding, splits past the lengths, an empty row: no
    out-of-bounds read, and no uninitialised (NaN) memory reaches the result."""
    _check("f32-T1", "causal", 3, ["tpu-interpreter"])


def test_split_tiles_past_length_are_skipped():
    """Each split of the TPU kernel computes exactly the tiles of its chunk below the
    row's length, read in place from a layer-major cache whose other layers are NaN;
    Triton reads the same layer in place too."""
    B, T, N, K, S, H, bs, L, layer = 4, 2, 4, 2, 100, 64, 16, 3, 1
    lengths = [0, 1, 33, 100]  # 7 tiles; P = 3 -> chunks of 3 tiles: 0-2, 3-5, 6
    q, kc, vc, ln, kn, vn = _inputs(B, T, N, K, S, H, lengths)
    nan = jnp.full((L, B, K, S, H), jnp.nan, jnp.float32)
    k_all, v_all = nan.at[layer].set(kc), nan.at[layer].set(vc)
    want = np.asarray(decode_attention_reference(q, kc, vc, ln, kn, vn))
    out, counts = kernel.decode_attention_tpu(
        q, k_all, v_all, ln, kn, vn, causal=True, block_s=bs, interpret=True,
        count_tiles=True, layer=jnp.int32(layer), num_splits=3)
    n_tiles = -(-np.asarray(lengths) // bs)  # [0, 1, 3, 7]
    per_split = np.clip(n_tiles[:, None] - 3 * np.arange(3)[None, :], 0, 3)  # [B, P]
    np.testing.assert_array_equal(per_split, [[0, 0, 0], [1, 0, 0], [3, 0, 0], [3, 3, 1]])
    np.testing.assert_array_equal(np.asarray(counts),
                                  np.repeat(per_split[:, None], K, axis=1))
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    got = decode_attention(q, k_all, v_all, ln, kn, vn, block_s=bs, num_splits=3,
                           layer=layer, **KERNELS["triton"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # The index map of split p, step i: global tile 3p + i clamped to the last needed one.
    idx = jax.vmap(lambda p, i, n: kernel.kv_tile_index(p * 3 + i, n, bs))
    p = jnp.array([0, 1, 2, 0, 1, 2, 1, 2], jnp.int32)
    i = jnp.array([2, 0, 0, 1, 1, 0, 2, 0], jnp.int32)
    n = jnp.array([0, 1, 1, 33, 33, 33, 100, 100], jnp.int32)
    np.testing.assert_array_equal(np.asarray(idx(p, i, n)), [0, 0, 0, 1, 2, 2, 5, 6])


def test_num_splits_rule_and_errors():
    # 1 when B*K >= 8; else min(8, max(1, nS // 4)) with nS = cdiv(S, block_s).
    assert pick_num_splits(1, 8, 32768, 128) == 1
    assert pick_num_splits(2, 4, 32768, 128) == 1
    assert pick_num_splits(1, 4, 32768, 128) == 8
    assert pick_num_splits(1, 1, 4096, 128) == 8
    assert pick_num_splits(1, 2, 1024, 128) == 2  # nS 8
    assert pick_num_splits(1, 2, 1000, 128) == 2  # nS = cdiv(1000, 128) = 8
    assert pick_num_splits(7, 1, 12 * 128, 128) == 3
    assert pick_num_splits(1, 1, 3 * 128, 128) == 1  # too few tiles to split
    # triton: enough splits for B*K*P to reach 132 programs (the SMs of an H100), at most
    # 32, at most nS // 4 (measured on an H100: benchmarks/results/device/h100-2026-11-26).
    assert pick_num_splits(1, 8, 32768, 128, "triton") == 17  # cdiv(132, 8)
    assert pick_num_splits(8, 8, 32768, 128, "triton") == 3
    assert pick_num_splits(1, 1, 32768, 128, "triton") == 32
    assert pick_num_splits(1, 8, 1024, 128, "triton") == 2  # nS 8 -> at most 2
    assert pick_num_splits(33, 4, 32768, 128, "triton") == 1  # 132 programs already
    # The split grid, as `split_tiles` documents: chunk = cdiv(nS, P), P' = cdiv(nS, chunk).
    assert kernel.split_tiles(7, 3) == (3, 3) and kernel.split_tiles(10, 6) == (2, 5)
    assert kernel.split_tiles(5, 4) == (2, 3) and kernel.split_tiles(1, 8) == (1, 1)

    # decode_attention(num_splits=None) runs what the rule picks.
    def split_width(B, K, S, **kw):
        args = _inputs(B, 1, K, K, S, 64, [S] * B)
        jaxpr = str(jax.make_jaxpr(functools.partial(
            decode_attention, block_s=128, interpret=True, **kw))(*args))
        if "decode_attention_split" not in jaxpr:
            return 1
        return next(P for P in range(2, 9) if f"f32[{B},{K},{P},1,64]" in jaxpr)

    assert split_width(1, 2, 1024) == 2 and split_width(1, 1, 4096) == 8
    assert split_width(4, 2, 4096) == 1 and split_width(1, 1, 4096, num_splits=1) == 1
    assert split_width(1, 1, 4096, num_splits=3) == 3

    q, kc, vc, ln, kn, vn = _inputs(1, 1, 2, 2, 64, 64, [3])
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(ValueError, match="num_splits"):
            decode_attention(q, kc, vc, ln, kn, vn, num_splits=bad)


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "triton")])
def test_split_lowers_for_tpu_and_gpu_at_qwen3_8b_decode_shape(platform, backend):
    """B 1, T 8, N 32, K 8, H 128, S 32768, bf16, P = 8: the split kernels lower (Mosaic
    tpu_custom_call / Triton) without the hardware, in both modes."""
    B, T, N, K, S, H, P = 1, 8, 32, 8, 32768, 128, 8
    spec = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    args = (spec((B, T, N, H), dt), spec((B, K, S, H), dt), spec((B, K, S, H), dt),
            spec((B,), jnp.int32), spec((B, T, K, H), dt), spec((B, T, K, H), dt))
    marker = "tpu_custom_call" if platform == "tpu" else "triton"
    for mode in ("causal", "block"):
        f = functools.partial(decode_attention, mode=mode, interpret=False,
                              backend=backend, num_splits=P)
        exported = export_for(jax.jit(f), platform, *args)
        text = exported.mlir_module()
        assert marker in text, mode
        # The partial accumulators [B, K, P, T*R, H] f32 come out of the kernel.
        assert f"tensor<{B}x{K}x{P}x{T * N // K}x{H}xf32>" in text, mode
        assert exported.out_avals[0].shape == (B, T, N, H)
