"""The CPU-only fast paths of the decoding loops: weight-major products of a few rows
(`specjax.models.matmul.linear`) and chunked prefill that skips chunks past every prompt
(`specjax.decoding.loop.prefill.prefill`). Both change how the same values are computed, never which:
checked against float64 numpy and against the one-pass prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding.loop import LoopConfig
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.models import matmul as model_lib
from tests.decoding.test_speculative_greedy import models


def _uses_barrier(fn, *args) -> bool:
    return "optimization_barrier" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("lead", [(1, 1), (1, 2), (2, 4), (1, 6), (1, 8), (3, 3), (4, 32),
                                  (3, 43)])
def test_linear_f32_against_float64(lead):
    """f32 `linear` for 1..129 rows (B*T) against float64 numpy, value and gradient; the
    weight-major form (an optimization barrier in the jaxpr) is taken for 2..128 rows only,
    on the CPU backend these tests run on, with 5-16 rows (6 and 9 here) padded to a
    multiple of 8 first."""
    rng = np.random.RandomState(sum(lead))
    x = rng.standard_normal((*lead, 96)).astype(np.float32)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    rows = int(np.prod(lead))
    assert _uses_barrier(model_lib.linear, x, w) == (2 <= rows <= 128)
    got = np.asarray(model_lib.linear(jnp.asarray(x), jnp.asarray(w)))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (*lead, 40) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # d/dx and d/dw of sum(linear(x, w) * c) are c @ w and c^T x (float64 reference).
    c = rng.standard_normal((*lead, 40)).astype(np.float32)
    gx, gw = jax.grad(lambda x, w: jnp.sum(model_lib.linear(x, w) * c), (0, 1))(x, w)
    c64 = c.reshape(rows, 40).astype(np.float64)
    np.testing.assert_allclose(np.asarray(gx).reshape(rows, 96), c64 @ w, rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(gw), c64.T @ x.reshape(rows, 96), rtol=1e-5,
                               atol=1e-3)


def test_linear_weight_major_limit_is_a_switch(monkeypatch):
    """CPU_WEIGHT_MAJOR_MAX_ROWS = 0 turns the weight-major form off (benchmarks/
    matmul_rows.py compares both this way) without changing the values beyond rounding."""
    x = jnp.asarray(np.random.RandomState(0).standard_normal((1, 8, 64)), jnp.float32)
    w = jnp.asarray(np.random.RandomState(1).standard_normal((32, 64)), jnp.float32)
    on = model_lib.linear(x, w)
    monkeypatch.setattr(model_lib, "CPU_WEIGHT_MAJOR_MAX_ROWS", 0)
    assert not _uses_barrier(model_lib.linear, x, w)
    np.testing.assert_allclose(np.asarray(model_lib.linear(x, w)), np.asarray(on),
                               rtol=1e-5, atol=1e-5)


def test_linear_weight_major_padding(monkeypatch):
    """5-16 rows are padded to a multiple of 8 (`_weight_major_width`); the zero rows
    change no real row beyond rounding, and CPU_WEIGHT_MAJOR_PAD_ROWS switches it off
    (benchmarks/matmul_rows.py's "f32 unpadded")."""
    assert [model_lib._weight_major_width(r) for r in (2, 4, 5, 7, 8, 9, 16, 17, 40)] == \
        [2, 4, 8, 8, 8, 16, 16, 17, 40]
    x = jnp.asarray(np.random.RandomState(2).standard_normal((1, 7, 64)), jnp.float32)
    w = jnp.asarray(np.random.RandomState(3).standard_normal((32, 64)), jnp.float32)
    assert "pad" in str(jax.make_jaxpr(model_lib.linear)(x, w))
    padded = model_lib.linear(x, w)
    monkeypatch.setattr(model_lib, "CPU_WEIGHT_MAJOR_PAD_ROWS", (0, -1))
    assert model_lib._weight_major_width(7) == 7
    fresh = lambda x, w: model_lib.linear(x, w)  # noqa: E731 (make_jaxpr caches per function)
    assert "pad" not in str(jax.make_jaxpr(fresh)(x, w))
    np.testing.assert_allclose(np.asarray(model_lib.linear(x, w)), np.asarray(padded),
                               rtol=1e-5, atol=1e-5)


def test_bf16_linear_vmapped_over_drafts_is_weight_major():
    """Under a vmap over the axis named `DRAFTS_AXIS` (propose_drafts' vmap over K
    drafts) the bf16 product is taken weight-major, OI,MI->OM (row-major under vmap made
    XLA:CPU transpose every weight once per decoding step); under an unnamed or
    otherwise named vmap it stays row-major. The same values either way: each against a
    float64 reference of the bf16-rounded inputs."""
    rng = np.random.RandomState(7)
    x = jnp.asarray(rng.standard_normal((3, 1, 64)), jnp.float32)  # K=3 copies of 1 row
    w = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
    seen = []

    def f(x):
        seen.append(model_lib.vmapped_copies())  # at trace time
        return model_lib.linear(x, w)

    drafts = jax.vmap(f, axis_name=model_lib.DRAFTS_AXIS)
    plain, other = jax.vmap(f), jax.vmap(f, axis_name="other")
    assert "transpose" in str(jax.make_jaxpr(drafts)(x))
    for row_major in (plain, other):
        assert "transpose" not in str(jax.make_jaxpr(row_major)(x))
    assert seen == [3, 1, 1] and model_lib.vmapped_copies() == 1
    ref = (np.asarray(x.astype(jnp.bfloat16), np.float64)
           @ np.asarray(w, np.float64).T)
    for got in (drafts(x), plain(x), other(x)):
        assert got.shape == (3, 1, 32) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)


