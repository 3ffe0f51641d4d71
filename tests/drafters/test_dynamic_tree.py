"""EAGLE-2's dynamic draft tree for the eagle3 family (`specjax.drafters.dynamic_tree`,
`Eagle3Drafter.propose_tree_topk`): the tree equals a numpy reference of the expansion
and rerank rule computed from per-path draft distributions of the training path (an
independent computation of the drafter's distributions); its structure; greedy identity
with autoregressive decoding; losslessness at T = 1 under token tree verification (the
exact-distribution harness of tests/drafters/test_lossless_drafters.py); K = 1, N = G + 1 is the
chain."""

import functools

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
from specjax.errors import SpecjaxError
from specjax.testing import distribution as du
from specjax.train.objectives import Frozen
from specjax.train.objectives.ttt import draft_outputs
from tests.decoding import test_speculative_greedy as sg
from tests.drafters import test_lossless_drafters as tl
from tests.drafters.test_drafters import W, net_for

T1 = SamplingParams(temperature=1.0)


# ----------------------------------------------------------------------------- reference

@functools.partial(jax.jit, static_argnames=("graphdef", "tgraphdef", "G"))
def _path_logp(graphdef, state, tgraphdef, tstate, rows, lengths, G):
    """log_softmax of the draft logits after each prefix of each row's draft, from the
    training path (TTT unroll): rows i32[R,W+1] = committed tokens then the draft;
    -> f32[R,G,V], entry d the distribution of draft token d+1."""
    net, target = nnx.merge(graphdef, state), nnx.merge(tgraphdef, tstate)
    R = rows.shape[0]
    pos = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (R, W))
    tgt = target(rows[:, :W], pos, None, capture=net.cfg.capture, capture_kv=net.cfg.kv_layers)
    frozen = Frozen.from_target(target)
    outs, _ = draft_outputs(net, tgt, rows, frozen, G)  # [G,R,W,D]
    out = jnp.take_along_axis(outs, (lengths - 2)[None, :, None, None], axis=2)[:, :, 0]
    return jax.nn.log_softmax(net.logits(out.swapaxes(0, 1), frozen.head), axis=-1)


