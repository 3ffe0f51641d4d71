"""Power checks of the draft-tree paths in the COMPILED loop (issue 53, "Test gaps").

The tree rules' power checks in tests/decoding/test_tree_verify.py run the rules in a numpy
glue loop. Here the same kind of planted mistake goes into `speculative_loop` itself,
and the exact-distribution check of the tree loop tests must reject it while the
correct code passes it, with the same seed, rows and threshold:

  (a) one PRNG key shared by the K drafts of --num-drafts K at T = 1 (the K drafts
      are then copies of one: the rules' "independent drafts" premise fails);
  (b) a wrong index when the accepted path's target K/V are compacted into place after
      a tree step (`compact_path`: source and destination exchanged, or the path one
      depth off), at T = 1;
  (c) a wrong recursive-rejection residual in the token tree rule (the residual left at
      the target p, or not renormalised), through the library's `verify_tree_token`;
  (d) an EAGLE-2 dynamic tree (`DynamicTree`, --tree-topk) with a wrong q at T = 1:
      its one-hot q laid out one node off, or scaled by the drafter's probability of the
      token (a deterministic top-K child has probability 1).

The check is tests/drafters/test_lossless_drafters.py's (`test_draft_trees_are_lossless`
and, for (d), tests/drafters/test_dynamic_tree.py's `test_dynamic_tree_is_lossless`):
25,000 rows of the tiny 6-token target generate N_NEW = 5 tokens at G = 2 (several
rounds, so tokens after a compaction and a drafter update are covered); their law is
compared with the target's exact float64 joint by `distribution.projection_test` (the
largest standardised TV over every position, adjacent pair, run of three and the whole
joint; one simulated 99.9% threshold). Drafters, exact law and null come from that
module; only the injection is written here.

Not covered, because no distribution or greedy-identity test can see it: a wrong index
in the gather of the target's HIDDEN states along the path (`view.hidden` for the
drafter's update). The drafter then drafts from wrong features but still reports the q
it sampled from, so the output stays exactly the target's; only acceptance changes
(measured once, eagle3 / token / K = 2 with the path gather replaced by node order 0..G:
z = 0.89 for the correct and the wrong loop alike, threshold 4.76).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding import tree_verify
from specjax.decoding.loop import LoopConfig, compact_path, speculative_loop
from specjax.decoding.loop import step as loop_step
from specjax.decoding.rules import TokenLevel
from specjax.drafters.dynamic_tree import DynamicTree
from specjax.drafters.eagle3 import trees as eagle3_trees
from specjax.models.kv_cache import KVCache
from specjax.models.matmul import DRAFTS_AXIS
from specjax.testing import distribution as du
from tests.drafters import test_lossless_drafters as tl

PLAIN = tl.PLAIN  # T = 1, no top-k / top-p


# ----------------------------------------------------------------------------- harness


def _run(drafter, dparams, verify, seed: int, num_drafts: int = 1, sp=PLAIN):
    """tl._run's loop (tl.BATCH copies of tl.PROMPT, budget tl.N_NEW) for any drafter
    object and rule, uncached (a planted mistake must not reach tl's caches).
    -> (tokens i32[B, N_NEW], steps i32[B], accepted i32[B, G])."""
    batch = tl.BATCH
    g, params = nnx.split(tl._target())
    lc = LoopConfig(max_length=len(tl.PROMPT) + tl.N_NEW, prompt_width=tl.PROMPT_WIDTH,
                    sampling=sp, verify=verify, num_drafts=num_drafts)
    prompt = np.full((tl.PROMPT_WIDTH,), tl.PAD, np.int32)
    prompt[:len(tl.PROMPT)] = tl.PROMPT
    res = speculative_loop(g, params, drafter, dparams, lc,
                           jnp.asarray(np.tile(prompt, (batch, 1))),
                           jnp.full((batch,), len(tl.PROMPT), jnp.int32),
                           jnp.full((batch,), tl.N_NEW, jnp.int32), jax.random.key(seed))
    Tp = len(tl.PROMPT)
    tokens, lengths = np.asarray(res.tokens), np.asarray(res.lengths)
    assert (lengths == Tp + tl.N_NEW).all(), "every row must emit exactly its budget"
    assert (tokens[:, :Tp] == tl.PROMPT).all()
    return tokens[:, Tp:Tp + tl.N_NEW], np.asarray(res.steps), np.asarray(res.accepted)


def _check(label, drafter, dparams, verify, seed, num_drafts=1, sp=PLAIN):
    """The check of tl._check / test_dynamic_tree_is_lossless on one loop call ->
    (statistic, threshold, forbidden mass, acceptance of draft 1 per round)."""
    t0 = time.time()
    seqs, steps, accepted = _run(drafter, dparams, verify, seed, num_drafts, sp)
    exact = tl._exact(sp)
    forbidden = float(du.empirical_pmf(seqs)[exact == 0].sum())
    stat, thresh, worst = du.projection_test(seqs, exact, tl._null(sp, len(seqs)))
    acc = accepted.sum(axis=0) / steps.sum()
    print(f"\n[{label}] z={stat:.2f} thresh={thresh:.2f} worst {worst}; forbidden mass "
          f"{forbidden:.4f}; accepted per round {acc.round(3)} ({time.time() - t0:.1f}s)")
    return stat, thresh, forbidden, acc[0]


def _passes(result) -> bool:
    stat, thresh, forbidden, _ = result
    return stat < thresh and forbidden == 0


def _assert_caught(right, wrong):
    """The correct run passes the check (with drafts both accepted and rejected, as
    tl._assert_lossless asks) and the planted mistake fails it."""
    assert _passes(right), right
    assert 0.05 < right[3] < 0.95, right
    assert not _passes(wrong), wrong


# ----------------------------------------------------------------------------- (a)


@dataclasses.dataclass(frozen=True)
class SharedKeyDrafter:
    """A chain drafter whose K drafts (--num-drafts, `loop.step.propose_drafts`, a vmap
    over DRAFTS_AXIS) all draw with ONE key, draft 0's: the key of a shared-key bug. At
    T > 0 the K drafts are then identical copies."""

    inner: Any

    def __getattr__(self, name):  # gamma, capture, sampling, update_after_tree, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def init(self, params, view, key):
        return self.inner.init(params, view, key)

    def propose(self, params, state, view, key, first_rank=None):
        data = jax.lax.all_gather(jax.random.key_data(key), DRAFTS_AXIS)[0]
        return self.inner.propose(params, state, view, jax.random.wrap_key_data(data),
                                  first_rank=first_rank)

    def update(self, params, state, view, num_accepted):
        return self.inner.update(params, state, view, num_accepted)


@pytest.mark.timeout(60)
def test_shared_key_drafter_repeats_draft_zero():
    """The injection does what it says: through `propose_drafts`, the K drafts of
    SharedKeyDrafter are all draft 0 of the plain drafter's (whose drafts differ)."""

    @dataclasses.dataclass(frozen=True)
    class KeyDrafter:  # drafts random tokens from its key alone
        gamma: int = 3
        sampling: Any = PLAIN

        def propose(self, params, state, view, key, first_rank=None):
            draft = jax.random.randint(key, (4, self.gamma), 0, 1000, jnp.int32)
            return draft, jax.nn.one_hot(draft, 1000), state

    pending, K = jnp.zeros((4,), jnp.int32), 3
    key = jax.random.key(0)

    def drafts(d):
        tree = loop_step.propose_drafts(d, (), (), None, key, K, pending)
        return np.asarray(tree.tokens[:, 1:]).reshape(4, K, 3)

    plain, shared = drafts(KeyDrafter()), drafts(SharedKeyDrafter(KeyDrafter()))
    assert len({plain[0, k].tobytes() for k in range(K)}) == K
    for k in range(K):
        np.testing.assert_array_equal(shared[:, k], plain[:, 0])


# tl.TREE_FAST's two cases: (drafter, rule, K)
TREE_CASES = [("draft-lm", "block", 2),
              pytest.param("eagle3", "token", 2, marks=pytest.mark.slow)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,verify,K", TREE_CASES)
def test_shared_key_across_drafts_is_caught(name, verify, K):
    drafter, dparams = tl._drafter(name, PLAIN)
    seed = 53_000 + K
    right = _check(f"{name} {verify} K={K}", drafter, dparams, verify, seed, K)
    wrong = _check(f"{name} {verify} K={K} shared key", SharedKeyDrafter(drafter), dparams,
                   verify, seed, K)
    _assert_caught(right, wrong)


# ----------------------------------------------------------------------------- (b)


def compact_swapped(cache: KVCache, base, path) -> KVCache:
    """`loop.step.compact_path` with source and destination exchanged: slot base + j is
    copied to slot base + path[j] instead of the other way round (a wrong index)."""
    B, P = path.shape
    rows = jnp.arange(B)[:, None]
    dst = base[:, None] + path
    src = base[:, None] + jnp.arange(P, dtype=jnp.int32)[None, :]
    k = cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, src], mode="drop")
    v = cache.v.at[:, rows, :, dst].set(cache.v[:, rows, :, src], mode="drop")
    return cache.replace(k=k, v=v)


