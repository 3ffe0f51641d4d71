"""LogitSpec (specjax/drafters/logitspec.py): the tree against a plain-Python reference
of the same rule, greedy identity with autoregressive decoding, a larger mean accepted
length than plain prompt lookup on a repetitive prompt, and losslessness at T = 1 with
token-level tree verification (the exact-distribution harness of
tests/drafters/test_lossless_drafters.py)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.drafter import LoopView
from specjax.core.sampling import SamplingParams
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.drafters.logitspec import LogitSpecDrafter, branch_length, full_tree_nodes
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import SpecjaxError
from specjax.testing import distribution as du
from tests.decoding import test_speculative_greedy as sg
from tests.drafters import test_lossless_drafters as ld

# ----------------------------------------------------------------------------- reference


def ref_lookup(ctx, n_max, n_min, length):
    """Prompt lookup on a plain list: the continuation (`length` tokens, periodic past the
    end) of the latest earlier occurrence of the longest suffix of ctx (n_max..n_min), or
    None."""
    for n in range(n_max, n_min - 1, -1):
        if len(ctx) < n:
            continue
        key = ctx[len(ctx) - n:]
        for j in range(len(ctx) - 2, n - 2, -1):  # occurrence ending at j, latest first
            if ctx[j - n + 1:j + 1] == key:
                period = len(ctx) - 1 - j
                return [ctx[j + 1 + i % period] for i in range(length)]
    return None


def ref_tree(ctx, logits, G, C, N, n_max=3, n_min=1):
    """The LogitSpec tree of one row as lists (tokens, parents, depths, valid), written
    from the module docstring's rule without the module's code."""
    p = ctx[-1]
    order = [int(t) for t in np.argsort(-np.asarray(logits), kind="stable") if t != p]
    root = ref_lookup(ctx, n_max, n_min, G)
    if root is not None:
        order = [t for t in order if t != root[0]]
    root = root or [p] * G  # no match: NgramDrafter's fallback, the last token repeated
    nodes = [(p, -1, 0, True)]
    for k in range(G):
        nodes.append((root[k], len(nodes) - 1 if k else 0, k + 1, True))
    for r in range(1, C + 1):
        c = order[r - 1]
        length = min(4 if r <= 8 else 3 if r <= 32 else 1, G)
        cont = ref_lookup(ctx + [c], n_max, n_min, length - 1) or [c] * (length - 1)
        nodes.append((c, 0, 1, True))
        for k in range(1, length):
            nodes.append((cont[k - 1], len(nodes) - 1, k + 1, True))
    nodes = nodes[:N] + [(p, -1, 0, False)] * (N - len(nodes))
    return tuple(list(x) for x in zip(*nodes, strict=True))


def _tree_of(drafter, toks, lens, logits):
    view = LoopView(jnp.asarray(toks), jnp.asarray(lens), None, None,
                    jnp.asarray(lens - 1)[:, None], logits=jnp.asarray(logits))
    state = jax.jit(drafter.init)((), view, jax.random.key(0))
    tree, _ = jax.jit(drafter.propose_tree)((), state, view.replace(logits=None),
                                            jax.random.key(1))
    return tree


def _buffers(rs, B, S, V):
    """Token buffers of varied kinds, with some rows built to hit the special cases: a
    pending token that never occurred (no branch-0 match), candidates that never occur
    (no continuation), branch 0's first token among the top logits (a duplicate to drop),
    repetitive text (long matches), a one-token context."""
    toks = rs.randint(0, 6, (B, S)).astype(np.int32)
    lens = rs.randint(2, S - 1, B).astype(np.int32)
    logits = rs.standard_normal((B, V)).astype(np.float32)
    for b in range(B):
        kind = b % 5
        if kind == 0:  # fresh pending token: branch 0 has no match
            toks[b, lens[b] - 1] = V - 1
        elif kind == 1:  # repetitive text
            period = rs.randint(2, 5)
            toks[b] = np.tile(toks[b, :period], S // period + 1)[:S]
        elif kind == 2:  # branch 0's first token is the best logit: must be dropped
            ctx = toks[b, :lens[b]].tolist()
            root = ref_lookup(ctx, 3, 1, 1)
            if root is not None and root[0] != ctx[-1]:
                logits[b, root[0]] = 10.0
        elif kind == 3:  # one-token context
            lens[b] = 1
        # the top logits mostly on tokens absent from the buffer (no candidate match)
        if kind in (0, 4):
            logits[b, 8:] += 3.0
        toks[b, lens[b]:] = rs.randint(0, V, S - lens[b])  # stale tail: never read
    return toks, lens, logits


@pytest.mark.parametrize("G,C,N", [(4, 6, 30), (3, 10, 60), (5, 12, 40), (2, 3, 5),
                                   (1, 4, 6)])
def test_tree_matches_python_reference(G, C, N):
    V, B, S = 40, 20, 24
    rs = np.random.RandomState(G * 100 + C)
    toks, lens, logits = _buffers(rs, B, S, V)
    drafter = LogitSpecDrafter(G, V, num_candidates=C, tree_nodes=N)
    tree = _tree_of(drafter, toks, lens, logits)
    got = [np.asarray(x) for x in (tree.tokens, tree.parents, tree.depths, tree.valid)]
    assert tree.q is None
    cases = set()
    for b in range(B):
        ctx = toks[b, :lens[b]].tolist()
        want = ref_tree(ctx, logits[b], G, C, N)
        for name, g, w in zip(("tokens", "parents", "depths", "valid"), got, want, strict=True):
            np.testing.assert_array_equal(g[b], w, err_msg=f"row {b} {name}")
        root = ref_lookup(ctx, 3, 1, 1)
        cases.add("root" if root else "no root")
        top = [t for t in np.argsort(-logits[b], kind="stable") if t != ctx[-1]][:C]
        if root and root[0] in top:
            cases.add("duplicate dropped")
        if any(ref_lookup(ctx + [int(c)], 3, 1, 1) is None for c in top):
            cases.add("candidate without match")
        if any(ref_lookup(ctx + [int(c)], 3, 1, 1) is not None for c in top):
            cases.add("candidate match")
        v, par = got[3][b], got[1][b]
        assert (par[1:][v[1:]] < np.arange(1, N)[v[1:]]).all()  # topological
        kids = got[0][b][(par == 0) & v]
        assert len(set(kids.tolist())) == len(kids), f"row {b}: root children repeat"
        assert (got[2][b] <= G).all()
    assert cases == {"root", "no root", "duplicate dropped", "candidate without match",
                     "candidate match"}


def test_sampled_q_is_one_hot_and_layout():
    V, G = 40, 4
    rs = np.random.RandomState(3)
    toks, lens, logits = _buffers(rs, 6, 20, V)
    d = LogitSpecDrafter(G, V, num_candidates=3, tree_nodes=20,
                         sampling=SamplingParams(temperature=1.0))
    tree = _tree_of(d, toks, lens, logits)
    np.testing.assert_array_equal(np.asarray(tree.q),
                                  np.asarray(jax.nn.one_hot(tree.tokens, V)))
    assert d.layout() == tuple([(0, k) for k in range(4)] + [(r, k) for r in (1, 2, 3)
                                                               for k in range(4)])
    assert d.max_children == 4
    assert [branch_length(r, 7) for r in (1, 8, 9, 32, 33)] == [4, 4, 3, 3, 1]
    assert full_tree_nodes(4, 8) == 37
    # create fills N with branches, the last one cut: 1 + 4 + 8 * 4 + 3 (rank 9: 3 tokens)
    made = LogitSpecDrafter.create(8192, tree_nodes=40)
    assert (made.gamma, made.num_candidates, len(made.layout())) == (4, 9, 39)
    made = LogitSpecDrafter.create(8192)  # the CPU default: branch 0 and 3 nodes of rank 1
    assert (made.gamma, made.num_candidates, made.layout()[4:]) == (4, 1, ((1, 0), (1, 1),
                                                                           (1, 2)))
    with pytest.raises(SpecjaxError):
        LogitSpecDrafter(4, 6, num_candidates=5)


# ----------------------------------------------------------------------------- in the loop

def run_logitspec(G, budgets, C=6, N=None, toks=None, lens=None):
    target, _ = sg.models()
    g, p = nnx.split(target)
    N = N or full_tree_nodes(G, C)
    drafter = LogitSpecDrafter(G, sg.V, num_candidates=C, tree_nodes=N)
    if toks is None:
        toks, lens = sg.prompts()
    cfg = LoopConfig(max_length=toks.shape[1] + max(budgets), prompt_width=toks.shape[1])
    return speculative_loop(g, p, drafter, (), cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


@pytest.mark.parametrize("G,C,N", [(3, 6, None), (5, 4, 12)])
def test_greedy_equals_autoregressive(G, C, N):
    """Batch 4, prompt lengths 9/2/5/7, budgets 24/13/7/1; N = 12 cuts a branch."""
    ar = sg.run_ar(sg.BUDGETS)
    sp = run_logitspec(G, sg.BUDGETS, C, N)
    assert sg.rows(sp) == sg.rows(ar)
    lens = np.asarray(sp.lengths) - sg.PROMPT_LENS
    assert lens.tolist() == sg.BUDGETS
    acc, steps = np.asarray(sp.accepted), np.asarray(sp.steps)
    assert (acc[:, 1:] <= acc[:, :-1]).all()
    assert 0 < acc.sum() < G * steps.sum()  # drafts both accepted and rejected


def _tau(res):
    return np.asarray(res.accepted).sum() / np.asarray(res.steps).sum()


def test_beats_prompt_lookup_on_a_copied_list():
    """A copied list as the prompt (SEEDS.md's check): LogitSpec's mean accepted length
    exceeds plain prompt lookup's at the same G by a clear margin. Branch 0 is prompt
    lookup's chain, so the same code with no room for candidates (N = G + 1) accepts
    exactly what NgramDrafter does: the gain is the logit candidates'."""
    G, budget, B = 4, 40, 8
    rs = np.random.RandomState(5)
    items = rs.randint(2, sg.V, (B, 8))
    toks = jnp.asarray(np.concatenate([items, items, items[:, :4]], 1), jnp.int32)  # 20
    lens = jnp.full((B,), toks.shape[1], jnp.int32)
    target, _ = sg.models()
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=toks.shape[1] + budget, prompt_width=toks.shape[1])
    ng = speculative_loop(g, p, NgramDrafter(G, sg.V), (), cfg, toks, lens,
                          jnp.full((B,), budget, jnp.int32), jax.random.key(0))
    ls = run_logitspec(G, [budget] * B, C=6, toks=toks, lens=lens)
    bare = run_logitspec(G, [budget] * B, C=1, N=G + 1, toks=toks, lens=lens)
    np.testing.assert_array_equal(np.asarray(ls.tokens)[:, :60], np.asarray(ng.tokens)[:, :60])
    np.testing.assert_array_equal(np.asarray(bare.accepted), np.asarray(ng.accepted))
    t_ls, t_ng = _tau(ls), _tau(ng)
    print(f"\ntau logitspec {t_ls:.3f} ngram {t_ng:.3f}")
    assert t_ls > t_ng + 0.15, (t_ls, t_ng)


