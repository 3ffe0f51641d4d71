"""Learned drafters (eagle3, kv, hybrid, block) in the real loop: greedy output equals
autoregressive decoding token for token, for every kind, G in {1, 3, 5}, ragged budgets
and EOS; random-init drafters are enough for identity (the verifier decides)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.drafters import DrafterConfig, build_network, make_drafter
from tests.decoding.test_speculative_greedy import (
    BUDGETS,
    PROMPT_LENS,
    TP,
    models,
    prompts,
    rows,
    run_ar,
)

KINDS = [("eagle3", None), ("kv", None), ("hybrid", None), ("block", "hidden"),
         ("block", "kv"), ("block", "both"), ("block", "selector"),
         ("block", "causal")]


@functools.cache
def drafter_net(kind, context, seed=0):
    target, _ = models()
    # block, hidden context, with DFlash2's path selector or JetSpec's causal block
    option = context if context in ("selector", "causal") else None
    dcfg = DrafterConfig.for_target(target.cfg, kind, context="hidden" if option else context,
                                    gamma=3, mask_token_id=1 if kind == "block" else None)
    if option == "selector":
        dcfg = dataclasses.replace(dcfg, selector_rank=8, selector_top_k=4)
    if option == "causal":
        dcfg = dataclasses.replace(dcfg, block_causal=True)
    return dcfg, build_network(dcfg, rngs=nnx.Rngs(seed))


def run_learned(kind, context, G, budgets, eos=(), verify="block", matmul_dtype=None,
                draft_vocab=None, stop_below=0.0, prefill=(None, None)):
    target, _ = models()
    dcfg, net = drafter_net(kind, context)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, matmul_dtype=matmul_dtype,
                                    draft_vocab=draft_vocab, stop_below=stop_below)
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, eos_token_ids=eos, verify=verify,
                     prefill_chunk=prefill[0], prefill_min_chunk=prefill[1])
    toks, lens = prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


# the default run: every kind at G = 3, G = 1 and 5 for every fourth (all in the slow run)
@pytest.mark.parametrize("kind,context,G", [
    pytest.param(*kc, G, marks=() if G == 3 or i % 4 == (0 if G == 1 else 2)
                 else pytest.mark.slow)
    for G in (1, 3, 5) for i, kc in enumerate(KINDS)])
def test_greedy_equals_autoregressive(kind, context, G):
    sp = run_learned(kind, context, G, BUDGETS)
    assert rows(sp) == rows(run_ar(BUDGETS))
    lens = np.asarray(sp.lengths) - PROMPT_LENS
    assert lens.tolist() == BUDGETS


@pytest.mark.parametrize("stop", [0.3, 1.0])
@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_early_stop_greedy_equals_autoregressive(kind, stop):
    """--draft-stop: fillers after the stop change nothing (EOS inside a block too)."""
    sp = run_learned(kind, None, 5, BUDGETS, eos=(3,), stop_below=stop)
    assert rows(sp) == rows(run_ar(BUDGETS, eos=(3,)))


@pytest.mark.parametrize("kind,context", [("eagle3", None), ("block", "both")])
def test_bf16_drafter_matmuls_stay_lossless(kind, context):
    """decode.py's default --drafter-dtype: bf16 drafter matmuls (one-row inputs padded on
    CPU) change only q; the output is still the f32 target's autoregressive output."""
    sp = run_learned(kind, context, 3, BUDGETS, matmul_dtype=jnp.bfloat16)
    assert rows(sp) == rows(run_ar(BUDGETS))


@pytest.mark.parametrize("rows_", [1, 2, 7])
def test_linear_bf16_against_float64(rows_):
    """specjax.models.matmul.linear with bf16 weights: bf16-rounded inputs, f32 accumulation; checked
    against float64 numpy on the same rounded values (the padded one-row path too)."""
    import ml_dtypes

    from specjax.models.matmul import linear

    rng = np.random.RandomState(rows_)
    x = rng.standard_normal((rows_, 1, 96)).astype(np.float32)
    w = rng.standard_normal((40, 96)).astype(ml_dtypes.bfloat16)
    got = np.asarray(linear(jnp.asarray(x), jnp.asarray(w)))
    assert got.dtype == np.float32 and got.shape == (rows_, 1, 40)
    x64 = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    want = np.einsum("bti,oi->bto", x64, w.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # f32 weights: the plain f32 product
    w32 = w.astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), jnp.asarray(w32))),
                               np.einsum("bti,oi->bto", x.astype(np.float64),
                                         w32.astype(np.float64)), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- trained

