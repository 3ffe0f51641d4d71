"""Tests of specjax.decoding.tree_verify: greedy, token-level and multi-draft block
verification of draft trees.

Three levels, as tests/decoding/test_distribution.py does for chains:
- identities: greedy against a plain numpy walk; a chain tree against verify.py's rules
  verdict for verdict (same key); K = 1 block against verify_block verdict for verdict.
- float64 references written here from the rules' statements (module docstring of
  tree_verify): the exact law of a verdict for one fixed tree, summed over every draft
  the drafter can propose, must give the target's joint law (the rule is lossless in
  exact arithmetic), and gives the exact E[tau] of each rule.
- sampling: the jax rule on one fixed tree follows the reference law of its verdict; a
  two-step loop (drafts, verify, drafts again from the new context, verify, then the
  target) emits sequences whose law is the target's; deliberately wrong rules fail the
  same test. The statistic is TV with the 99.9% null quantile (specjax/testing/distribution.py).

The target and the drafter are explicit conditional tables over a small vocabulary, so
every joint law is enumerable; contexts where the drafter equals the target (zero
residual) and zero-probability tokens are included.
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core import tree as dtree
from specjax.decoding.tree_verify import (
    TreeVerdict,
    children_table,
    verify_tree_block,
    verify_tree_greedy,
    verify_tree_token,
)
from specjax.decoding.verify import verify_block, verify_greedy, verify_token
from specjax.errors import SpecjaxError
from specjax.testing import distribution as du

V = 4  # vocabulary of the synthetic target and drafter
LEVEL = 0.999
N_SAMPLES = 100_000

# ----------------------------------------------------------------------------- tables


def _random_dists(rng, n, zero_frac=0.3, alpha=1.0):
    """f64[n, V] Dirichlet rows, one random token zeroed in `zero_frac` of them."""
    d = rng.dirichlet(np.full(V, alpha), size=n)
    zero = rng.random(n) < zero_frac
    d[zero, rng.integers(0, V, n)[zero]] = 0.0
    return d / d.sum(-1, keepdims=True)


class Tables:
    """A target P and a drafter Q given as conditional tables: the distribution of the
    next token after a context of length l < L (any tokens) is row offset[l] + index of
    the context (base V, first token most significant)."""

    def __init__(self, L: int, seed: int):
        rng = np.random.default_rng(seed)
        self.offset = np.concatenate([[0], np.cumsum([V**k for k in range(L)])])
        n = int(self.offset[-1])
        self.P = _random_dists(rng, n)
        self.Q = _random_dists(rng, n)
        same = rng.random(n) < 0.1  # contexts where the drafter is exact: zero residual
        same[0] = False  # (not at the root, where it would make every rule alike)
        self.Q[same] = self.P[same]

    def rows(self, idx, length):
        return self.offset[np.asarray(length)] + np.asarray(idx)

    def _row(self, ctx):
        idx = 0
        for t in ctx:
            idx = idx * V + int(t)
        return int(self.offset[len(ctx)]) + idx

    def p(self, ctx):
        """f64[V]: P after the token tuple ctx."""
        return self.P[self._row(ctx)]

    def q(self, ctx):
        return self.Q[self._row(ctx)]

    def joint(self, n, prefix=()):
        """f64[V**n]: the target's law of the n tokens after `prefix`."""
        out = np.ones(1)
        for k in range(n):
            conts = du.all_tuples(k, V)
            rows = np.stack([self.p(prefix + tuple(c)) for c in conts])
            out = (out[:, None] * rows).reshape(-1)
        return out


@functools.cache
def _tables(L: int, seed: int) -> Tables:
    return Tables(L, seed)


# ----------------------------------------------------------------------------- trees


def _iid_tree(tab: Tables, ctx, drafts):
    """numpy (tokens, parents, q, p) of the tree_from_drafts layout for one row: drafts
    int[K, G] after the context tuple ctx (root token 0)."""
    K, G = drafts.shape
    N = 1 + K * G
    tokens, parents = np.zeros(N, np.int64), np.full(N, -1)
    q, p = np.zeros((N, V)), np.zeros((N, V))
    p[0] = tab.p(ctx)
    for k in range(K):
        for j in range(G):
            n = 1 + k * G + j
            tokens[n], parents[n] = drafts[k, j], (0 if j == 0 else n - 1)
            q[n] = tab.q(ctx + tuple(drafts[k, :j]))
            p[n] = tab.p(ctx + tuple(drafts[k, :j + 1]))
    return tokens, parents, q, p