def _dots(fn, *args) -> list[tuple]:
    """(lhs shape, rhs shape) of every dot_general in fn's jaxpr, sub-jaxprs included."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                found.append(tuple(tuple(v.aval.shape) for v in e.invars))
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_propose_drafts_vmap_takes_bf16_products_weight_major():
    """`propose_drafts` (the loop's K drafts per step) vmaps `drafter.propose` over
    `DRAFTS_AXIS`: a drafter whose proposal is one bf16 product gets the weight-major
    form there and the row-major form when it proposes alone."""
    from specjax.core.sampling import SamplingParams
    from specjax.decoding.loop import propose_drafts

    class Product:  # a drafter whose draft is the argmax of one bf16 product
        sampling = SamplingParams()

        def propose(self, params, state, view, key, first_rank=None):
            y = model_lib.linear(params["x"], params["w"])  # [B,1,O]
            draft = jnp.argmax(y, axis=-1).astype(jnp.int32)  # [B,1]
            return draft, None, state

    rng = np.random.RandomState(8)
    params = {"x": jnp.asarray(rng.standard_normal((2, 1, 64)), jnp.float32),
              "w": jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)}
    pending = jnp.zeros((2,), jnp.int32)

    def drafts(params):
        return propose_drafts(Product(), params, None, None, jax.random.key(0), 3, pending)

    def alone(params):
        return Product().propose(params, None, None, jax.random.key(0))[0]

    w = params["w"].shape
    assert [lhs for lhs, _ in _dots(drafts, params)] == [w]  # OI,MI->OM: weights first
    assert [lhs for lhs, _ in _dots(alone, params)] == [(2, 64)]  # MI,OI->MO
    tree = drafts(params)
    want = np.asarray(alone(params))[:, 0]
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:, 1:],  # K identical drafts
                                  np.repeat(want[:, None], 3, axis=1))


def _run_prefill(chunk, width, lengths, capture=(0, 2), min_chunk=None):
    target, _ = models()
    V = target.cfg.vocab_size
    rs = np.random.RandomState(5)
    prompts = jnp.asarray(rs.randint(2, V, size=(len(lengths), width)), jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    cfg = LoopConfig(max_length=width + 8, prompt_width=width, prefill_chunk=chunk,
                     prefill_min_chunk=min_chunk)
    g, p = nnx.split(target)

    @jax.jit
    def run(p, prompts, lens):
        model = nnx.merge(g, p)
        budgets = jnp.full(lens.shape, 4, jnp.int32)
        state, view = _prefill(model, cfg, prompts, lens, budgets, jax.random.key(0), 0,
                               capture)
        return state.tokens, state.cache.k, view.hidden

    return run(p, prompts, lens)


def test_chunked_prefill_skips_chunks_past_every_prompt():
    """Width 16 in chunks of 4 with prompts of 3 and 6 tokens: chunks 0 and 1 run (their
    padding writes slots 6 and 7, later made stale by the rewind), chunks 2 and 3 start
    past both prompts and write nothing. First tokens and the hidden states of the prompt
    tokens equal the one-pass prefill's."""
    lengths = [3, 6]
    tok1, k1, hid1 = _run_prefill(16, 16, lengths)  # one pass (width <= chunk)
    tok4, k4, hid4 = _run_prefill(4, 16, lengths)
    k4 = np.asarray(k4)  # [L, B, K, S, H]
    assert np.all(k4[:, :, :, 8:16] == 0), "a chunk past every prompt ran"
    assert np.all(np.any(k4[:, :, :, :8] != 0, axis=(0, 2, 4))), "a needed chunk was skipped"
    assert np.all(np.any(np.asarray(k1)[:, :, :, 8:16] != 0, axis=(0, 2, 4)))
    np.testing.assert_array_equal(np.asarray(tok4)[:, :17], np.asarray(tok1)[:, :17])
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(hid4)[:, b, :n], np.asarray(hid1)[:, b, :n],
                                   rtol=2e-5, atol=2e-5)
        assert np.all(np.asarray(hid4)[:, b, 8:] == 0)