@functools.cache
def trained(kind, context, G=3, steps=250):
    """A drafter trained for `steps` Adam steps on the tiny target's own greedy outputs,
    and its simulated tau before and after (held-in rows: this checks that the objectives
    train and that acceptance in the loop follows, not generalisation)."""
    import optax

    from specjax.decoding.loop import autoregressive_loop
    from specjax.train.objectives import Frozen, summarize
    from specjax.train.objectives.block import block_loss
    from specjax.train.objectives.ttt import ttt_loss

    target, _ = models()
    dcfg = DrafterConfig.for_target(target.cfg, kind, context=context, gamma=G,
                                    mask_token_id=1 if kind == "block" else None)
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    net.final_norm.set_value(target.final_norm[...])
    g, p = nnx.split(target)
    N, P, new = 32, 4, 28
    starts = jnp.asarray(np.random.RandomState(1).randint(2, target.cfg.vocab_size, (N, P)),
                         jnp.int32)
    res = autoregressive_loop(g, p, LoopConfig(max_length=P + new, prompt_width=P), starts,
                              jnp.full((N,), P, jnp.int32), jnp.full((N,), new, jnp.int32),
                              jax.random.key(0))
    data = res.tokens[:, :P + new]  # [N, T+1]
    T = data.shape[1] - 1
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    tgt = target(data[:, :T], pos, None, capture=dcfg.capture, capture_kv=dcfg.kv_layers)
    frozen = Frozen.from_target(target)
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def loss(params, key):
        n = nnx.merge(graphdef, params, rest)
        if kind == "block":
            return block_loss(n, tgt, data, frozen, key, num_anchors=8, gamma=G)
        return ttt_loss(n, tgt, data, frozen, steps=G)

    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt, key):
        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params, key)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, stats

    opt = tx.init(params)
    before = summarize(jax.device_get(loss(params, jax.random.key(0))[1]))["tau"]
    for i in range(steps):
        params, opt, stats = step(params, opt, jax.random.key(i))
    after = summarize(jax.device_get(loss(params, jax.random.key(0))[1]))["tau"]
    return dcfg, nnx.merge(graphdef, params, rest), before, after


def run_trained(kind, context, budgets, eos=()):
    target, _ = models()
    dcfg, net, _, _ = trained(kind, context)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=3)
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, eos_token_ids=eos)
    toks, lens = prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


@pytest.mark.parametrize("kind,context", [pytest.param("eagle3", None, marks=pytest.mark.slow),
                                          ("block", "hidden")])
def test_trained_drafter_is_accepted_and_stops_at_eos_inside_a_block(kind, context):
    _, _, before, after = trained(kind, context)
    assert after > before + 0.5, (before, after)  # the objective trains the drafter
    sp = run_trained(kind, context, BUDGETS)
    assert rows(sp) == rows(run_ar(BUDGETS))
    acc, steps = np.asarray(sp.accepted), np.asarray(sp.steps)
    assert acc[:, -1].sum() > 0  # whole blocks were accepted in the real loop
    assert 1 + acc.sum() / steps.sum() > 1.5
    # An EOS that the target emits inside an accepted block ends the row right there.
    out0 = rows(run_ar(BUDGETS))[0][PROMPT_LENS[0]:]
    eos = out0[6]
    first = out0.index(eos)
    sp_eos = run_trained(kind, context, BUDGETS, (eos,))
    assert rows(sp_eos) == rows(run_ar(BUDGETS, (eos,)))
    assert rows(sp_eos)[0][PROMPT_LENS[0]:] == out0[:first + 1]
    # The verification steps of row 0 emitted `first` tokens after the prefill's; they
    # accepted more than that (tau + 1 per step), so the last block was cut at the EOS.
    acc0, steps0 = int(np.asarray(sp_eos.accepted)[0].sum()), int(np.asarray(sp_eos.steps)[0])
    assert acc0 + steps0 > first, (acc0, steps0, first)