def compact_depth_off_by_one(cache: KVCache, base, path) -> KVCache:
    """The accepted path's K/V moved one depth too shallow: node path[j + 1] lands in
    slot base + j (the root's own entry is overwritten by its child's)."""
    shifted = jnp.concatenate([path[:, 1:], path[:, -1:]], axis=1)
    return compact_path(cache, base, shifted)


COMPACT = {"swapped": compact_swapped, "off_by_one": compact_depth_off_by_one}


# off_by_one only drops the root's entry and doubles x_tau's, a small change for the
# tiny target: under (draft-lm, block) it is caught on some seeds only (z 3.7 to 6.5 over
# seeds 1-3 and this one, threshold 4.8), under (eagle3, token) with z 9 to 11.
COMPACT_CASES = [("draft-lm", "block", 2, "swapped"),
                 pytest.param("eagle3", "token", 2, "off_by_one", marks=pytest.mark.slow)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,verify,K,bug", COMPACT_CASES)
def test_wrong_compaction_at_t1_is_caught(name, verify, K, bug, monkeypatch):
    """The target's K/V of the accepted path compacted with a wrong index
    (`loop.step.compact_path` replaced; the loop is recompiled around it)."""
    drafter, dparams = tl._drafter(name, PLAIN)
    seed = 53_100 + K
    right = _check(f"{name} {verify} K={K}", drafter, dparams, verify, seed, K)
    with monkeypatch.context() as m:
        m.setattr(loop_step, "compact_path", COMPACT[bug])
        jax.clear_caches()  # the loop's jit key does not see the patched function
        try:
            wrong = _check(f"{name} {verify} K={K} compaction {bug}", drafter, dparams,
                           verify, seed, K)
        finally:
            jax.clear_caches()
    _assert_caught(right, wrong)


# ----------------------------------------------------------------------------- (c)


def _residual_is_p(residual, fallback):
    """normalize_or that keeps the fallback: after a rejected sibling r stays the
    target's p (q of a rejected sibling never removed; the correction drawn from p)."""
    del residual
    return fallback


def _residual_unnormalised(residual, fallback):
    """normalize_or without the division: the next sibling is tested against
    max(r - q, 0) instead of norm(max(r - q, 0))."""
    return jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, fallback)