def reference_tree(net, target, tokens, lengths, G, K, N, hot=None):
    """The dynamic tree in numpy: the same expansion and rerank rule, from per-path
    distributions `_path_logp` (one batch of R = B*K paths per depth). Returns (tokens,
    parents, depths, valid) i32/bool[B,N] and the selected scores f64[B,N-1]."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    B = len(lengths)
    args = (*nnx.split(net), *nnx.split(target))

    def logp_after(paths):  # paths[b]: K token lists -> [B,K,V] distribution after each
        rows = np.zeros((B * K, W + 1), np.int32)
        lens = np.zeros((B * K,), np.int32)
        for b in range(B):
            for k, path in enumerate(paths[b]):
                seq = list(tokens[b, :lengths[b]]) + list(path)
                rows[b * K + k, :len(seq)] = seq
                lens[b * K + k] = lengths[b]
        lp = np.asarray(_path_logp(*args, jnp.asarray(rows), jnp.asarray(lens), G),
                        np.float64)
        out = np.stack([lp[b * K + k, len(paths[b][k])] for b in range(B)
                        for k in range(K)]).reshape(B, K, -1)
        if hot is not None:  # a hot vocabulary: -inf outside it, renormalised over it
            mask = np.full(out.shape[-1], -np.inf)
            mask[list(hot)] = 0.0
            out = out + mask
            top = out.max(axis=-1, keepdims=True)
            out = out - top - np.log(np.exp(out - top).sum(axis=-1, keepdims=True))
        return out

    def topk(x, k):  # largest first, lower index first on ties (as lax.top_k)
        return np.argsort(-x, kind="stable")[:k]

    lp0 = logp_after([[[]] * K for _ in range(B)])[:, 0]
    res = [np.zeros((B, N), np.int32) for _ in range(3)] + [np.zeros((B, N), bool)]
    scores = np.zeros((B, N - 1))
    cands = [[] for _ in range(B)]  # (score, token, parent candidate, depth, path)
    front = [[] for _ in range(B)]  # candidate indices
    for b in range(B):
        for t in topk(lp0[b], K):
            cands[b].append((lp0[b, t], int(t), -1, 1, [int(t)]))
            front[b].append(len(cands[b]) - 1)
    for _ in range(2, G + 1):
        lp = logp_after([[cands[b][i][4] for i in front[b]] for b in range(B)])
        for b in range(B):
            level = []
            for k, i in enumerate(front[b]):
                for t in topk(lp[b, k], K):
                    level.append((cands[b][i][0] + lp[b, k, t], int(t), i,
                                  cands[b][i][3] + 1, cands[b][i][4] + [int(t)]))
            start = len(cands[b])
            cands[b] += level
            front[b] = [start + j for j in topk(np.array([c[0] for c in level]), K)]
    for b in range(B):
        sel = sorted(topk(np.array([c[0] for c in cands[b]]), N - 1))
        node = {i: n + 1 for n, i in enumerate(sel)}
        tok, par, dep, val = (r[b] for r in res)
        tok[0], par[0], val[0] = tokens[b, lengths[b] - 1], -1, True
        for n, i in enumerate(sel, start=1):
            s, t, p, d, _ = cands[b][i]
            ok = np.isfinite(s)
            tok[n], val[n] = t, ok
            par[n] = (node[p] if p >= 0 else 0) if ok else -1
            dep[n] = d if ok else 0
            scores[b, n - 1] = s
    return (*res, scores)


# ----------------------------------------------------------------------------- setup

def _drafter(kind, G, sp=T1, hot=None, sharp=4.0):
    """(drafter, params, net): test_drafters' random drafter for sg's target with its final
    norm scaled by `sharp` (draft distributions far from uniform: trees that are not
    breadth-first)."""
    target, _ = sg.models()
    dcfg, net = net_for(kind, None)
    graphdef, state = nnx.split(net)  # a copy: net_for's net is shared
    state["final_norm"] = jax.tree.map(lambda x: x * sharp, state["final_norm"])
    net = nnx.merge(graphdef, state)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=sp, draft_vocab=hot)
    return drafter, dparams, net


def _first_state(drafter, dparams, G):
    """The drafter state and loop view after the prefill of sg.prompts()."""
    target, _ = sg.models()
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP, sampling=drafter.sampling)
    toks, lens = sg.prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    dstate = drafter.init(dparams, view, key)
    view = LoopView(state.tokens, state.lengths, state.cache, None,
                    (state.lengths - 1)[:, None])
    return dstate, view


def _check_structure(tree, G, N):
    tok, par, dep, val = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths,
                                                  tree.valid))
    assert tok.shape[1] == N and val[:, 0].all() and (par[:, 0] == -1).all()
    for b in range(tok.shape[0]):
        for i in range(1, N):
            if not val[b, i]:
                assert par[b, i] == -1 and dep[b, i] == 0
                continue
            p = par[b, i]
            assert 0 <= p < i and val[b, p], (b, i, p)  # topological, closed
            assert dep[b, i] == dep[b, p] + 1 <= G
        kids = {}
        for i in range(1, N):
            if val[b, i]:
                kids.setdefault(par[b, i], []).append(tok[b, i])
        for p, ts in kids.items():  # children of one node: distinct tokens
            assert len(set(ts)) == len(ts), (b, p, ts)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("kind,G,K,N,hot", [
    ("eagle3", 4, 3, 12, None),
    ("eagle3", 3, 4, 33, (0, 2, 3)),
    pytest.param("hybrid", 3, 2, 7, None, marks=pytest.mark.slow),
    ("medc", 4, 3, 12, None),  # the shared hidden chain (Medc.chain_reads_token False)
])
def test_tree_equals_numpy_reference(kind, G, K, N, hot):
    """(1)+(2): the tree of propose_tree_topk equals the reference's, and is a closed,
    topological tree of N nodes with depths <= G."""
    drafter, dparams, net = _drafter(kind, G, hot=None if hot is None else np.asarray(hot))
    dstate, view = _first_state(drafter, dparams, G)
    tree, out_state = jax.jit(DynamicTree(drafter, K, N).propose_tree)(
        dparams, dstate, view, jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, out_state, dstate)  # state unchanged
    target, _ = sg.models()
    want = reference_tree(net, target, view.tokens, view.lengths, G, K, N, hot)
    names = ("tokens", "parents", "depths", "valid")
    for name, w in zip(names, want[:4], strict=True):
        np.testing.assert_array_equal(np.asarray(getattr(tree, name)), w, err_msg=name)
    _check_structure(tree, G, N)
    # q: one-hot at each node's token (T = 1); the tree has branches and reaches depth G
    q = np.asarray(tree.q)
    np.testing.assert_array_equal(q[:, 1:], np.eye(q.shape[-1])[np.asarray(tree.tokens)[:, 1:]])
    assert (q[:, 0] == 0).all()
    assert np.asarray(tree.depths).max() == G
    assert (np.bincount(np.asarray(tree.parents)[0, 1:] + 1) > 1).any()
    if hot is not None:
        tok, val = np.asarray(tree.tokens)[:, 1:], np.asarray(tree.valid)[:, 1:]
        assert np.isin(tok[val], hot).all() and not val.all()  # 3 ids < K: unused nodes


def test_medc_shared_chain_tree_equals_per_node_forwards():
    """medc's chain reads no token, so its tree runs one chain and reads every node out
    of its depth's state; one forward per frontier node (eagle3's path,
    share_tree_chain False) gives the same tree."""
    import dataclasses

    G, K, N = 4, 3, 16
    drafter, dparams, _ = _drafter("medc", G)
    dstate, view = _first_state(drafter, dparams, G)
    shared, _ = jax.jit(DynamicTree(drafter, K, N).propose_tree)(dparams, dstate, view,
                                                                  jax.random.key(0))
    per_node, _ = jax.jit(DynamicTree(dataclasses.replace(drafter, share_tree_chain=False),
                                      K, N).propose_tree)(dparams, dstate, view,
                                                          jax.random.key(0))
    for name in ("tokens", "parents", "depths", "valid"):
        np.testing.assert_array_equal(np.asarray(getattr(shared, name)),
                                      np.asarray(getattr(per_node, name)), err_msg=name)
    assert np.asarray(shared.depths).max() == G


def test_chain_when_topk_is_one():
    """(5a): K = 1, N = G + 1 gives propose's greedy chain as a chain tree."""
    G = 4
    drafter, dparams, _ = _drafter("eagle3", G, sp=SamplingParams())
    dstate, view = _first_state(drafter, dparams, G)
    tree, _ = DynamicTree(drafter, 1, G + 1).propose_tree(dparams, dstate, view,
                                                         jax.random.key(0))
    draft, _, _ = drafter.propose(dparams, dstate, view, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:, 1:], np.asarray(draft))
    np.testing.assert_array_equal(np.asarray(tree.parents), np.tile(np.arange(-1, G), (4, 1)))
    assert tree.q is None and np.asarray(tree.valid).all()


