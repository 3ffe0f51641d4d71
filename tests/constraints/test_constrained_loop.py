"""Structured output in the loop (issue 55): the output under a token automaton follows
constrained autoregressive decoding of the target exactly, for chains, draft trees and
multi-draft block verification, whether or not the drafter masks its own q.

The setting of tests/drafters/test_lossless_drafters.py (a 6-token-vocabulary target,
25,000 rows per rule, 5 new tokens, G = 2, every view of the 5-token law by
`distribution.projection_test`), under an automaton written here over the token ids
(`DFA`: 3 states, each forbidding 2-3 of the 6 tokens). The reference is
`distribution.exact_joint(..., next_state=DFA)`: float64 enumeration with the forbidden logits at
-inf before temperature, top-k and top-p. Power checks: a loop that verifies against the
unconstrained target, and one whose automaton state does not follow the accepted drafts
(`UnmaskedTarget`, `StaleState` below), fail the same test.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from specjax.constraints.automaton import DEAD, TokenAutomaton
from specjax.constraints.loop import Constraint, build_constraint
from specjax.core.drafter import take_rows
from specjax.core.sampling import SamplingParams
from specjax.decoding.adaptive import GammaSchedule
from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop
from specjax.decoding.verify import Verdict
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.dynamic_tree import DynamicTree
from specjax.drafters.logitspec import LogitSpecDrafter
from specjax.testing import distribution as du
from tests.drafters import test_lossless_drafters as ld

pytestmark = pytest.mark.timeout(600)

V = du.V
X = DEAD
# state -> next state per token id 0..5 (X: forbidden). Every state allows 3-4 tokens.
DFA = np.array([[X, 1, 2, 0, 1, X],
                [2, X, X, X, 0, 1],
                [X, 1, 2, 2, X, 0]], np.int32)
PLAIN, TOP_K, TOP_P = ld.PLAIN, ld.TOP_K, ld.TOP_P
GREEDY = SamplingParams(temperature=0.0)


def automaton() -> TokenAutomaton:
    """DFA as a TokenAutomaton (one class per token id; no state final: no row finishes)."""
    return TokenAutomaton("test DFA", np.arange(V, dtype=np.int32), DFA, np.zeros(3, bool))


def constraint(batch: int) -> Constraint:
    return build_constraint([automaton()], [0] * batch, (), V)


@struct.dataclass
class UnmaskedTarget(Constraint):
    """Power check: the drafter's q is masked, the target's p at the verify positions is
    not (the bonus and correction tokens come from the unconstrained target)."""

    def verify_logits(self, logits, node_states):
        return logits


@struct.dataclass
class StaleState(Constraint):
    """Power check: after a step the state follows the bonus/correction token only, as if
    the accepted drafts had not been emitted."""

    def follow(self, node_states, last, next_token, active):
        del last
        after = self.step(take_rows(node_states, jnp.zeros_like(next_token)), next_token)
        return self.replace(state=jnp.where(active, after, self.state))


def _as(cls, c: Constraint) -> Constraint:
    return cls(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})


def _selector_drafter(sp):
    """A block drafter with DFlash2's path selector (rank 4 over the top-3), opinionated."""
    dcfg = DrafterConfig.for_target(ld.CFG2, "block", gamma=ld.GAMMA, context="hidden",
                                    mask_token_id=ld.PAD)
    dcfg = dataclasses.replace(dcfg, selector_rank=4, selector_top_k=3)
    net = build_network(dcfg, rngs=nnx.Rngs(7))
    state = nnx.state(net, nnx.Param)
    nnx.update(net, jax.tree.map(lambda x: x * 25.0 if x.ndim >= 2 else x, state))
    return make_drafter(dcfg, net, ld._target(), gamma=ld.GAMMA, sampling=sp)