def _topc_layout(C: int, G: int):
    """parents and depths of the full C-ary tree of depth G in breadth-first order."""
    parents, depths, level = [-1], [0], [0]
    for d in range(1, G + 1):
        nxt = []
        for par in level:
            for _ in range(C):
                parents.append(par)
                depths.append(d)
                nxt.append(len(parents) - 1)
        level = nxt
    return np.array(parents), np.array(depths)


def _topc_tree(tab: Tables, ctx, C: int, G: int):
    """numpy (tokens, parents, q, p): every node's children are the C most probable
    tokens of the drafter after the node's context (distinct, deterministic: one-hot q),
    as EAGLE's top-K trees."""
    parents, _ = _topc_layout(C, G)
    N = len(parents)
    tokens, ctxs = np.zeros(N, np.int64), [tuple(ctx)]
    q, p = np.zeros((N, V)), np.zeros((N, V))
    p[0] = tab.p(ctx)
    rank = {}
    for n in range(1, N):
        par = parents[n]
        order = np.argsort(-tab.q(ctxs[par]), kind="stable")
        s = rank.get(par, 0)
        rank[par] = s + 1
        tokens[n] = order[s]
        q[n] = np.eye(V)[tokens[n]]
        ctxs.append(ctxs[par] + (int(tokens[n]),))
        p[n] = tab.p(ctxs[n])
    return tokens, parents, q, p


# ----------------------------------------------------------------------------- references


def _norm_or(res, fallback):
    m = res.sum()
    return res / m if m > 0 else fallback


def ref_token_law(tokens, parents, q, p, G, C):
    """{emitted token tuple: probability} of the token rule on one tree (float64): the
    rule as the tree_verify docstring states it, children in index order, at most C."""
    kids = {i: [j for j in range(len(parents)) if parents[j] == i][:C] for i in range(len(parents))}
    law = {}

    def emit(seq, dist, w):
        for y in np.nonzero(dist > 0)[0]:
            law[seq + (int(y),)] = law.get(seq + (int(y),), 0.0) + w * dist[y]

    def walk(node, depth, seq, w):
        r = p[node]
        if depth < G:
            for c in kids[node]:
                x = tokens[c]
                qx, rx = q[c, x], r[x]
                a = min(1.0, rx / qx) if qx > 0 else float(rx > 0)
                if a > 0:
                    walk(c, depth + 1, seq + (int(x),), w * a)
                w *= 1 - a
                if w == 0:
                    return
                r = _norm_or(np.maximum(r - q[c], 0.0), r)
        emit(seq, r, w)

    walk(0, 0, (), 1.0)
    return law


def ref_block_law(drafts, q, p):
    """{emitted token tuple: probability} of the block rule on one row (float64):
    drafts int[K,G]; q f64[K,G,V] (q[k, j]: draft k's distribution of its token j+1);
    p f64[K,G+1,V] (p[k, j]: the target after draft k's first j tokens). Block
    verification of a draft's remaining tokens is du.exact_verdict (written from the
    paper, independently of verify.block_weights)."""
    K, G = drafts.shape
    law = {}

    def go(k, s, r, w):
        i = len(s)
        while k < K and not (i < G and tuple(drafts[k, :i]) == s):
            k += 1
        if k == K:
            for y in np.nonzero(r > 0)[0]:
                law[s + (int(y),)] = law.get(s + (int(y),), 0.0) + w * r[y]
            return
        target = np.concatenate([r[None], p[k, i + 1:]])
        out = du.exact_verdict("block", drafts[k, i:], q[k, i:], target)  # [G-i+1, V]
        for t in range(G - i + 1):
            m = out[t].sum()
            if m > 0:
                go(k + 1, s + tuple(int(x) for x in drafts[k, i:i + t]), out[t] / m, w * m)

    go(0, (), p[0, 0], 1.0)
    return law


def _branch_arrays(tokens, q, p, K, G):
    """tree_from_drafts layout -> (drafts [K,G], q [K,G,V], p [K,G+1,V])."""
    nodes = 1 + np.arange(K)[:, None] * G + np.arange(G)[None, :]
    pk = np.concatenate([np.broadcast_to(p[0], (K, 1, V)), p[nodes]], axis=1)
    return tokens[nodes], q[nodes], pk


def _extend(law, tab: Tables, n):
    """f64[V**n]: the law of the first n tokens when the emitted tuple is followed by
    target samples."""
    out = np.zeros(V**n)
    for seq, w in law.items():
        seq = seq[:n]
        tail = tab.joint(n - len(seq), seq)
        base = int(du.seq_index(np.array([seq]), V)[0]) * V ** (n - len(seq))
        out[base:base + tail.size] += w * tail
    return out


def _mean_tau(law):
    return sum(w * (len(s) - 1) for s, w in law.items())