RESIDUALS = {"p": _residual_is_p, "unnormalised": _residual_unnormalised}


@dataclasses.dataclass(frozen=True)
class WrongResidual(TokenLevel):
    """The token rule whose tree form is the library's `verify_tree_token` traced with
    a planted residual (`tree_verify.normalize_or` replaced while the rule is traced
    inside the loop; chains are left as they are)."""

    bug: str = "p"
    name = "token-wrong-residual"

    def tree_rule(self, *, max_depth, max_children, drafts):
        right = super().tree_rule(max_depth=max_depth, max_children=max_children,
                                  drafts=drafts)

        def wrong(tree, p, key):
            with mock.patch.object(tree_verify, "normalize_or", RESIDUALS[self.bug]):
                return right(tree, p, key)
        return wrong


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", ["p", pytest.param("unnormalised", marks=pytest.mark.slow)])
def test_wrong_tree_residual_is_caught(bug):
    """K = 2 i.i.d. drafts of the draft LM: the root has two siblings drawn from one q."""
    drafter, dparams = tl._drafter("draft-lm", PLAIN)
    K, seed = 2, 53_200
    right = _check(f"draft-lm token K={K}", drafter, dparams, "token", seed, K)
    wrong = _check(f"draft-lm token K={K} residual {bug}", drafter, dparams,
                   WrongResidual(bug=bug), seed, K)
    _assert_caught(right, wrong)