def _markov_drafter(sp):
    """A block drafter with DSpark's Markov head (rank 4), opinionated."""
    dcfg = DrafterConfig.for_target(ld.CFG2, "block", gamma=ld.GAMMA, context="hidden",
                                    mask_token_id=ld.PAD)
    dcfg = dataclasses.replace(dcfg, markov_rank=4)
    net = build_network(dcfg, rngs=nnx.Rngs(7))
    state = nnx.state(net, nnx.Param)
    nnx.update(net, jax.tree.map(lambda x: x * 25.0 if x.ndim >= 2 else x, state))
    return make_drafter(dcfg, net, ld._target(), gamma=ld.GAMMA, sampling=sp)


def _drafter(name, sp):
    if name == "selector":
        return _selector_drafter(sp)
    if name == "markov":
        return _markov_drafter(sp)
    if name == "confident-block":  # verification scheduled by its confidence (DSpark)
        from tests.decoding.test_confidence_schedule import _confident

        inner, params = ld._drafter("block-hidden", sp)
        return _confident(inner), params
    if name.startswith("tree-"):  # an EAGLE-2 dynamic tree (--tree-topk 2 --tree-nodes 5)
        inner, params = ld._drafter(name[len("tree-"):], sp)
        return DynamicTree(inner, 2, 5), params
    if name == "logitspec":
        return LogitSpecDrafter.create(V, gamma=ld.GAMMA, tree_nodes=5, sampling=sp), ()
    return ld._drafter(name, sp)


def _prompts(batch):
    prompt = np.full((ld.PROMPT_WIDTH,), ld.PAD, np.int32)
    prompt[: len(ld.PROMPT)] = ld.PROMPT
    return (jnp.asarray(np.tile(prompt, (batch, 1))),
            jnp.full((batch,), len(ld.PROMPT), jnp.int32),
            jnp.full((batch,), ld.N_NEW, jnp.int32))


def _run(name, verify, sp, num_drafts=1, schedule=False, kernels="off", wrong=None,
         batch=None, seed=None):
    """The first N_NEW generated tokens i32[B,N_NEW] of one loop call under DFA (name
    "ar": the autoregressive loop), and the acceptance of the first draft per step."""
    batch = batch or ld.BATCH * (2 if verify == "both" else 1)
    seed = zlib.crc32(f"{name} {verify} {sp} {num_drafts} {schedule} {kernels} {wrong}"
                      .encode()) if seed is None else seed
    c = constraint(batch)
    if wrong is not None:
        c = _as(wrong, c)
    g, params = nnx.split(ld._target())
    lc = LoopConfig(max_length=len(ld.PROMPT) + ld.N_NEW, prompt_width=ld.PROMPT_WIDTH,
                    sampling=sp, verify=ld.VERIFY[verify], kernels=kernels,
                    num_drafts=num_drafts,
                    schedule=GammaSchedule((0, 1, ld.GAMMA), policy="random",
                                           confidence=name.startswith("confident"))
                    if schedule else None)
    if name == "ar":
        res = autoregressive_loop(g, params, lc, *_prompts(batch), jax.random.key(seed),
                                  constraint=c)
        acc = None
    else:
        drafter, dparams = _drafter(name, sp)
        res = speculative_loop(g, params, drafter, dparams, lc, *_prompts(batch),
                               jax.random.key(seed), constraint=c)
        acc = np.asarray(res.accepted).sum(0) / np.asarray(res.steps).sum()
    Tp = len(ld.PROMPT)
    lengths = np.asarray(res.lengths)
    assert (lengths == Tp + ld.N_NEW).all(), "no state finishes: every row emits its budget"
    return np.asarray(res.tokens)[:, Tp:Tp + ld.N_NEW], acc


@functools.cache
def _exact(sp: SamplingParams):
    joint, margin = du.exact_joint(ld._target(), ld.PROMPT, ld.N_NEW, sp.temperature,
                                   sp.top_k, sp.top_p, next_state=DFA)
    assert margin > 1e-3, f"filter boundary margin {margin:.2e} too small for {sp}"
    return joint


@functools.cache
def _null(sp: SamplingParams, n: int):
    return du.projection_null(_exact(sp), n, ld.LEVEL)


def _walk_ok(seqs) -> np.ndarray:
    """bool[N]: each row of i32[N,n] is allowed by DFA from state 0."""
    state = np.zeros(len(seqs), np.int64)
    for j in range(seqs.shape[1]):
        state = np.where(state < 0, -1, DFA[np.maximum(state, 0), seqs[:, j]])
    return state >= 0