def _draft_prob(tab: Tables, drafts):
    w = 1.0
    for row in drafts:
        for j, x in enumerate(row):
            w *= tab.q(tuple(row[:j]))[x]
    return w


@functools.cache
def _enumerated(rule: str, K: int, G: int, seed: int):
    """Exact (law of the first G+1 tokens, E[tau]) of one step of `rule` ("token" or
    "block") on K i.i.d. drafts of length G, summed over every draft of positive
    probability; also "topc" (K = C children per node, deterministic)."""
    tab = _tables(2 * G + 2, seed)
    mass = 0.0
    if rule == "topc":
        tokens, parents, q, p = _topc_tree(tab, (), K, G)
        law = ref_token_law(tokens, parents, q, p, G, K)
        return _extend(law, tab, G + 1), _mean_tau(law), 1.0
    total = {}
    for flat in itertools.product(range(V), repeat=K * G):
        drafts = np.array(flat).reshape(K, G)
        w = _draft_prob(tab, drafts)
        if w == 0:
            continue
        tokens, parents, q, p = _iid_tree(tab, (), drafts)
        if rule == "token":
            law = ref_token_law(tokens, parents, q, p, G, K)
        else:
            law = ref_block_law(*_branch_arrays(tokens, q, p, K, G))
        for seq, v in law.items():
            total[seq] = total.get(seq, 0.0) + w * v
        mass += w
    return _extend(total, tab, G + 1), _mean_tau(total), mass


# ----------------------------------------------------------------------------- jax glue


def _to_tree(tokens, parents, q, depths=None):
    """A batch of B numpy trees (tokens [B,N], parents [B,N], q [B,N,V]) as a DraftTree."""
    B, N = tokens.shape
    if depths is None:
        depths = np.zeros((B, N), np.int64)
        for i in range(1, N):
            depths[:, i] = np.where(parents[:, i] >= 0,
                                    depths[np.arange(B), np.maximum(parents[:, i], 0)] + 1, 0)
    return dtree.DraftTree(tokens=jnp.asarray(tokens, jnp.int32),
                           parents=jnp.asarray(parents, jnp.int32),
                           depths=jnp.asarray(depths, jnp.int32),
                           valid=jnp.asarray(parents >= 0).at[:, 0].set(True),
                           q=None if q is None else jnp.asarray(q, jnp.float32))


def _jit_rule(rule, **static):
    return jax.jit(functools.partial(rule, **static))


def _emitted_cells(tokens, verdict, G):
    """i64[B]: each row's emitted tuple (path tokens then next) as tau * V**(G+1) +
    seq_index(tuple zero-padded to G+1)."""
    tau, nxt, path = (np.asarray(x) for x in verdict)
    seq = np.take_along_axis(tokens, path[:, 1:], axis=1)  # [B,G]
    seq = np.where(np.arange(G)[None] < tau[:, None], seq, 0)
    seq = np.concatenate([seq, np.zeros((len(tau), 1), seq.dtype)], axis=1)
    seq[np.arange(len(tau)), tau] = nxt
    return tau * V ** (G + 1) + du.seq_index(seq, V)


def _law_cells(law, G):
    out = np.zeros((G + 1) * V ** (G + 1))
    for s, w in law.items():
        padded = np.array([s + (0,) * (G + 1 - len(s))])
        out[(len(s) - 1) * V ** (G + 1) + du.seq_index(padded, V)[0]] += w
    return out


# ----------------------------------------------------------------------------- identities


def _random_forest(rng, B, N, invalid_frac=0.2):
    """Random trees: parents[i] < i, some nodes unused (a child of an unused node is
    unused too)."""
    parents = np.full((B, N), -1)
    valid = np.ones((B, N), bool)
    for i in range(1, N):
        parents[:, i] = rng.integers(0, i, B)
        valid[:, i] = valid[np.arange(B), parents[:, i]] & (rng.random(B) > invalid_frac)
    parents = np.where(valid, parents, -1)
    return parents, valid


def test_children_table_matches_numpy():
    rng = np.random.default_rng(0)
    B, N, C = 64, 12, 3
    parents, valid = _random_forest(rng, B, N)
    tree = _to_tree(np.zeros((B, N), np.int64), parents, None)
    tab = np.asarray(children_table(tree, C))
    for b in range(B):
        for i in range(N):
            kids = [j for j in range(N) if valid[b, j] and parents[b, j] == i][:C]
            assert list(tab[b, i]) == kids + [-1] * (C - len(kids)), (b, i)