# ----------------------------------------------------------------------------- (d)


def _q_shifted(tree, score, parent, nodes):
    """node i carries node i+1's one-hot q, the last node zeros (q laid out one node off)."""
    del score, parent, nodes
    return jnp.concatenate([tree.q[:, 1:], jnp.zeros_like(tree.q[:, :1])], axis=1)


def _q_draft_prob(tree, score, parent, nodes):
    """q[node] = q_draft(token) * one-hot(token): the drafter's probability of the token
    where the deterministic (top-K) choice has probability 1."""
    parent_score = jnp.take_along_axis(score, jnp.maximum(parent, 0), axis=1)
    logq = score - jnp.where(parent >= 0, parent_score, 0.0)  # [B,M] each candidate's
    order = jnp.sort(jax.lax.top_k(score, nodes - 1)[1], axis=1)  # tree_from_candidates'
    prob = jnp.exp(jnp.take_along_axis(logq, order, axis=1))  # [B,N-1] per node
    return tree.q.at[:, 1:].multiply(prob[..., None])


WRONG_Q = {"shifted": _q_shifted, "draft_prob": _q_draft_prob}


@dataclasses.dataclass(frozen=True)
class WrongQTree(DynamicTree):
    """EAGLE-2's dynamic tree (eagle3's `propose_tree_topk`) with a wrong q: the
    `tree_from_candidates` that eagle3's tree code calls is replaced, while this drafter's
    tree is traced, by one whose q is WRONG_Q[bug] of the real tree."""

    bug: str = "shifted"

    def propose_tree(self, params, state, view, key):
        real = eagle3_trees.tree_from_candidates

        def wrong(pending, score, tokens, parent, depth, nodes, vocab=None):
            tree = real(pending, score, tokens, parent, depth, nodes, vocab)
            return tree.replace(q=WRONG_Q[self.bug](tree, score, parent, nodes))

        with mock.patch.object(eagle3_trees, "tree_from_candidates", wrong):
            return super().propose_tree(params, state, view, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", ["shifted", pytest.param("draft_prob", marks=pytest.mark.slow)])
def test_dynamic_tree_wrong_q_is_caught(bug):
    """test_dynamic_tree_is_lossless's default case (eagle3, T = 1, K = 3, N = 9, its seed)."""
    K, N = 3, 9
    drafter, dparams = tl._drafter("eagle3", PLAIN, None)
    seed = K * 100 + N
    right = _check(f"dynamic tree K={K} N={N}", DynamicTree(drafter, K, N), dparams,
                   "token", seed)
    wrong = _check(f"dynamic tree K={K} N={N} q {bug}", WrongQTree(drafter, K, N, bug=bug),
                   dparams, "token", seed)
    _assert_caught(right, wrong)