def _check(name, verify, sp, **kw):
    tokens, acc = _run(name, verify, sp, **kw)
    exact = _exact(sp)
    out = {}
    for rule, rows in ld._halves(verify, len(tokens)).items():
        seqs = tokens[rows]
        stat, thresh, worst = du.projection_test(seqs, exact, _null(sp, len(seqs)))
        out[rule] = (stat, thresh, worst, _walk_ok(seqs).mean())
        print(f"\n[{name} {rule} {kw}] z={stat:.2f} thresh={thresh:.2f} worst {worst}; "
              f"valid {out[rule][3]:.4f}; accepted per step {acc}")
    return out, acc


def _assert_exact(name, verify, sp, **kw):
    out, acc = _check(name, verify, sp, **kw)
    for rule, (stat, thresh, worst, valid) in out.items():
        assert valid == 1.0, f"{rule}: an output the automaton forbids"
        assert stat < thresh, (rule, stat, thresh, worst)
    if acc is not None:  # meaningful only if drafts are both accepted and rejected
        assert 0.05 < acc[0] < 0.95, acc


def test_setup_is_discriminating():
    """The constraint changes the law: the constrained and unconstrained joints are far
    apart, and no state allows every token."""
    free = du.exact_joint(ld._target(), ld.PROMPT, ld.N_NEW, 1.0)[0]
    assert du.tv(free, _exact(PLAIN)) > 0.3
    assert ((DFA == DEAD).sum(axis=1) >= 2).all()


def test_constrained_autoregressive_follows_the_enumeration():
    """The reference loop itself: autoregressive decoding under DFA."""
    _assert_exact("ar", "token", PLAIN)


CASES = [  # (drafter, verify, sampling, num_drafts); drafters mask their q except ngram
    ("eagle3", "both", PLAIN, 1),
    ("block-hidden", "both", TOP_K, 1),
    ("ngram", "both", TOP_P, 1),
    ("draft-lm", "block", PLAIN, 2),  # multi-draft block verification over a tree
]
SLOW = [
    ("eagle3", "token", TOP_K, 3),  # recursive rejection over a tree
    ("tree-kv", "token", PLAIN, 1),  # an EAGLE-2 dynamic tree (its drafts not masked)
    ("logitspec", "token", PLAIN, 1),
    ("kv", "both", PLAIN, 1),
    ("hybrid", "both", TOP_P, 1),
    ("selector", "both", PLAIN, 1),
    ("markov", "both", TOP_P, 1),
    ("medc", "both", PLAIN, 1),
    ("dflash", "both", TOP_K, 1),
    ("block-kv", "token", PLAIN, 2),
    ("draft-lm", "both", TOP_K, 1),
]


@pytest.mark.parametrize("name,verify,sp,num_drafts",
                         CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW],
                         ids=lambda x: ld._id(x))
def test_speculative_output_follows_constrained_target(name, verify, sp, num_drafts):
    _assert_exact(name, verify, sp, num_drafts=num_drafts)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle3", "confident-block"])
def test_adaptive_draft_length_under_a_constraint(name):
    """A random draft length per step; for the confident block drafter, per row from its
    confidence in the drafts (the schedule DSpark's head drives)."""
    _assert_exact(name, "both", PLAIN, schedule=True)


@pytest.mark.slow
def test_fused_verification_under_a_constraint():
    _assert_exact("kv", "block", PLAIN, kernels="reference")


@pytest.mark.parametrize("wrong", [UnmaskedTarget, StaleState], ids=lambda c: c.__name__)
def test_power_wrong_constraint_handling_is_caught(wrong):
    out, _ = _check("eagle3", "both", PLAIN, wrong=wrong)
    for rule, (stat, thresh, worst, _valid) in out.items():
        assert stat > thresh, (rule, stat, thresh, worst)