def _numpy_greedy(tokens, parents, valid, p, G):
    B, N = tokens.shape
    tau, nxt, paths = np.zeros(B, int), np.zeros(B, int), np.zeros((B, G + 1), int)
    for b in range(B):
        cur, path = 0, [0]
        for _ in range(G):
            best = np.argmax(p[b, cur])
            kids = [j for j in range(N)
                    if valid[b, j] and parents[b, j] == cur and tokens[b, j] == best]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        tau[b], nxt[b] = len(path) - 1, np.argmax(p[b, cur])
        paths[b] = path + [cur] * (G + 1 - len(path))
    return tau, nxt, paths


def test_greedy_matches_numpy_walk():
    rng = np.random.default_rng(1)
    B, N, G = 256, 14, 4
    parents, valid = _random_forest(rng, B, N, invalid_frac=0.1)
    p = rng.random((B, N, V))
    # tokens that often equal the parent's argmax, so walks go deep
    argmax_parent = np.argmax(p[np.arange(B)[:, None], np.maximum(parents, 0)], axis=-1)
    tokens = np.where(rng.random((B, N)) < 0.6, argmax_parent, rng.integers(0, V, (B, N)))
    tree = _to_tree(tokens, parents, None)
    depth = np.asarray(tree.depths)
    G = int(depth[valid].max())
    greedy = _jit_rule(verify_tree_greedy, max_depth=G)
    out = greedy(tree, jnp.asarray(p, jnp.float32), jax.random.key(0))
    tau, nxt, path = _numpy_greedy(tokens, parents, valid, p, G)
    assert tau.max() >= 3
    np.testing.assert_array_equal(np.asarray(out.num_accepted), tau)
    np.testing.assert_array_equal(np.asarray(out.next_token), nxt)
    np.testing.assert_array_equal(np.asarray(out.path), path)


