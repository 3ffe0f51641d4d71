"""A draft tree over a block drafter with DFlash2's path selector (issue 52 section 2:
`specjax.core.tree.best_first_path_tree` with `specjax.drafters.selector.children`): a
child's distribution depends on its parent's token, and the tree is still the exact best
N - 1 prefixes, checked against a float64 numpy enumeration of every prefix; in the
compiled loop greedy output equals autoregressive decoding, and at T = 1 the output
follows the target's exact law, with the marginal-q power check of
tests/drafters/test_block_best_first_tree.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.core.tree import best_first_path_tree
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.drafters import DrafterConfig, build_network, make_drafter, selector
from specjax.drafters.dynamic_tree import DynamicTree
from tests.decoding import test_speculative_greedy as sg
from tests.drafters import test_block_best_first_tree as bf
from tests.drafters import test_lossless_drafters as tl

pytestmark = pytest.mark.timeout(600)


def _selector_inputs(seed, B=2, G=3, V=12, D=6, R=3):
    rng = np.random.default_rng(seed)
    pred, succ = rng.normal(size=(V, R)), rng.normal(size=(V, R)) * 1.5
    proj, h = rng.normal(size=(D, R)), rng.normal(size=(B, G, D))
    logits = rng.normal(size=(B, G, V)) * 2
    pending = rng.integers(0, V, size=B)
    return pred, succ, proj, h, logits, pending


def _ref_children(pred, succ, proj, h, logits, K, prev, d):
    """float64: {token: log-probability} of position d's K candidates given prev."""
    cand = np.argsort(-logits[d], kind="stable")[:K]
    s = logits[d, cand] + (pred[prev] * (h[d] @ proj)) @ succ[cand].T
    lp = s - s.max() - np.log(np.exp(s - s.max()).sum())
    return dict(zip(cand.tolist(), lp.tolist(), strict=True))


def _ref_best(args, b, K, N):
    """The N - 1 best prefixes (token tuples) of row b by summed log-probability."""
    pred, succ, proj, h, logits, pending = args
    G = h.shape[1]
    scored = {}

    def walk(prefix, prev, total):
        d = len(prefix)
        if d == G:
            return
        for tok, lp in _ref_children(pred, succ, proj, h[b], logits[b], K, prev, d).items():
            path = prefix + (tok,)
            scored[path] = total + lp
            walk(path, tok, total + lp)

    walk((), int(pending[b]), 0.0)
    best = sorted(scored, key=lambda p: -scored[p])[:N - 1]
    return set(best), scored


@pytest.mark.parametrize("K,N", [(2, 6), (3, 12), (3, 45)])
def test_selector_tree_equals_enumeration(K, N):
    for seed in range(3):
        args = _selector_inputs(seed)
        pred, succ, proj, h, logits, pending = args
        children = selector.children(*(jnp.asarray(x, jnp.float32) for x in (pred, succ, proj)),
                                     K, jnp.asarray(h, jnp.float32),
                                     jnp.asarray(logits, jnp.float32))
        tree = best_first_path_tree(jnp.asarray(pending, jnp.int32), children, h.shape[1], K, N)
        for b in range(h.shape[0]):
            want, scored = _ref_best(args, b, K, N)
            got = bf.tree_paths(tree, b)
            assert set(got) == want, (seed, b)
            par = np.asarray(tree.parents)[b]
            valid = np.asarray(tree.valid)[b]
            assert valid.sum() == 1 + len(want)
            assert all(par[i] < i for i in range(1, len(par)) if valid[i])


def _selector_net(cfg, G, seed=3):
    dcfg = DrafterConfig.for_target(cfg, "block", gamma=G, mask_token_id=1)
    dcfg = dataclasses.replace(dcfg, selector_rank=4, selector_top_k=3)
    net = build_network(dcfg, rngs=nnx.Rngs(seed))
    net.sel_succ.set_value(jax.random.normal(jax.random.key(9), net.sel_succ.shape))
    return dcfg, net


def test_greedy_selector_tree_equals_autoregressive():
    target, _ = sg.models()
    dcfg, net = _selector_net(target.cfg, 4)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=4, sampling=SamplingParams())
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP)
    toks, lens = sg.prompts()
    res = speculative_loop(g, p, DynamicTree(drafter, 3, 12), dparams, cfg, toks, lens,
                           jnp.asarray(sg.BUDGETS, jnp.int32), jax.random.key(0))
    assert sg.rows(res) == sg.rows(sg.run_ar(sg.BUDGETS))


@functools.cache
def _t1_selector_drafter():
    dcfg = DrafterConfig.for_target(tl.CFG2, "block", gamma=bf.G_T1, context="kv",
                                    mask_token_id=tl.PAD)
    dcfg = dataclasses.replace(dcfg, kv_layers=(0, 1), selector_rank=4, selector_top_k=3)
    net = tl._opinionated(build_network(dcfg, rngs=nnx.Rngs(7)))
    net.sel_succ.set_value(jax.random.normal(jax.random.key(5), net.sel_succ.shape) * 2.0)
    return make_drafter(dcfg, net, tl._target(), gamma=bf.G_T1, sampling=tl.PLAIN)


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "marginal-q-caught"])
def test_selector_tree_at_t1(wrong, monkeypatch):
    monkeypatch.setattr(bf, "_t1_drafter", _t1_selector_drafter)
    stat, thresh, worst, acc = bf._t1_run(wrong, seed=0)
    if wrong:
        assert stat > thresh, (stat, thresh, worst)
    else:
        assert stat < thresh, (stat, thresh, worst)
        assert acc[0] > 0.05