@pytest.mark.parametrize("kind,context", [(None, None), ("eagle3", None), ("kv", None),
                                          ("block", "both")])
def test_chunked_prefill_and_attention_keep_greedy_output(kind, context):
    """Prompts prefilled in pieces of (4, 2, 1) (two whole chunks of the 9-wide prompts,
    then a piece of 1) and the target attending to its cache 8 slots at a time (specjax.models.attention): the greedy
    output is still autoregressive decoding's, for AR and for drafters that read the
    prefill's hidden states or the target cache."""
    from specjax.decoding.loop import autoregressive_loop

    target, _ = models()
    chunked = nnx.merge(*nnx.split(target))
    chunked.attention_chunk = 8
    g, p = nnx.split(chunked)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, prefill_chunk=4,
                     prefill_min_chunk=1)
    toks, lens = prompts()
    budgets = jnp.asarray(BUDGETS, jnp.int32)
    if kind is None:
        got = autoregressive_loop(g, p, cfg, toks, lens, budgets, jax.random.key(0))
    else:
        dcfg, net = drafter_net(kind, context)
        drafter, dparams = make_drafter(dcfg, net, chunked, gamma=3)
        got = speculative_loop(g, p, drafter, dparams, cfg, toks, lens, budgets,
                               jax.random.key(0))
    assert rows(got) == rows(run_ar(BUDGETS))


@pytest.mark.parametrize("sizes,end", [((4,), 8), ((4, 2, 1), 6)])
@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_chunked_drafter_init_equals_one_pass(kind, sizes, end):
    """eagle3/hybrid init over 16-wide prompts of 3 and 6 tokens (after the prefill's
    first token, last entries 2 and 5): in chunks of 4, chunks 0 and 1 run and chunks 2
    and 3 write nothing; in pieces of (4, 2, 1), chunk 0 and a piece of 2 for entries 4
    and 5 run. Slots from `end` on stay empty; h_last and the entries 0..lengths-2 equal
    the one-pass init's."""
    from specjax.decoding.loop.prefill import prefill as _prefill

    target, _ = models()
    dcfg, net = drafter_net(kind, None)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=3)
    lengths = jnp.asarray([3, 6], jnp.int32)
    width = 16
    toks = jnp.asarray(np.random.RandomState(5).randint(2, target.cfg.vocab_size,
                                                        size=(2, width)), jnp.int32)
    cfg = LoopConfig(max_length=width + 8, prompt_width=width, prefill_chunk=width)
    g, p = nnx.split(target)

    @functools.partial(jax.jit, static_argnums=0)
    def init(sizes, p, dparams):
        state, view = _prefill(nnx.merge(g, p), cfg, toks, lengths,
                               jnp.full((2,), 4, jnp.int32), jax.random.key(0), 3,
                               drafter.capture)
        return drafter.init(dparams, view.replace(prefill_sizes=sizes), jax.random.key(1))

    one, four = init((width,), p, dparams), init(sizes, p, dparams)
    np.testing.assert_allclose(np.asarray(four.h_last), np.asarray(one.h_last), rtol=2e-5,
                               atol=2e-5)
    for a, b in [(four.cache.k, one.cache.k), (four.cache.v, one.cache.v)]:
        a, b = np.asarray(a), np.asarray(b)  # [1,B,K,S,H]
        assert np.all(a[:, :, :, end:] == 0), "a piece past every row ran"
        for row, n in enumerate(np.asarray(lengths)):
            np.testing.assert_allclose(a[:, row, :, :n], b[:, row, :, :n], rtol=2e-5,
                                       atol=2e-5)


@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_chunked_drafter_init_keeps_greedy_output(kind):
    """The loop with prefill pieces of (4, 2, 1) over the 9-wide prompts (ragged prompt
    lengths 2..9): the drafter's init takes the same pieces (`LoopView.prefill_sizes`),
    and the greedy output is still autoregressive decoding's."""
    sp = run_learned(kind, None, 3, BUDGETS, prefill=(4, 1))
    assert rows(sp) == rows(run_ar(BUDGETS))