def _chain_inputs(seed, B, G):
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(V, 0.7), size=(B, G)).astype(np.float32)
    p = rng.dirichlet(np.full(V, 0.7), size=(B, G + 1)).astype(np.float32)
    draft = np.stack([du.sample_rows(rng, q[:, j].astype(np.float64)) for j in range(G)], axis=1)
    if G > 1:
        p[: B // 8, 1] = q[: B // 8, 1]  # zero residual rows
    return jnp.asarray(draft), jnp.asarray(q), jnp.asarray(p)


@pytest.mark.parametrize("G", [1, 3])
def test_chain_tree_equals_chain_rules(G):
    """A chain tree gives verify.py's verdicts for the same key: greedy, token
    (max_children = 1) and block (tree_from_drafts with K = 1)."""
    B = 8192
    draft, q, p = _chain_inputs(G, B, G)
    pending = jnp.zeros((B,), jnp.int32)
    chain = dtree.chain_tree(pending, draft, q)
    one = dtree.tree_from_drafts(pending, draft[:, None], q[:, None])
    key = jax.random.key(G)
    cases = [
        (_jit_rule(verify_tree_greedy, max_depth=G)(chain, p, key),
         verify_greedy(draft, q, p, key)),
        (_jit_rule(verify_tree_token, max_depth=G, max_children=1)(chain, p, key),
         verify_token(draft, q, p, key)),
        (_jit_rule(verify_tree_block, max_depth=G)(one, p, key), verify_block(draft, q, p, key)),
    ]
    for tv, cv in cases:
        tau = np.asarray(cv.num_accepted)
        np.testing.assert_array_equal(np.asarray(tv.num_accepted), tau)
        np.testing.assert_array_equal(np.asarray(tv.next_token), np.asarray(cv.next_token))
        d = np.arange(G + 1)[None]
        np.testing.assert_array_equal(np.asarray(tv.path), np.minimum(d, tau[:, None]))
    assert len(set(np.asarray(cases[2][0].num_accepted).tolist())) == G + 1  # every tau occurs


def test_block_skips_a_draft_with_invalid_nodes():
    """A draft with an unused node is never read: its tokens do not change the verdicts,
    and no path enters it."""
    rng = np.random.default_rng(4)
    B, K, G = 4096, 2, 2
    tab = _tables(2 * G + 2, 0)
    zeros = np.zeros(B, np.int64)
    tokens, parents, q, p = _draft_batch(tab, zeros, zeros, K, G, rng)
    tree = _to_tree(tokens, parents, q)
    tree = tree.replace(valid=tree.valid.at[:, 1 + G + 1].set(False))
    other = tree.replace(tokens=tree.tokens.at[:, 1 + G:].set(jnp.asarray(tokens[:, 1:1 + G])))
    rule = _rule("block", K, G)
    a = rule(tree, jnp.asarray(p, jnp.float32), jax.random.key(2))
    b = rule(other, jnp.asarray(p, jnp.float32), jax.random.key(2))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(a.path).max() <= G


def test_errors():
    B, G = 2, 2
    draft, q, p = _chain_inputs(0, B, G)
    tree = dtree.chain_tree(jnp.zeros((B,), jnp.int32), draft, None)
    key = jax.random.key(0)
    with pytest.raises(SpecjaxError, match="tree.q is None"):
        verify_tree_token(tree, p, key, max_depth=G, max_children=1)
    tree = dtree.chain_tree(jnp.zeros((B,), jnp.int32), draft, q)
    with pytest.raises(SpecjaxError, match="max_children"):
        verify_tree_token(tree, p, key, max_depth=G, max_children=0)
    with pytest.raises(SpecjaxError, match="shape"):
        verify_tree_greedy(tree, p[:, :2], key, max_depth=G)
    with pytest.raises(SpecjaxError, match="1 \\+ K\\*G"):
        verify_tree_block(tree, p, key, max_depth=G, num_drafts=2)


# ----------------------------------------------------------------------------- exact laws

ENUM_CASES = [("token", 3, 1), ("token", 2, 2), ("token", 3, 2), ("token", 2, 3), ("topc", 2, 2),
              ("topc", 3, 2), ("topc", 2, 3), ("block", 3, 1), ("block", 1, 2), ("block", 2, 2),
              ("block", 3, 2), ("block", 2, 3)]


@pytest.mark.parametrize("rule,K,G", ENUM_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_rule_is_lossless(rule, K, G, seed):
    """Float64: the rule's law, summed over every drafted tree, followed by the target,
    is the target's law of the first G+1 tokens (to rounding)."""
    law, e_tau, mass = _enumerated(rule, K, G, seed)
    assert abs(mass - 1) < 1e-12
    target = _tables(2 * G + 2, seed).joint(G + 1)
    assert np.abs(law - target).max() < 1e-12, np.abs(law - target).max()


def test_reference_block_at_k1_is_block_verification():
    """The block reference with one draft is block verification (du.exact_verdict)."""
    tab = _tables(6, 0)
    G = 2
    for flat in itertools.product(range(V), repeat=G):
        drafts = np.array([flat])
        tokens, parents, q, p = _iid_tree(tab, (), drafts)
        law = ref_block_law(*_branch_arrays(tokens, q, p, 1, G))
        ref = du.exact_verdict("block", drafts[0], q[1:], p)
        for t in range(G + 1):
            for y in range(V):
                assert abs(law.get(tuple(flat[:t]) + (y,), 0.0) - ref[t, y]) < 1e-14


@pytest.mark.parametrize("G", [2, 3])
def test_block_verification_accepts_a_token_as_often_as_token_rule(G):
    """The step of the block rule's E[tau] >= token argument (tree_verify docstring):
    block verification accepts at least one token w.p. sum_x min(p_1, q_1)(x), the
    token rule's probability, averaged over the draft."""
    for seed in (0, 1):
        tab = _tables(2 * G + 2, seed)
        acc = 0.0
        for flat in itertools.product(range(V), repeat=G):
            x = np.array(flat)
            w = _draft_prob(tab, x[None])
            if w > 0:
                _, _, q, p = _iid_tree(tab, (), x[None])
                acc += w * (1 - du.exact_verdict("block", x, q[1:], p)[0].sum())
        assert abs(acc - np.minimum(tab.p(()), tab.q(())).sum()) < 1e-12


@pytest.mark.parametrize("G,Ks", [(2, (1, 2, 3)), (3, (1, 2))])
def test_expected_tau_block_beats_token_and_rises_with_k(G, Ks):
    """Exact E[tau] of one step: block >= token for every K, and block rises with K;
    K = 1 token and block are verify.py's chain rules (du.expected_accepted)."""
    _check_expected_tau(G, Ks, seeds=(0, 1))


@pytest.mark.slow
def test_expected_tau_more_tables():
    _check_expected_tau(2, (1, 2, 3), seeds=(2, 3, 4, 5))
    _check_expected_tau(1, (1, 2, 3), seeds=(2, 3))


def _check_expected_tau(G, Ks, seeds):
    for seed in seeds:
        tok = {K: _enumerated("token", K, G, seed)[1] for K in Ks}
        blk = {K: _enumerated("block", K, G, seed)[1] for K in Ks}
        print(f"\n[E tau] G={G} seed={seed}: " + " ".join(
            f"K={K} token {tok[K]:.4f} block {blk[K]:.4f}" for K in Ks))
        for K in Ks:
            assert blk[K] >= tok[K] - 1e-12, (K, blk[K], tok[K])
        for a, b in zip(Ks, Ks[1:], strict=False):
            assert blk[b] > blk[a] + 1e-4 and tok[b] > tok[a] + 1e-4
        tab = _tables(2 * G + 2, seed)
        chain = {r: 0.0 for r in ("token", "block")}
        for flat in itertools.product(range(V), repeat=G):
            x = np.array(flat)
            w = _draft_prob(tab, x[None])
            if w == 0:
                continue
            _, _, q, p = _iid_tree(tab, (), x[None])
            for r in chain:
                chain[r] += w * du.expected_accepted(r, x, q[1:], p)
        assert abs(chain["token"] - tok[1]) < 1e-12 and abs(chain["block"] - blk[1]) < 1e-12


# ----------------------------------------------------------------------------- sampling


def _token_rule_variant(tree, p, key, *, max_depth, max_children, bias):
    """A self-contained copy of the token rule with one planted mistake: bias =
    "no_subtract" (a rejected sibling leaves r = p: the next sibling and the final sample
    use the plain target) or "shared_uniform" (one uniform per depth for all siblings)."""
    B = tree.tokens.shape[0]
    children = children_table(tree, max_children)
    k_acc, k_next = jax.random.split(key)
    u = jax.random.uniform(k_acc, (B, max_depth, max_children))
    if bias == "shared_uniform":
        u = jnp.broadcast_to(u[:, :, :1], u.shape)
    cur, alive = jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool)
    r, path = p[:, 0], [jnp.zeros((B,), jnp.int32)]
    rows = jnp.arange(B)
    for d in range(max_depth):
        acc, pick = jnp.zeros((B,), bool), cur
        for s in range(max_children):
            c = children[rows, cur, s]
            tried = alive & ~acc & (c >= 0)
            cc = jnp.maximum(c, 0)
            x, qc = tree.tokens[rows, cc], tree.q[rows, cc]
            ok = tried & (u[:, d, s] * qc[rows, x] < r[rows, x])
            if bias != "no_subtract":
                res = jnp.maximum(r - qc, 0.0)
                m = res.sum(-1, keepdims=True)
                r = jnp.where((tried & ~ok)[:, None] & (m > 0), res / jnp.maximum(m, 1e-30), r)
            acc, pick = acc | ok, jnp.where(ok, cc, pick)
        alive = alive & acc
        cur = jnp.where(alive, pick, cur)
        r = jnp.where(alive[:, None], p[rows, cur], r)
        path.append(cur)
    path = jnp.stack(path, 1)
    tau = jnp.sum(path[:, 1:] != path[:, :-1], axis=1).astype(jnp.int32)
    logr = jnp.log(jnp.maximum(r, 1e-38)) + jnp.where(r > 0, 0, -jnp.inf)
    nxt = jax.random.categorical(k_next, logr)
    return TreeVerdict(tau, nxt.astype(jnp.int32), path)


def _block_variant(tree, p, key, *, max_depth, bias):
    """Wrong multi-draft block rules built from verify_block run on each draft against
    the plain target: bias = "best_draft" (emit the draft with the most accepted tokens
    and its correction) or "no_residual" (the first draft that accepts a token wins;
    later drafts are verified against p instead of the residual)."""
    B, N = tree.tokens.shape
    G = max_depth
    K = (N - 1) // G
    keys = jax.random.split(key, K)
    verdicts = []
    for k in range(K):
        nodes = jnp.concatenate([jnp.zeros((1,), jnp.int32), 1 + k * G + jnp.arange(G)])
        verdicts.append(verify_block(tree.tokens[:, nodes[1:]], tree.q[:, nodes[1:]],
                                     p[:, nodes], keys[k]))
    taus = jnp.stack([v.num_accepted for v in verdicts], 1)
    nexts = jnp.stack([v.next_token for v in verdicts], 1)
    if bias == "best_draft":
        k = jnp.argmax(taus, axis=1)
    else:  # the first draft with tau >= 1, else the last one
        k = jnp.where(jnp.any(taus > 0, 1), jnp.argmax(taus > 0, axis=1), K - 1)
    rows = jnp.arange(B)
    tau = taus[rows, k]
    d = jnp.arange(G + 1)
    path = jnp.where(jnp.minimum(d[None], tau[:, None]) == 0, 0,
                     1 + k[:, None] * G + jnp.minimum(d[None], tau[:, None]) - 1)
    return TreeVerdict(tau.astype(jnp.int32), nexts[rows, k], path.astype(jnp.int32))


def _rule(name, K, G):
    """The jitted rule `name` for trees of K drafts (or C = K children) and depth G."""
    if name == "token":
        return _jit_rule(verify_tree_token, max_depth=G, max_children=K)
    if name == "block":
        return _jit_rule(verify_tree_block, max_depth=G)
    if name in ("no_subtract", "shared_uniform"):
        return _jit_rule(_token_rule_variant, max_depth=G, max_children=K, bias=name)
    return _jit_rule(_block_variant, max_depth=G, bias=name)


def _draft_batch(tab: Tables, ctx_idx, ctx_len, K, G, rng):
    """Batched tree_from_drafts trees after per-row contexts: tokens [B,N], q, p [B,N,V]."""
    B = len(ctx_idx)
    N = 1 + K * G
    tokens = np.zeros((B, N), np.int64)
    q, p = np.zeros((B, N, V)), np.zeros((B, N, V))
    p[:, 0] = tab.P[tab.rows(ctx_idx, ctx_len)]
    for k in range(K):
        idx, ln = ctx_idx.copy(), ctx_len.copy()
        for j in range(G):
            n = 1 + k * G + j
            q[:, n] = tab.Q[tab.rows(idx, ln)]
            tokens[:, n] = du.sample_rows(rng, q[:, n])
            idx, ln = idx * V + tokens[:, n], ln + 1
            p[:, n] = tab.P[tab.rows(idx, ln)]
    parents = np.broadcast_to(np.asarray(dtree.tree_from_drafts(
        jnp.zeros((1,), jnp.int32), jnp.zeros((1, K, G), jnp.int32)).parents), (B, N))
    return tokens, parents, q, p


def _topc_batch(tab: Tables, ctx_idx, ctx_len, C, G):
    parents, _ = _topc_layout(C, G)
    B, N = len(ctx_idx), len(parents)
    tokens = np.zeros((B, N), np.int64)
    q, p = np.zeros((B, N, V)), np.zeros((B, N, V))
    idx, ln = [ctx_idx], [ctx_len]
    p[:, 0] = tab.P[tab.rows(ctx_idx, ctx_len)]
    for n in range(1, N):
        par = parents[n]
        slot = int(np.sum(parents[1:n] == par))
        order = np.argsort(-tab.Q[tab.rows(idx[par], ln[par])], axis=1, kind="stable")
        tokens[:, n] = order[:, slot]
        q[:, n] = np.eye(V)[tokens[:, n]]
        idx.append(idx[par] * V + tokens[:, n])
        ln.append(ln[par] + 1)
        p[:, n] = tab.P[tab.rows(idx[n], ln[n])]
    return tokens, np.broadcast_to(parents, (B, N)), q, p


def _two_steps(name, tree_kind, K, G, seed=0, n=N_SAMPLES, steps=2):
    """n rows: `steps` rounds of (draft a tree after the row's context, verify with
    `name`, append path tokens + next), then target samples up to G+2 tokens.
    -> (seqs i32[n, G+2], tau of the first step)."""
    tab = _tables(2 * G + 3, seed)
    rng = np.random.default_rng(seed + 100)
    idx, ln = np.zeros(n, np.int64), np.zeros(n, np.int64)
    rule = _rule(name, K, G)
    key = jax.random.key(seed)
    first_tau = None
    for step in range(steps):
        if tree_kind == "iid":
            tokens, parents, q, p = _draft_batch(tab, idx, ln, K, G, rng)
        else:
            tokens, parents, q, p = _topc_batch(tab, idx, ln, K, G)
        out = rule(_to_tree(tokens, parents, q), jnp.asarray(p, jnp.float32),
                   jax.random.fold_in(key, step))
        tau, nxt, path = (np.asarray(x) for x in out)
        first_tau = tau if first_tau is None else first_tau
        for j in range(G):
            take = j < tau
            tok = tokens[np.arange(n), path[:, j + 1]]
            idx, ln = np.where(take, idx * V + tok, idx), np.where(take, ln + 1, ln)
        idx, ln = idx * V + nxt, ln + 1
    n_out = G + 2
    while (ln < n_out).any():  # continue with the target
        short = ln < n_out
        y = du.sample_rows(rng, tab.P[tab.rows(np.where(short, idx, 0), np.where(short, ln, 0))])
        idx, ln = np.where(short, idx * V + y, idx), np.where(short, ln + 1, ln)
    digits = np.stack([(idx // V ** (ln - 1 - j)) % V for j in range(n_out)], axis=1)
    return digits.astype(np.int32), first_tau


def _loop_stat(name, tree_kind, K, G, seed=0):
    seqs, tau = _two_steps(name, tree_kind, K, G, seed)
    exact = _tables(2 * G + 3, seed).joint(G + 2)
    emp = du.empirical_pmf(seqs, V)
    if name in ("token", "block"):
        assert (emp[exact == 0] == 0).all(), "the rule emitted a sequence the target forbids"
    return du.tv(emp, exact), du.tv_null_quantile(exact, len(seqs), LEVEL), tau


LOOP_CASES = [("token", "iid", 3, 2), ("token", "topc", 2, 2), ("block", "iid", 2, 2),
              ("block", "iid", 3, 3)]


@pytest.mark.parametrize("name,kind,K,G", LOOP_CASES)
def test_two_steps_follow_target(name, kind, K, G):
    t0 = time.time()
    stat, thresh, tau = _loop_stat(name, kind, K, G)
    print(f"\n[loop] {name} {kind} K={K} G={G}: TV={stat:.4f} thresh={thresh:.4f} "
          f"mean tau {tau.mean():.3f} ({time.time() - t0:.1f}s)")
    assert stat < thresh, (stat, thresh)


@pytest.mark.parametrize("name,kind,K,G", [("no_subtract", "iid", 3, 2),
                                           ("shared_uniform", "iid", 3, 2),
                                           ("best_draft", "iid", 3, 2),
                                           ("no_residual", "iid", 3, 2)])
def test_two_steps_reject_wrong_rules(name, kind, K, G):
    stat, thresh, _ = _loop_stat(name, kind, K, G)
    print(f"\n[power] {name} K={K} G={G}: TV={stat:.4f} thresh={thresh:.4f}")
    assert stat > thresh, (stat, thresh)


def test_variant_controls_pass():
    """The planted-mistake copies differ from a correct rule only in the mistake: the
    token copy without a mistake passes the same test."""
    rule = _jit_rule(_token_rule_variant, max_depth=2, max_children=3, bias=None)
    tab = _tables(7, 0)
    rng = np.random.default_rng(5)
    n = N_SAMPLES
    zeros = np.zeros(n, np.int64)
    tokens, parents, q, p = _draft_batch(tab, zeros, zeros, 3, 2, rng)
    tree, pj = _to_tree(tokens, parents, q), jnp.asarray(p, jnp.float32)
    a = rule(tree, pj, jax.random.key(1))
    b = _rule("token", 3, 2)(tree, pj, jax.random.key(1))
    assert (np.asarray(a.num_accepted) == np.asarray(b.num_accepted)).mean() > 0.999
    assert (np.asarray(a.next_token) == np.asarray(b.next_token)).mean() > 0.99


FIXED_CASES = [("token", "iid", 3, 2), ("token", "iid", 2, 3), ("token", "topc", 3, 2),
               ("block", "iid", 2, 2), ("block", "iid", 3, 2), ("block", "iid", 2, 3)]


@pytest.mark.parametrize("name,kind,K,G", FIXED_CASES)
def test_fixed_tree_verdict_follows_reference_law(name, kind, K, G):
    """One tree repeated over every row (drafts with duplicates for iid): the jax rule's
    law of (tau, emitted tokens) equals the float64 reference law of that tree."""
    tab = _tables(2 * G + 2, 3)
    rng = np.random.default_rng(3)
    if kind == "iid":
        while True:  # a draw with a duplicated first token
            drafts = np.zeros((K, G), np.int64)
            for k in range(K):
                for j in range(G):
                    drafts[k, j] = du.sample_rows(rng, tab.q(tuple(drafts[k, :j]))[None])[0]
            if len(set(drafts[:, 0])) < K:
                break
        tokens, parents, q, p = _iid_tree(tab, (), drafts)
    else:
        tokens, parents, q, p = _topc_tree(tab, (), K, G)
    if name == "token":
        law = ref_token_law(tokens, parents, q, p, G, K)
    else:
        law = ref_block_law(*_branch_arrays(tokens, q, p, K, G))
    exact = _law_cells(law, G)
    n = N_SAMPLES
    bt = np.broadcast_to(tokens, (n, len(tokens)))
    tree = _to_tree(bt, np.broadcast_to(parents, bt.shape), np.broadcast_to(q, (n, *q.shape)))
    out = _rule(name, K, G)(tree, jnp.asarray(np.broadcast_to(p, (n, *p.shape)), jnp.float32),
                            jax.random.key(9))
    emp = np.bincount(_emitted_cells(bt, out, G), minlength=exact.size) / n
    stat, thresh = du.tv(emp, exact), du.tv_null_quantile(exact, n, LEVEL)
    print(f"\n[fixed] {name} {kind} K={K} G={G} drafts/tokens {tokens.tolist()}: "
          f"TV={stat:.4f} thresh={thresh:.4f} E tau {_mean_tau(law):.3f}")
    assert (emp[exact == 0] == 0).all()
    assert stat < thresh, (stat, thresh)