def test_bad_settings_are_refused():
    drafter, _, _ = _drafter("eagle3", 3)
    with pytest.raises(SpecjaxError, match="--tree-nodes 12"):
        DynamicTree(drafter, 2, 12)  # 1 + 2 + 2*4 = 11 at most
    with pytest.raises(SpecjaxError, match="--tree-topk 0"):
        DynamicTree(drafter, 0, 4)
    with pytest.raises(SpecjaxError, match="no dynamic draft tree"):
        DynamicTree(sg.make_drafter("ngram", 3)[0], 2, 4)
    assert DynamicTree(drafter, 2, 11).tree_nodes == 11


def _loop(drafter, dparams, budgets=sg.BUDGETS, sp=SamplingParams()):
    target, _ = sg.models()
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP, sampling=sp)
    toks, lens = sg.prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


@pytest.mark.parametrize("kind,G,K,N", [
    ("eagle3", 4, 3, 16),
    pytest.param("hybrid", 3, 2, 9, marks=pytest.mark.slow),
    pytest.param("eagle3", 5, 4, 40, marks=pytest.mark.slow),
])
def test_greedy_tree_equals_autoregressive(kind, G, K, N):
    """(3): greedy decoding with the dynamic tree equals autoregressive decoding token for
    token (4 rows, prompt lengths 9/2/5/7, budgets 24/13/7/1), and accepts drafts."""
    drafter, dparams, _ = _drafter(kind, G, sp=SamplingParams())
    res = _loop(DynamicTree(drafter, K, N), dparams)
    assert sg.rows(res) == sg.rows(sg.run_ar(sg.BUDGETS))
    acc, steps = np.asarray(res.accepted), np.asarray(res.steps)
    assert 0 < acc.sum() < G * steps.sum()


