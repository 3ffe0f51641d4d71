"""The test-only oracle drafter (specjax/testing/oracle.py) that the 8B round runs the loop
with at a chosen tau: its expected tau against an enumeration of every keep/replace
pattern, greedy output equal to autoregressive decoding in the compiled loop (chain and
tree), and the measured tau at acceptance 0 and 1 exactly (1 and G + 1 tokens per step)
and in between within the sampling spread. Its law at T = 1 is
tests/drafters/test_lossless_drafters.py's "oracle" case."""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from specjax.core.drafter import LoopView
from specjax.core.sampling import SamplingParams
from specjax.decoding.engine import Engine
from specjax.models.model import Transformer
from specjax.testing.oracle import (
    OracleDrafter,
    OracleTreeDrafter,
    acceptance_for_tau,
    expected_tau,
    record,
    with_acceptance,
)
from specjax.testing.tiny import tiny_config

pytestmark = pytest.mark.timeout(300)

V, NEW, TP = 64, 24, 8
GREEDY = SamplingParams(temperature=0.0)


def _enumerated_tau(a: float, G: int) -> float:
    """E[1 + leading kept drafts] over all 2^G keep patterns, in float64."""
    total = 0.0
    for keep in itertools.product((0, 1), repeat=G):
        prob = np.prod([a if k else 1 - a for k in keep], dtype=np.float64)
        lead = next((i for i, k in enumerate(keep) if not k), G)
        total += prob * (1 + lead)
    return total


@pytest.mark.parametrize("a", [0.0, 0.3, 0.75, 1.0])
def test_expected_tau_matches_enumeration(a):
    for G in (1, 4, 7):
        assert expected_tau(a, G) == pytest.approx(_enumerated_tau(a, G), abs=1e-12)


def test_acceptance_for_tau_inverts():
    for G, tau in [(7, 2.0), (7, 4.0), (7, 6.0), (3, 1.0), (3, 4.0)]:
        assert expected_tau(acceptance_for_tau(tau, G), G) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError, match="tau"):
        acceptance_for_tau(9.0, 7)


@functools.cache
def _target():
    return Transformer(tiny_config(V, num_layers=2, hidden_size=64, intermediate_size=128),
                       rngs=nnx.Rngs(3))


def _prompts(B):
    rs = np.random.default_rng(0)
    return [rs.integers(2, V, TP - b).tolist() for b in range(B)]  # ragged lengths


@functools.cache
def _ar(B):
    eng = Engine(_target(), sampling=GREEDY, max_length=TP + NEW, prompt_width=TP,
                 batch_size=B)
    return eng.run(_prompts(B), NEW, jax.random.key(0)).outputs


@pytest.mark.parametrize("tree_nodes", [None, 13])
def test_greedy_equals_ar_and_tau_follows_acceptance(tree_nodes):
    """One compiled loop for every acceptance (a parameter, `with_acceptance`)."""
    B, G = 3, 4
    ar = _ar(B)
    kw = dict(gamma=G, acceptance=0.0, vocab_size=V)
    if tree_nodes:
        d, p = OracleTreeDrafter.create(_prompts(B), ar, tree_nodes=tree_nodes, **kw)
        assert d.max_children >= 2
    else:
        d, p = OracleDrafter.create(_prompts(B), ar, **kw)
    eng = Engine(_target(), drafter=d, drafter_params=p, sampling=GREEDY,
                 max_length=TP + NEW, prompt_width=TP, batch_size=B)
    taus = {}
    for a in (0.0, 0.6, 1.0):
        eng.drafter_params = with_acceptance(p, a)
        out = eng.run(_prompts(B), NEW, jax.random.key(1))
        assert out.outputs == ar, a
        steps, acc = np.asarray(out.steps), np.asarray(out.accepted)
        taus[a] = 1 + acc.sum() / steps.sum()
        if a == 0.0:
            assert acc.sum() == 0
        if a == 1.0:  # every step takes G + 1 tokens, but a row's last one (budget)
            assert (steps == -(-(NEW - 1) // (G + 1))).all(), steps
    assert taus[0.0] == 1.0
    assert abs(taus[0.6] - expected_tau(0.6, G)) < 0.6, taus  # ~25 steps in all
    assert taus[1.0] > taus[0.6] > taus[0.0]
    with pytest.raises(ValueError, match="acceptance"):
        with_acceptance(p, 1.5)


def test_tree_extra_nodes_never_the_recorded_token():
    d = OracleTreeDrafter(4, V, tree_nodes=16)
    rec = np.arange(40, dtype=np.int32)[None] % V
    lengths = np.array([5, 9], np.int32)
    view = LoopView(tokens=np.tile(rec, (2, 1)), lengths=lengths, target_cache=None,
                    hidden=None, positions=None)
    tree, _ = d.propose_tree({"tokens": rec, "acceptance": 1.0}, (), view, jax.random.key(0))
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    depths = np.asarray(tree.depths)
    for b in range(2):
        for i in range(1, 16):
            want = rec[0, lengths[b] + depths[b, i] - 1]  # the recorded token there
            assert (tokens[b, i] == want) == (i <= 4), (b, i)
            assert depths[b, i] == depths[b, parents[b, i]] + 1


def test_record_pads():
    r = record([[1, 2], [3]], [[4], [5, 6, 7]])
    np.testing.assert_array_equal(r, [[1, 2, 4, 0], [3, 5, 6, 7]])