# ----------------------------------------------------------------------------- lossless

class _UniformQ(LogitSpecDrafter):
    """A broken LogitSpec for the power check: it reports a uniform q at every node, as
    if its deterministic guesses had been drawn at random."""

    def propose_tree(self, params, state, view, key):
        tree, state = super().propose_tree(params, state, view, key)
        return tree.replace(q=jnp.full_like(tree.q, 1.0 / self.vocab_size)), state


def _run_lossless(sp, C, N, batch=ld.BATCH, cls=LogitSpecDrafter):
    G = ld.GAMMA
    drafter = cls(G, ld.V, num_candidates=C, tree_nodes=N, sampling=sp)
    g, params = nnx.split(ld._target())
    lc = LoopConfig(max_length=len(ld.PROMPT) + ld.N_NEW, prompt_width=ld.PROMPT_WIDTH,
                    sampling=sp, verify="token")
    prompt = np.full((ld.PROMPT_WIDTH,), ld.PAD, np.int32)
    prompt[:len(ld.PROMPT)] = ld.PROMPT
    seed = zlib.crc32(f"logitspec {sp} {C} {N} {cls.__name__}".encode())
    res = speculative_loop(g, params, drafter, (), lc, jnp.asarray(np.tile(prompt, (batch, 1))),
                           jnp.full((batch,), len(ld.PROMPT), jnp.int32),
                           jnp.full((batch,), ld.N_NEW, jnp.int32), jax.random.key(seed))
    Tp = len(ld.PROMPT)
    tokens, lengths = np.asarray(res.tokens), np.asarray(res.lengths)
    assert (lengths == Tp + ld.N_NEW).all()
    assert np.asarray(res.steps).min() >= 2  # the later tokens follow a drafter update
    return tokens[:, Tp:Tp + ld.N_NEW], np.asarray(res.steps), np.asarray(res.accepted)