@pytest.mark.parametrize("lengths,end", [
    ([3, 11], 12),  # one whole chunk of 8, then a piece of 4 for positions 8..10
    ([3, 5], 8),  # no whole chunk; the rest (5) needs a piece of 8
    ([2, 1], 2),  # a piece of 2
    ([16, 4], 16),  # two whole chunks, nothing left
])
def test_prefill_pieces_cover_the_longest_prompt(lengths, end):
    """Width 16 in pieces of (8, 4, 2): whole chunks of 8 while they fit, then the rest as
    one piece of the smallest size that covers it. Slots up to `end` (worked out by hand
    above) are written, none after; first tokens and the prompts' hidden states equal the
    one-pass prefill's."""
    tok1, _, hid1 = _run_prefill(16, 16, lengths)
    tokp, kp, hidp = _run_prefill(8, 16, lengths, min_chunk=2)
    kp = np.asarray(kp)  # [L, B, K, S, H]
    assert np.all(kp[:, :, :, end:] == 0), "a piece past the longest prompt ran"
    assert np.all(np.any(kp[:, :, :, :end] != 0, axis=(0, 2, 4))), "a needed piece was skipped"
    np.testing.assert_array_equal(np.asarray(tokp)[:, :17], np.asarray(tok1)[:, :17])
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(hidp)[:, b, :n], np.asarray(hid1)[:, b, :n],
                                   rtol=2e-5, atol=2e-5)
        assert np.all(np.asarray(hidp)[:, b, end:] == 0)


@pytest.mark.parametrize("sizes", [(8,), (8, 4, 2, 1), (6, 3), (4, 2)])
@pytest.mark.parametrize("T", [5, 8, 13])
def test_scan_prompt_pieces_covers_each_position_once(sizes, T):
    """For every longest prompt N = 1..T: the pieces run in order, cover 0..N-1 exactly
    once, and their padding past N is less than the smallest size that could cover the
    rest (a whole chunk's worth of padding only with one size)."""
    from specjax.models.prefill import padded_width, scan_prompt_pieces

    width = padded_width(T, sizes)

    @jax.jit
    def cover(last):
        def forward(carry, start, size):
            count, order, n = carry
            hit = (jnp.arange(width) >= start) & (jnp.arange(width) < start + size)
            return count + hit, jnp.where(hit, n, order), n + 1

        zero = jnp.zeros(width, jnp.int32)
        return scan_prompt_pieces(forward, (zero, zero - 1, jnp.int32(0)), T, sizes, last)

    for N in range(1, T + 1):
        count, order, _ = (np.asarray(x) for x in cover(jnp.asarray([0, N - 1], jnp.int32)))
        covered = int(count.sum())
        assert count.max() == 1 and np.all(count[:covered] == 1), (N, count)
        assert covered >= N
        assert np.all(np.diff(order[:covered]) >= 0), "pieces out of order"
        rest = N % sizes[0] or sizes[0]
        smallest_cover = min([s for s in sizes if s >= rest])
        assert covered - N < smallest_cover, (N, covered)


def test_prefill_chunk_default_is_per_backend():
    assert LoopConfig(max_length=8, prompt_width=4).prefill_chunk is None
    for name in ("prefill_chunk", "prefill_min_chunk"):
        with pytest.raises(ValueError, match=name):
            LoopConfig(max_length=8, prompt_width=4, **{name: 0})
    assert LoopConfig(max_length=8, prompt_width=4).prefill_sizes() == (256, 128, 64)
    assert LoopConfig(max_length=8, prompt_width=4, prefill_chunk=64,
                      prefill_min_chunk=64).prefill_sizes() == (64,)
    from specjax.models.prefill import prefill_pieces

    assert prefill_pieces(24, 5) == (24, 12, 6)
    assert prefill_pieces(4, 32) == (4,)
    assert prefill_pieces(256, 32) == (256, 128, 64, 32)
