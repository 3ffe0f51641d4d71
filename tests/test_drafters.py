"""Learned drafters: the incremental decoding path (init / propose / update with caches
read in place) equals the parallel training path (TTT unroll, packed blocks) on the same
committed tokens; causality; the KV merge; the hybrid's gate."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.base import LoopView
from specjax.generate import LoopConfig, _prefill
from specjax.sampling import SamplingParams
from specjax.train.objectives import Frozen
from specjax.train.objectives.ttt import draft_outputs
from tests.test_speculative_greedy import CFG, TP, V, models, prompts

KINDS = [("eagle3", None), ("kv", None), ("hybrid", None), ("block", "hidden"),
         ("block", "kv"), ("block", "both")]
T1 = SamplingParams(temperature=1.0)  # q = softmax(draft logits): compares distributions


@functools.cache
def net_for(kind, context, seed=0):
    dcfg = DrafterConfig.for_target(CFG, kind, context=context, gamma=4,
                                    mask_token_id=1 if kind == "block" else None)
    net = build_network(dcfg, rngs=nnx.Rngs(seed))
    # Random-init weights are tiny (std 0.02): scale them so the drafter is opinionated
    # and a wrong cache entry would show in q.
    graphdef, state = nnx.split(net)
    state = jax.tree.map(lambda x: x * 20.0 if x.ndim >= 2 and x.shape[-2] != x.shape[-1]
                         else x, state)
    return dcfg, nnx.merge(graphdef, state)


def reference_q(kind, net, dcfg, target, tokens, lengths, draft):
    """Draft distributions from the training path on committed tokens + drafts: f32[B,G,V]."""
    B, G = draft.shape
    n = np.asarray(lengths) + G
    W = int(n.max())
    rows = np.zeros((B, W + 1), np.int32)
    for b in range(B):
        seq = np.concatenate([np.asarray(tokens)[b, :lengths[b]], np.asarray(draft)[b]])
        rows[b, :len(seq)] = seq
    rows = jnp.asarray(rows)
    pos = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    tgt = target(rows[:, :W], pos, None, capture=dcfg.capture, capture_kv=dcfg.kv_layers)
    frozen = Frozen.from_target(target)
    if kind == "block":
        ctx = net.contexts(tgt.hidden, tgt.kv, pos, frozen.inv_freq)
        out = net.blocks(ctx, (lengths - 1)[:, None], rows[:, :W], frozen.embed,
                         frozen.inv_freq, G)[:, 0, 1:]  # [B,G,D]
    else:
        outs, _ = draft_outputs(net, tgt, rows, frozen, G)  # [G,B,W,D]
        out = jnp.take_along_axis(outs, (lengths - 2)[None, :, None, None], axis=2)[:, :, 0]
        out = out.swapaxes(0, 1)
    return jax.nn.softmax(net.logits(out, frozen.head), axis=-1)


@pytest.mark.parametrize("kind,context", KINDS)
def test_decoding_path_equals_training_path(kind, context):
    G = 4
    target, _ = models()
    dcfg, net = net_for(kind, context)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=T1)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, sampling=T1)
    toks, lens = prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    dstate = drafter.init(dparams, view, key)
    tokens, lengths, cache = state.tokens, state.lengths, state.cache
    B = lengths.shape[0]
    for round_ in range(3):
        view = LoopView(tokens, lengths, cache, None, (lengths - 1)[:, None])
        draft, q, dstate = drafter.propose(dparams, dstate, view, jax.random.key(round_))
        want = reference_q(kind, net, dcfg, target, tokens, lengths, draft)
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
        dstate = drafter.update(dparams, dstate, after, n_acc)
