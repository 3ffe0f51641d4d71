"""drafters.attend.attend with `Limit` sources: a long source read in chunks (merged with
short sources and the TTT diagonal under one softmax) equals the same call with bool
masks, and chunked drafters keep the loop's greedy output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import attend as attend_lib


@pytest.mark.parametrize("with_short,with_diag", [(False, False), (True, False), (True, True)])
def test_limit_chunked_equals_bool_mask(monkeypatch, with_short, with_diag):
    rng = np.random.default_rng(0)
    B, T, N, K, H, S = 2, 3, 4, 2, 16, 70
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q = f(B, T, N, H)
    k, v = f(B, K, S, H), f(B, K, S, H)
    pos = jnp.asarray([[5, 6, 7], [40, 41, 60]], jnp.int32)
    full_mask = jnp.arange(S)[None, None, :] <= pos[:, :, None]
    short = [(f(B, K, 4, H), f(B, K, 4, H), jnp.asarray(rng.random((B, T, 4)) < 0.6))]
    diag = [(f(B, T, K, H), f(B, T, K, H))] if with_diag else []
    extra = short if with_short else []
    want = attend_lib.attend(q, [(k, v, full_mask), *extra], diag)
    monkeypatch.setattr(attend_lib, "ATTEND_CHUNK", 16)
    got = attend_lib.attend(q, [(k, v, attend_lib.Limit(pos)), *extra], diag)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind,context", [("eagle3", None), ("kv", None), ("hybrid", None),
                                          ("block", "both")])
def test_chunked_drafters_keep_greedy_output(monkeypatch, kind, context):
    from tests.drafters.test_drafters_decode import BUDGETS, rows, run_ar, run_learned

    monkeypatch.setattr(attend_lib, "ATTEND_CHUNK", 8)
    jax.clear_caches()  # retrace: the chunk is read at trace time
    try:
        sp = run_learned(kind, context, 3, BUDGETS)
        assert rows(sp) == rows(run_ar(BUDGETS))
    finally:
        jax.clear_caches()
