"""Dynamic draft trees (`DynamicTree`) from the block (DFlash-style) and the KV-only
drafters (issue 30): `BlockDrafter.propose_tree_topk` (DDTree's best-first tree, issue
52) against a numpy enumeration from the block's own per-position distributions,
`KVDrafter.propose_tree_topk` against the drafter's chain `propose`, greedy identity with
autoregressive decoding, and exactness at T = 1 through the multi-round harness of
tests/drafters/test_lossless_drafters.py. The eagle3 family's trees:
tests/drafters/test_dynamic_tree.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.drafter import LoopView
from specjax.core.sampling import SamplingParams
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.drafters import make_drafter
from specjax.drafters.dynamic_tree import DynamicTree
from specjax.testing import distribution as du
from tests.decoding import test_speculative_greedy as sg
from tests.drafters import test_block_best_first_tree as bf
from tests.drafters import test_lossless_drafters as tl
from tests.drafters.test_drafters import net_for

GREEDY = SamplingParams()


def _drafter(context, G, sp=GREEDY):
    target, _ = sg.models()
    dcfg, net = net_for("block", context)
    return make_drafter(dcfg, net, target, gamma=G, sampling=sp)


def _first_view(drafter, dparams, G):
    target, _ = sg.models()
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP)
    toks, lens = sg.prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    dstate = drafter.init(dparams, view, key)
    return dstate, LoopView(state.tokens, state.lengths, state.cache, None,
                            (state.lengths - 1)[:, None])


def _reference(logp, K, N):
    """numpy float64: (tokens, parents, depths) per row of the best-first tree (DDTree's):
    the N - 1 best prefixes over each position's top-K tokens of per-position
    log-probabilities logp [G,V] (independent positions), best first
    (tests/drafters/test_block_best_first_tree.py's enumeration)."""
    G = logp.shape[0]
    order = np.stack([np.argsort(-logp[d], kind="stable")[:K] for d in range(G)])
    ls = np.take_along_axis(logp, order, axis=1)
    ranks, _ = bf.reference(ls, N)
    node = {rk: n + 1 for n, rk in enumerate(ranks)}
    toks = [int(order[len(rk) - 1, rk[-1]]) for rk in ranks]
    pars = [node[rk[:-1]] if len(rk) > 1 else 0 for rk in ranks]
    deps = [len(rk) for rk in ranks]
    return toks, pars, deps


@pytest.mark.parametrize("context,G,K,N", [
    ("kv", 3, 2, 6), pytest.param("hidden", 4, 3, 12, marks=pytest.mark.slow)])
def test_block_tree_equals_numpy_reference(context, G, K, N):
    drafter, dparams = _drafter(context, G)
    dstate, view = _first_view(drafter, dparams, G)
    logp = np.asarray(jax.nn.log_softmax(drafter.block_logits(dparams, dstate, view), -1))
    tree, _ = DynamicTree(drafter, K, N).propose_tree(dparams, dstate, view, jax.random.key(0))
    assert tree.q is None
    for b in range(4):
        toks, pars, deps = _reference(logp[b], K, N)
        np.testing.assert_array_equal(np.asarray(tree.tokens[b, 1:]), toks)
        np.testing.assert_array_equal(np.asarray(tree.parents[b, 1:]), pars)
        np.testing.assert_array_equal(np.asarray(tree.depths[b, 1:]), deps)
        assert np.asarray(tree.valid[b]).all()


@pytest.mark.parametrize("context,G,K,N", [("kv", 3, 2, 7),
                                           pytest.param("both", 4, 3, 16,
                                                        marks=pytest.mark.slow)])
def test_greedy_block_tree_equals_autoregressive(context, G, K, N):
    drafter, dparams = _drafter(context, G)
    target, _ = sg.models()
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP)
    toks, lens = sg.prompts()
    res = speculative_loop(g, p, DynamicTree(drafter, K, N), dparams, cfg, toks, lens,
                           jnp.asarray(sg.BUDGETS, jnp.int32), jax.random.key(0))
    assert sg.rows(res) == sg.rows(sg.run_ar(sg.BUDGETS))


def _t1_tree_run(name, seed):
    """A DynamicTree(K=2, N=5) around tests/drafters/test_lossless_drafters.py's drafter `name` at
    T = 1, verify "token", over tl.BATCH copies of its prompt -> (statistic, threshold,
    worst view, accepted drafts per position per round) of its projection test."""
    sp = tl.PLAIN
    drafter, dparams = tl._drafter(name, sp)
    batch = tl.BATCH
    g, params = nnx.split(tl._target())
    lc = LoopConfig(max_length=len(tl.PROMPT) + tl.N_NEW, prompt_width=tl.PROMPT_WIDTH,
                    sampling=sp, verify="token")
    prompt = np.full((tl.PROMPT_WIDTH,), tl.PAD, np.int32)
    prompt[:len(tl.PROMPT)] = tl.PROMPT
    res = speculative_loop(g, params, DynamicTree(drafter, 2, 5), dparams, lc,
                           jnp.asarray(np.tile(prompt, (batch, 1))),
                           jnp.full((batch,), len(tl.PROMPT), jnp.int32),
                           jnp.full((batch,), tl.N_NEW, jnp.int32), jax.random.key(seed))
    Tp = len(tl.PROMPT)
    seqs = np.asarray(res.tokens)[:, Tp:Tp + tl.N_NEW]
    exact = tl._exact(sp)
    assert (du.empirical_pmf(seqs)[exact == 0] == 0).all()
    stat, thresh, worst = du.projection_test(seqs, exact, tl._null(sp, batch))
    acc = np.asarray(res.accepted).sum(0) / np.asarray(res.steps).sum()
    print(f"\n[{name} tree T=1] z={stat:.2f} thresh={thresh:.2f} worst {worst}; accepted {acc}")
    return stat, thresh, worst, acc


@pytest.mark.parametrize("name", ["block-kv", pytest.param("kv", marks=pytest.mark.slow)])
def test_tree_is_lossless_at_t1(name):
    """T = 1, verify "token": the first N_NEW tokens over several rounds follow the
    target's exact law (tests/drafters/test_lossless_drafters.py's statistic and threshold)."""
    stat, thresh, worst, acc = _t1_tree_run(name, 11)
    assert stat < thresh, (stat, thresh, worst)
    assert 0.05 < acc[0] < 0.95


# ------------------------------------------------------------------ the KV-only drafter

def _kv_drafter(G, sp=GREEDY):
    target, _ = sg.models()
    dcfg, net = net_for("kv", None)
    return make_drafter(dcfg, net, target, gamma=G, sampling=sp)


def test_kv_tree_chain_when_topk_is_one():
    """K = 1, N = G + 1: the tree is the drafter's own greedy chain (its `propose`, an
    independent code path), node by node."""
    G = 4
    drafter, dparams = _kv_drafter(G)
    dstate, view = _first_view(drafter, dparams, G)
    draft, _, _ = drafter.propose(dparams, dstate, view, jax.random.key(0))
    tree, _ = DynamicTree(drafter, 1, G + 1).propose_tree(dparams, dstate, view,
                                                          jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), np.asarray(draft))
    np.testing.assert_array_equal(np.asarray(tree.parents[0]), np.arange(-1, G))


