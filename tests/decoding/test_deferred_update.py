"""Autoregressive steps under an adaptive schedule put the drafter's update off
(`specjax.decoding.adaptive.loop.Deferred`): one update over the buffered features of m
autoregressive steps (window G + 1, m - 1 "accepted") leaves the drafter proposing what
m one-token updates leave it proposing; the loop's greedy output stays the target's and
the catch-up really runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.drafter import LoopView
from specjax.decoding.adaptive import GammaSchedule
from specjax.decoding.loop import LoopConfig
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.drafters import make_drafter
from tests.decoding.test_speculative_greedy import TP, models, prompts
from tests.drafters.test_drafters import T1, net_for

G = 4


@pytest.mark.parametrize("kind,context,m", [  # hybrid holds eagle3's and kv's updates
    pytest.param("eagle3", None, 3, marks=pytest.mark.slow), ("eagle3", None, G + 1),
    ("hybrid", None, 2), pytest.param("kv", None, 4, marks=pytest.mark.slow),
    ("block", "both", 3), pytest.param("medc", None, 5, marks=pytest.mark.slow)])
def test_one_update_over_the_buffer_equals_one_per_step(kind, context, m):
    target, _ = models()
    dcfg, net = net_for(kind, context)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=T1)
    update, propose = jax.jit(drafter.update), jax.jit(drafter.propose)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, sampling=T1)
    toks, lens = prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    d0 = drafter.init(dparams, view, key)
    tokens, lengths, cache = state.tokens, state.lengths, state.cache
    B = lengths.shape[0]
    per_step, feats, start = d0, [], lengths - 1
    for _ in range(m):  # m autoregressive steps, each feeding the drafter at once
        pos = (lengths - 1)[:, None]
        out = target(jnp.take_along_axis(tokens, pos, axis=1), pos, cache,
                     capture=drafter.capture)
        nxt = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        tokens = tokens.at[jnp.arange(B), lengths].set(nxt)
        lengths = lengths + 1
        cache = out.cache.rewind(lengths - 1)
        per_step = update(dparams, per_step, LoopView(tokens, lengths, cache, out.hidden, pos),
                          jnp.zeros((B,), jnp.int32))
        feats.append(out.hidden)
    hidden = None
    if feats[0] is not None:  # the buffer: m slots filled, the rest zeros
        hidden = jnp.concatenate(feats + [jnp.zeros_like(feats[0])] * (G + 1 - m), axis=2)
    window = start[:, None] + jnp.arange(G + 1)[None, :]
    deferred = update(dparams, d0, LoopView(tokens, lengths, cache, hidden, window),
                      jnp.full((B,), m - 1, jnp.int32))
    view = LoopView(tokens, lengths, cache, None, (lengths - 1)[:, None])
    d_a, q_a, _ = propose(dparams, per_step, view, jax.random.key(9))
    d_b, q_b, _ = propose(dparams, deferred, view, jax.random.key(9))
    np.testing.assert_array_equal(np.asarray(d_a), np.asarray(d_b))
    np.testing.assert_allclose(np.asarray(q_a), np.asarray(q_b), atol=2e-5, rtol=1e-4)
    # power: without the catch-up the drafter would propose otherwise
    _, q_c, _ = propose(dparams, d0, view, jax.random.key(9))
    assert np.abs(np.asarray(q_c) - np.asarray(q_a)).max() > 1e-3


def test_scripted_schedule_is_exact_and_catches_up():
    """The loop's branches driven by a script: runs of autoregressive steps shorter and
    longer than the buffer (G + 1) between speculative steps; the greedy output equals
    the target's, the buffer empties when full and before each speculative step."""
    from flax import nnx

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.adaptive.loop import adaptive_phases
    from specjax.decoding.loop import autoregressive_loop

    target, _ = models()
    dcfg, net = net_for("eagle3", None)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=SamplingParams())
    g, params = nnx.split(target)
    new = 40
    cfg = LoopConfig(max_length=TP + new, prompt_width=TP,
                     schedule=GammaSchedule((0, G), policy="random"))
    toks, lens = prompts()
    args = (toks, lens, jnp.full((4,), new, jnp.int32), jax.random.key(1))
    start, _, branch = adaptive_phases(g, drafter, cfg)
    s = jax.jit(start)(params, dparams, *args)
    assert s.ext["adaptive"].deferred.hidden.shape[2] == G + 1
    step = jax.jit(branch)
    script = [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1] + [0] * 3 + [1] * 60
    counts = []
    for index in script:
        s = step(params, dparams, s, jnp.int32(index))
        counts.append(int(s.ext["adaptive"].deferred.count))
        if bool(s.done.all()):
            break
    # 2 buffered, emptied by the speculative step; 7 AR steps: full (5) -> emptied, 2
    assert counts[:11] == [1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 0], counts
    assert bool(s.done.all())
    ar = autoregressive_loop(g, params, cfg, *args)
    for b, n in enumerate(np.asarray(ar.lengths)):
        assert int(s.lengths[b]) == n
        np.testing.assert_array_equal(np.asarray(s.tokens)[b, :n],
                                      np.asarray(ar.tokens)[b, :n])