def test_topk_one_loop_equals_chain_loop():
    """(5b): with K = 1, N = G + 1 the tree loop makes the chain loop's steps: same
    output, same acceptance per position, same number of steps."""
    G = 4
    drafter, dparams, _ = _drafter("eagle3", G, sp=SamplingParams())
    tree = _loop(DynamicTree(drafter, 1, G + 1), dparams)
    chain = _loop(drafter, dparams)
    assert sg.rows(tree) == sg.rows(chain) == sg.rows(sg.run_ar(sg.BUDGETS))
    np.testing.assert_array_equal(np.asarray(tree.accepted), np.asarray(chain.accepted))
    np.testing.assert_array_equal(np.asarray(tree.steps), np.asarray(chain.steps))


# (4): T = 1, verify "token": the exact-distribution harness of test_lossless_drafters
# (its tiny target, PROMPT, N_NEW = 5, G = 2; 25,000 rows; projection test).
LOSSLESS = [("eagle3", tl.PLAIN, None, 3, 9),
            pytest.param("eagle3", tl.TOP_K, tl.HOT, 3, 8, marks=pytest.mark.slow),
            pytest.param("hybrid", tl.PLAIN, None, 2, 7, marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,sp,hot,K,N", LOSSLESS, ids=tl._id)
def test_dynamic_tree_is_lossless(name, sp, hot, K, N):
    drafter, dparams = tl._drafter(name, sp, hot)
    batch = tl.BATCH
    g, params = nnx.split(tl._target())
    lc = LoopConfig(max_length=len(tl.PROMPT) + tl.N_NEW, prompt_width=tl.PROMPT_WIDTH,
                    sampling=sp, verify="token")
    prompt = np.full((tl.PROMPT_WIDTH,), tl.PAD, np.int32)
    prompt[:len(tl.PROMPT)] = tl.PROMPT
    res = speculative_loop(g, params, DynamicTree(drafter, K, N), dparams, lc,
                           jnp.asarray(np.tile(prompt, (batch, 1))),
                           jnp.full((batch,), len(tl.PROMPT), jnp.int32),
                           jnp.full((batch,), tl.N_NEW, jnp.int32), jax.random.key(K * 100 + N))
    Tp = len(tl.PROMPT)
    tokens, lengths = np.asarray(res.tokens), np.asarray(res.lengths)
    assert (lengths == Tp + tl.N_NEW).all()
    seqs = tokens[:, Tp:Tp + tl.N_NEW]
    exact = tl._exact(sp)
    assert (du.empirical_pmf(seqs)[exact == 0] == 0).all(), "a sequence the target forbids"
    stat, thresh, worst = du.projection_test(seqs, exact, tl._null(sp, batch))
    steps, accepted = np.asarray(res.steps), np.asarray(res.accepted)
    acc = accepted.sum(axis=0) / steps.sum()
    print(f"\n[dynamic tree {name} K={K} N={N}] z={stat:.2f} thresh={thresh:.2f} worst "
          f"{worst}; accepted per round {acc.round(3)} rounds/row {steps.mean():.2f}")
    assert stat < thresh, (stat, thresh, worst)
    assert 0.05 < acc[0] < 0.95 and acc[-1] > 0.01, acc
