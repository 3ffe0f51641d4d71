"""The CPU-only fast paths of the decoding loops: weight-major products of a few rows
(`specjax.model.linear`) and chunked prefill that skips chunks past every prompt
(`specjax.generate._prefill`). Both change how the same values are computed, never which:
checked against float64 numpy and against the one-pass prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import model as model_lib
from specjax.generate import LoopConfig, _prefill
from tests.test_speculative_greedy import models


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


def _run_prefill(chunk, width, lengths, capture=(0, 2)):
    target, _ = models()
    V = target.cfg.vocab_size
    rs = np.random.RandomState(5)
    prompts = jnp.asarray(rs.randint(2, V, size=(len(lengths), width)), jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    cfg = LoopConfig(max_length=width + 8, prompt_width=width, prefill_chunk=chunk)
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


def test_prefill_chunk_default_is_per_backend():
    assert LoopConfig(max_length=8, prompt_width=4).prefill_chunk is None
    with pytest.raises(ValueError, match="prefill_chunk"):
        LoopConfig(max_length=8, prompt_width=4, prefill_chunk=0)