def test_kv_tree_children_follow_the_chain_distributions():
    """Depth 1 holds the top-K first tokens, and each depth-1 node's best child is the
    greedy continuation of that first token, as the drafter's own chain `propose` with
    `first_rank` drafts it (an independent code path: one query per forward, a causal
    own-entry mask)."""
    G, K, N = 3, 2, 7
    drafter, dparams = _kv_drafter(G)
    dstate, view = _first_view(drafter, dparams, G)
    tree, _ = DynamicTree(drafter, K, N).propose_tree(dparams, dstate, view, jax.random.key(0))
    toks, pars = np.asarray(tree.tokens), np.asarray(tree.parents)
    for r in range(K):
        draft, _, _ = drafter.propose(dparams, dstate, view, jax.random.key(0),
                                      first_rank=(jnp.int32(r), K))
        d = np.asarray(draft)
        for b in range(4):
            assert d[b, 0] in toks[b, 1:K + 1], (b, r)
            node = 1 + int(np.nonzero(toks[b, 1:K + 1] == d[b, 0])[0][0])
            kids = [i for i in range(N) if pars[b, i] == node]
            if kids:  # the first child in node order is the best one kept
                assert toks[b, kids[0]] == d[b, 1], (b, r)


@pytest.mark.parametrize("G,K,N", [(3, 2, 7)])
def test_greedy_kv_tree_equals_autoregressive(G, K, N):
    drafter, dparams = _kv_drafter(G)
    target, _ = sg.models()
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP)
    toks, lens = sg.prompts()
    res = speculative_loop(g, p, DynamicTree(drafter, K, N), dparams, cfg, toks, lens,
                           jnp.asarray(sg.BUDGETS, jnp.int32), jax.random.key(0))
    assert sg.rows(res) == sg.rows(sg.run_ar(sg.BUDGETS))


# ------------------------------------------------------------------ the draft LM

def test_draft_lm_tree_chain_when_topk_is_one():
    """K = 1, N = G + 1: the draft LM's tree is its own greedy chain (`propose`: one token
    per forward, causal cache attention), although the tree re-feeds the kept nodes in the
    model's tree mode."""
    G = 4
    drafter, dparams = sg.make_drafter("draft_lm", G)
    dstate, view = _first_view(drafter, dparams, G)
    draft, _, _ = drafter.propose(dparams, dstate, view, jax.random.key(0))
    tree, _ = DynamicTree(drafter, 1, G + 1).propose_tree(dparams, dstate, view,
                                                          jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), np.asarray(draft))


def test_draft_lm_tree_children_follow_the_chain_distributions():
    G, K, N = 3, 2, 7
    drafter, dparams = sg.make_drafter("draft_lm", G)
    dstate, view = _first_view(drafter, dparams, G)
    tree, _ = DynamicTree(drafter, K, N).propose_tree(dparams, dstate, view, jax.random.key(0))
    toks, pars = np.asarray(tree.tokens), np.asarray(tree.parents)
    for r in range(K):
        draft, _, _ = drafter.propose(dparams, dstate, view, jax.random.key(0),
                                      first_rank=(jnp.int32(r), K))
        d = np.asarray(draft)
        for b in range(4):
            node = 1 + int(np.nonzero(toks[b, 1:K + 1] == d[b, 0])[0][0])
            kids = [i for i in range(N) if pars[b, i] == node]
            if kids:
                assert toks[b, kids[0]] == d[b, 1], (b, r)


def test_greedy_draft_lm_tree_equals_autoregressive():
    drafter, dparams = sg.make_drafter("draft_lm", 3)
    target, _ = sg.models()
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP)
    toks, lens = sg.prompts()
    res = speculative_loop(g, p, DynamicTree(drafter, 2, 7), dparams, cfg, toks, lens,
                           jnp.asarray(sg.BUDGETS, jnp.int32), jax.random.key(0))
    assert sg.rows(res) == sg.rows(sg.run_ar(sg.BUDGETS))
    assert np.asarray(res.accepted).sum() > 0


@pytest.mark.slow
def test_draft_lm_tree_is_lossless_at_t1():
    stat, thresh, worst, _ = _t1_tree_run("draft-lm", 12)
    assert stat < thresh, (stat, thresh, worst)