@pytest.mark.parametrize("sp,C,N", [
    (ld.PLAIN, 3, 9),  # branch 0 and three candidate branches of G = 2, whole
    pytest.param(ld.TOP_K, 4, 8, marks=pytest.mark.slow),  # the last branch cut
    pytest.param(ld.TOP_P, 2, 7, marks=pytest.mark.slow),
], ids=["plain", "topk", "topp"])
def test_lossless_at_temperature_one(sp, C, N):
    """T = 1 through the real loop with token-level tree verification: the law of the 5
    emitted tokens is the target's exact law (specjax.testing.distribution.projection_test at the
    harness's level), and drafts are both accepted and rejected."""
    seqs, steps, accepted = _run_lossless(sp, C, N)
    exact = ld._exact(sp)
    emp = du.empirical_pmf(seqs)
    assert (emp[exact == 0] == 0).all(), "a sequence the target forbids"
    stat, thresh, worst = du.projection_test(seqs, exact, ld._null(sp, len(seqs)))
    acc = accepted.sum(axis=0) / steps.sum()
    print(f"\n[logitspec {ld._id(sp)} C={C} N={N}] z={stat:.2f} thresh={thresh:.2f} "
          f"worst {worst}; accepted per round {acc.round(3)}")
    assert stat < thresh, (stat, thresh, worst)
    assert 0.05 < acc[0] < 0.95 and acc[-1] > 0.01, acc


@pytest.mark.slow
def test_uniform_q_is_caught():
    """Power: the same trees with a uniform q (not one-hot at the deterministic guess)
    fail the test above."""
    seqs, _, _ = _run_lossless(ld.PLAIN, 3, 9, cls=_UniformQ)
    stat, thresh, worst = du.projection_test(seqs, ld._exact(ld.PLAIN),
                                             ld._null(ld.PLAIN, len(seqs)))
    print(f"\n[logitspec uniform q] z={stat:.2f} thresh={thresh:.2f} worst {worst}")
    assert stat > thresh, (stat, thresh, worst)