def test_greedy_equals_constrained_autoregressive():
    """T = 0: speculative output equals constrained AR token for token (chains and a
    tree), and every output walks the automaton."""
    ar, _ = _run("ar", "token", GREEDY, batch=4, seed=0)
    assert _walk_ok(ar).all()
    for name, k in [("eagle3", 1), ("block-hidden", 1), ("ngram", 1), ("draft-lm", 2),
                    ("tree-eagle3", 1), ("tree-block-hidden", 1), ("logitspec", 1)]:
        spec, _ = _run(name, "block", GREEDY, num_drafts=k, batch=4, seed=0)
        np.testing.assert_array_equal(spec, ar, err_msg=name)


def accept_all(draft, q, p, key):
    """A probe, not a rule: accepts every draft, so the output shows what was drafted."""
    del q, key
    B, G = draft.shape
    return Verdict(jnp.full((B,), G, jnp.int32), jnp.argmax(p[:, -1], -1).astype(jnp.int32))


@pytest.mark.parametrize("name", ["eagle3", "block-hidden", "ngram"] + [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("draft-lm", "kv", "hybrid", "selector", "medc", "dflash")])
def test_drafters_propose_only_allowed_tokens(name):
    """Drafters that read `LoopView.constraint` draft only what the automaton allows
    (every draft accepted by the probe `accept_all` walks DFA); n-gram lookup does not
    mask (its drafts are copies of earlier text), which shows that the probe can fail."""
    g, params = nnx.split(ld._target())
    lc = LoopConfig(max_length=len(ld.PROMPT) + ld.N_NEW, prompt_width=ld.PROMPT_WIDTH,
                    sampling=PLAIN, verify=accept_all)
    drafter, dparams = _drafter(name, PLAIN)
    res = speculative_loop(g, params, drafter, dparams, lc, *_prompts(512),
                           jax.random.key(1), constraint=constraint(512))
    Tp = len(ld.PROMPT)
    valid = _walk_ok(np.asarray(res.tokens)[:, Tp:Tp + ld.N_NEW])
    if name == "ngram":
        assert valid.mean() < 0.99, valid.mean()
    else:
        assert valid.all(), (name, valid.mean())


def _parity_automaton(vocab: int) -> TokenAutomaton:
    """Outputs alternate an even id (not 0) and an odd id; end of sequence (id 0) after
    an odd one. Classes: 0 eos, 1 even, 2 odd; state 0 is final."""
    cls = np.where(np.arange(vocab) % 2 == 0, 1, 2).astype(np.int32)
    cls[0] = 0
    nxt = np.array([[0, 1, X], [X, X, 0]], np.int32)
    return TokenAutomaton("parity", cls, nxt, np.array([True, False]))


@pytest.mark.slow
def test_constrained_decoding_on_a_mesh_equals_one_device():
    """Engine(mesh=, constraints=) on 8 simulated devices (data=2, model=4): the rows'
    automaton states are split with the rows; greedy output equals one device's and
    follows the automaton."""
    from specjax.constraints.sets import ConstrainedIds, ConstraintSet
    from specjax.decoding.engine import Engine
    from specjax.decoding.sharding import decode_mesh
    from tests.decoding import test_decode_mesh as dm

    t = dm.target()
    auto = _parity_automaton(t.cfg.vocab_size)
    cset = ConstraintSet([auto], (0,), t.cfg.vocab_size)
    prompts = [ConstrainedIds(p, "parity") if i % 2 == 0 else p
               for i, p in enumerate(dm.prompts())]
    outs = []
    for mesh in (None, "data=2,model=4"):
        drafter, dparams = dm.drafter_for("eagle3")
        eng = Engine(t, drafter=drafter, drafter_params=dparams, max_length=48,
                     prompt_width=16, batch_size=8, eos_token_ids=(0,), constraints=cset,
                     mesh=None if mesh is None else decode_mesh(mesh))
        outs.append(eng.run(prompts, max_new_tokens=24, key=jax.random.key(0)).outputs)
    assert outs[0] == outs[1]
    for i, out in enumerate(outs[0]):
        if i % 2 == 0:
            assert cset.matched("parity", out) or len(out) == 24, out
            assert all((t_ % 2 == 0) == (j % 2 == 0) for j, t_ in enumerate(out) if t_), out
