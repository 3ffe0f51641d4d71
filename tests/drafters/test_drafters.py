"""Learned drafters: the incremental decoding path (init / propose / update with caches
read in place) equals the parallel training path (TTT unroll, packed blocks) on the same
committed tokens; causality; the KV merge; the hybrid's gate."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.drafter import LoopView
from specjax.core.sampling import SamplingParams
from specjax.decoding.loop import LoopConfig
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.errors import SpecjaxError
from specjax.train.objectives import Frozen
from specjax.train.objectives.ttt import draft_outputs
from tests.decoding.test_speculative_greedy import CFG, TP, V, models, prompts

KINDS = [("eagle3", None), ("kv", None), ("hybrid", None), ("block", "hidden"),
         ("block", "kv"), ("block", "both"), ("block", "causal")]
T1 = SamplingParams(temperature=1.0)  # q = softmax(draft logits): compares distributions


@functools.cache
def net_for(kind, context, seed=0, scale=20.0):
    causal = context == "causal"  # block, hidden context, JetSpec's causal block
    dcfg = DrafterConfig.for_target(CFG, kind, context="hidden" if causal else context,
                                    gamma=4, mask_token_id=1 if kind == "block" else None)
    if causal:
        dcfg = dataclasses.replace(dcfg, block_causal=True)
    net = build_network(dcfg, rngs=nnx.Rngs(seed))
    # Random-init weights are tiny (std 0.02): scale them so the drafter is opinionated
    # and a wrong cache entry would show in q.
    graphdef, state = nnx.split(net)
    state = jax.tree.map(lambda x: x * scale if x.ndim >= 2 and x.shape[-2] != x.shape[-1]
                         else x, state)
    return dcfg, nnx.merge(graphdef, state)


W = TP + 32  # rows of the reference are right-padded to one width: one compile


@functools.partial(jax.jit, static_argnames=("graphdef", "tgraphdef", "G"))
def _reference(graphdef, state, tgraphdef, tstate, rows, lengths, G):
    net, target = nnx.merge(graphdef, state), nnx.merge(tgraphdef, tstate)
    dcfg, B = net.cfg, rows.shape[0]
    pos = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    tgt = target(rows[:, :W], pos, None, capture=dcfg.capture, capture_kv=dcfg.kv_layers)
    frozen = Frozen.from_target(target)
    if dcfg.kind == "block":
        ctx = net.contexts(tgt.hidden, tgt.kv, pos, frozen.inv_freq)
        out = net.blocks(ctx, (lengths - 1)[:, None], rows[:, :W], frozen.embed,
                         frozen.inv_freq, G)[:, 0, 1:]  # [B,G,D]
    else:
        outs, _ = draft_outputs(net, tgt, rows, frozen, G)  # [G,B,W,D]
        out = jnp.take_along_axis(outs, (lengths - 2)[None, :, None, None], axis=2)[:, :, 0]
        out = out.swapaxes(0, 1)
    return jax.nn.softmax(net.logits(out, frozen.head), axis=-1)


def reference_q(net, target, tokens, lengths, draft):
    """Draft distributions from the training path (TTT unroll or a packed block) on the
    committed tokens followed by the drafts: f32[B,G,V]."""
    B, G = draft.shape
    rows = np.zeros((B, W + 1), np.int32)
    for b in range(B):
        seq = np.concatenate([np.asarray(tokens)[b, :lengths[b]], np.asarray(draft)[b]])
        rows[b, :len(seq)] = seq
    return _reference(*nnx.split(net), *nnx.split(target), jnp.asarray(rows), lengths, G)


@pytest.mark.parametrize("kind,context", KINDS)
def test_decoding_path_equals_training_path(kind, context):
    G = 4
    target, _ = models()
    dcfg, net = net_for(kind, context)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=T1)
    init, propose, update = (jax.jit(f) for f in (drafter.init, drafter.propose,
                                                  drafter.update))
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, sampling=T1)
    toks, lens = prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    dstate = init(dparams, view, key)
    tokens, lengths, cache = state.tokens, state.lengths, state.cache
    B = lengths.shape[0]
    for round_ in range(3):
        view = LoopView(tokens, lengths, cache, None, (lengths - 1)[:, None])
        draft, q, dstate = propose(dparams, dstate, view, jax.random.key(round_))
        want = reference_q(net, target, tokens, lengths, draft)
        np.testing.assert_allclose(np.asarray(q), np.asarray(want), atol=2e-5, rtol=1e-4)
        assert float(jnp.max(q)) > 5.0 / V  # far from uniform: a wrong entry would show
        # A verification with a different number of accepted drafts per row (0..G), then
        # an arbitrary correction token, exactly as speculative_loop commits them.
        pos = (lengths - 1)[:, None] + jnp.arange(G + 1)[None, :]
        pending = jnp.take_along_axis(tokens, pos[:, :1], axis=1)
        out = target(jnp.concatenate([pending, draft], 1), pos, cache, capture=drafter.capture)
        n_acc = jnp.asarray([(b + round_) % (G + 1) for b in range(B)], jnp.int32)
        fix = (draft[:, 0] + 5) % V
        cand = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
        off = jnp.arange(G + 1)[None, :]
        cand = jnp.where(off == n_acc[:, None], fix[:, None], cand)
        write = jnp.where(off <= n_acc[:, None], lengths[:, None] + off, tokens.shape[1])
        tokens = tokens.at[jnp.arange(B)[:, None], write].set(cand, mode="drop")
        lengths = lengths + n_acc + 1
        cache = out.cache.rewind(lengths - 1)
        after = LoopView(tokens, lengths, cache, out.hidden, pos)
        dstate = update(dparams, dstate, after, n_acc)


@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_early_stop_drafts_a_prefix_then_fillers(kind):
    """stop_below: the drafts and q of the full propose up to the forward after which
    every row's chain confidence (product of top-1 q) fell below it, then the first draft
    token as a filler with one-hot q; same keys, so the drafted prefix is identical."""
    import dataclasses

    G = 4
    target, _ = models()
    dcfg, net = net_for(kind, None)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=T1)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, sampling=T1)
    toks, lens = prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    dstate = drafter.init(dparams, view, key)
    view = LoopView(state.tokens, state.lengths, state.cache, None,
                    (state.lengths - 1)[:, None])
    draft, q, _ = jax.jit(drafter.propose)(dparams, dstate, view, jax.random.key(5))
    conf = np.cumprod(np.max(np.asarray(q, np.float64), axis=-1), axis=1).max(axis=0)  # [G]
    assert conf[1] > conf[2], conf  # some row's chain loses confidence at draft 2
    thr = float(conf[1] + conf[2]) / 2  # forwards 0 and 1 run, then all rows are below
    stopped = dataclasses.replace(drafter, stop_below=thr)
    d2, q2, _ = jax.jit(stopped.propose)(dparams, dstate, view, jax.random.key(5))
    d2, q2 = np.asarray(d2), np.asarray(q2)
    np.testing.assert_array_equal(d2[:, :3], np.asarray(draft)[:, :3])
    np.testing.assert_allclose(q2[:, :3], np.asarray(q)[:, :3], atol=1e-6)
    np.testing.assert_array_equal(d2[:, 3], d2[:, 0])
    np.testing.assert_array_equal(q2[:, 3], np.eye(V)[d2[:, 0]])
    # Above every confidence: nothing stops; at 1.01 only the first draft is real.
    never = dataclasses.replace(drafter, stop_below=float(conf[-1]) / 2)
    np.testing.assert_array_equal(jax.jit(never.propose)(dparams, dstate, view,
                                                         jax.random.key(5))[0], draft)
    first = dataclasses.replace(drafter, stop_below=1.0)
    d3 = np.asarray(jax.jit(first.propose)(dparams, dstate, view, jax.random.key(5))[0])
    assert (d3 == d3[:, :1]).all() and (d3[:, 0] == np.asarray(draft)[:, 0]).all()


def test_early_stop_is_checked():
    target, _ = models()
    for kind, context, stop in (("eagle3", None, 1.5), ("block", "hidden", 0.5),
                                ("kv", None, 0.5)):
        dcfg, net = net_for(kind, context)
        with pytest.raises(SpecjaxError, match="--draft-stop"):
            make_drafter(dcfg, net, target, gamma=3, stop_below=stop)


# ----------------------------------------------------------------------------- causality

def _target_out(kind, context, T=12, seed=0):
    target, _ = models()
    dcfg, net = net_for(kind, context, scale=3.0)  # softmaxes far from saturation
    rows = jnp.asarray(np.random.RandomState(seed).randint(2, V, size=(2, T + 1)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    tgt = target(rows[:, :T], pos, None, capture=dcfg.capture, capture_kv=dcfg.kv_layers)
    return dcfg, net, rows, tgt, Frozen.from_target(target)


@pytest.mark.parametrize("kind", ["eagle3", "kv", "hybrid"])
def test_ttt_output_sees_nothing_after_its_anchor(kind):
    """Step k at anchor t: zero gradient from target features / K/V at positions > t, and
    no change when tokens after t+k+1 change."""
    dcfg, net, rows, tgt, frozen = _target_out(kind, None)
    G, t = 3, 5

    def out_at(hidden, kv, rows, k):
        outs, _ = draft_outputs(net, tgt._replace(hidden=hidden, kv=kv), rows, frozen, G)
        return outs[k, :, t].sum()

    for k in range(G):
        gh, gkv = jax.grad(out_at, argnums=(0, 1))(tgt.hidden, tgt.kv, rows, k)
        if gh is not None:
            assert float(jnp.abs(gh[:, :, t + 1:]).max()) == 0.0
            assert float(jnp.abs(gh[:, :, t]).max()) > 0.0
        if gkv is not None:
            for g in gkv:
                assert float(jnp.abs(g[:, :, :, t + 1:]).max()) == 0.0
                assert float(jnp.abs(g[:, :, :, t]).max()) > 0.0
        changed = rows.at[:, t + k + 2:].set((rows[:, t + k + 2:] + 1) % V)
        np.testing.assert_array_equal(np.asarray(out_at(tgt.hidden, tgt.kv, changed, k)),
                                      np.asarray(out_at(tgt.hidden, tgt.kv, rows, k)))
        seen = rows.at[:, t + k + 1].set((rows[:, t + k + 1] + 1) % V)
        assert out_at(tgt.hidden, tgt.kv, seen, k) != out_at(tgt.hidden, tgt.kv, rows, k)


@pytest.mark.parametrize("context", ["hidden", "kv", "both"])
def test_block_sees_only_context_before_its_anchor(context):
    dcfg, net, rows, tgt, frozen = _target_out("block", context)
    T = rows.shape[1] - 1
    anchors = jnp.asarray([[3, 6], [4, 7]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))

    def block_out(hidden, kv, j):
        ctx = net.contexts(hidden, kv, pos, frozen.inv_freq)
        return net.blocks(ctx, anchors, rows[:, :T], frozen.embed, frozen.inv_freq, 4)[:, j].sum()

    for j in range(2):
        gh, gkv = jax.grad(block_out, argnums=(0, 1))(tgt.hidden, tgt.kv, j)
        for b in range(2):
            a = int(anchors[b, j])
            for g in ([gh[:, b]] if dcfg.uses_hidden else []) + (
                    [x[:, b] for x in gkv] if dcfg.uses_kv else []):
                axis_t = g.ndim - 2 if g.ndim == 4 else 1  # kv [Ls,K,T,H]; hidden [C,T,D]
                after = jnp.take(g, jnp.arange(a, T), axis=axis_t)
                before = jnp.take(g, jnp.arange(0, a), axis=axis_t)
                assert float(jnp.abs(after).max()) == 0.0
                assert float(jnp.abs(before).max()) > 0.0


# ----------------------------------------------------------------------------- KV merge

def test_merge_initialised_to_one_layer_reproduces_its_attention():
    """At init each merged memory is exactly its source target layer's K/V (de-rotate,
    identity map, re-rotate), so any query attends to it as to that layer's cache."""
    from specjax.drafters.attend import attend

    dcfg, net, rows, tgt, frozen = _target_out("block", "kv")
    fresh = build_network(dcfg, rngs=nnx.Rngs(1))  # unscaled: merge maps at init
    T = rows.shape[1] - 1
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    mk, mv = fresh.memory_context(tgt.kv, pos, frozen.inv_freq)
    q = jax.random.normal(jax.random.key(0), (2, T, CFG.num_heads, CFG.head_dim))
    causal = pos[:, None, :] <= pos[:, :, None]
    for m, src in enumerate(dcfg.merge_sources()):
        np.testing.assert_allclose(np.asarray(mk[m]), np.asarray(tgt.kv[0][src]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(mv[m]), np.asarray(tgt.kv[1][src]), atol=1e-6)
        got = attend(q, [(mk[m], mv[m], causal)])
        want = attend(q, [(tgt.kv[0][src], tgt.kv[1][src], causal)])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# ----------------------------------------------------------------------------- hybrid

def test_hybrid_with_gate_zero_is_eagle3():
    """h = n + g * gate_d(o - n): with gate_d = 0 the hybrid's outputs, TTT and decoding,
    are exactly EAGLE-3's with the same shared weights."""
    target, _ = models()
    e_cfg, e_net = net_for("eagle3", None)
    h_cfg = DrafterConfig.for_target(CFG, "hybrid", gamma=4)
    hybrid = build_network(h_cfg, rngs=nnx.Rngs(5))
    shared = nnx.state(e_net, nnx.Param)
    nnx.update(hybrid, shared)
    hybrid.gate_d.set_value(jnp.zeros_like(hybrid.gate_d[...]))
    _, _, rows, tgt, frozen = _target_out("hybrid", None)
    e_out, _ = draft_outputs(e_net, tgt, rows, frozen, 3)
    h_out, gates = draft_outputs(hybrid, tgt, rows, frozen, 3)
    np.testing.assert_array_equal(np.asarray(h_out), np.asarray(e_out))
    assert 0.3 < float(gates.mean()) < 0.7  # the gate itself starts near 0.5
    toks, lens = prompts()
    cfg = LoopConfig(max_length=TP + 12, prompt_width=TP)
    g, p = nnx.split(target)
    budgets = jnp.full((4,), 12, jnp.int32)
    from specjax.decoding.loop import speculative_loop

    outs = []
    for dcfg, net in ((e_cfg, e_net), (h_cfg, hybrid)):
        drafter, dparams = make_drafter(dcfg, net, target, gamma=3)
        res = speculative_loop(g, p, drafter, dparams, cfg, toks, lens, budgets,
                               jax.random.key(0))
        outs.append((np.asarray(res.tokens), np.asarray(res.accepted), np.asarray(res.steps)))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["eagle3", "kv", "hybrid"])
def test_ttt_at_sampled_anchors_equals_full_unroll(kind):
    """ttt_positions: unrolling only P anchors gives exactly the full unroll there."""
    from specjax.train.objectives.ttt import sample_positions

    dcfg, net, rows, tgt, frozen = _target_out(kind, None)
    T = rows.shape[1] - 1
    anchors = sample_positions(jax.random.key(1), 2, T, 5)
    full, g_full = draft_outputs(net, tgt, rows, frozen, 3)
    some, g_some = draft_outputs(net, tgt, rows, frozen, 3, anchors)
    want = jnp.take_along_axis(full, anchors[None, :, :, None], axis=2)
    np.testing.assert_allclose(np.asarray(some), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert anchors.shape == (2, 5) and bool(jnp.all(anchors[:, 1:] > anchors[:, :-1]))
