"""DFlash2's path selector (specjax/drafters/selector.py) against a float64 numpy
reference written from z-lab/dflash `dflash/model.py` (`CandidateSelector.select`):
candidates are each position's top-K logits, score = logit + <pred[prev] * (h @ proj),
succ[cand]>, the chain walks left to right from the block's first token. The loop's
exactness with it is tests/drafters/test_drafters_distribution.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.sampling import SamplingParams
from specjax.drafters import selector

pytestmark = pytest.mark.timeout(120)

B, G, V, D, R, K = 3, 5, 40, 8, 4, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    pred, succ = rng.normal(size=(V, R)), rng.normal(size=(V, R))
    proj, h = rng.normal(size=(D, R)), rng.normal(size=(B, G, D))
    logits = rng.normal(size=(B, G, V)) * 3
    first = rng.integers(0, V, size=B)
    return pred, succ, proj, h, logits, first


def _ref_scores(pred, succ, proj, h, prev, logits):
    """float64: (candidate ids [K], scores [K]) of one position."""
    cand = np.argsort(-logits, kind="stable")[:K]
    return cand, logits[cand] + (pred[prev] * (h @ proj)) @ succ[cand].T


def _jnp(*xs):
    return [jnp.asarray(x, jnp.float32) if np.asarray(x).dtype.kind == "f"
            else jnp.asarray(x, jnp.int32) for x in xs]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_draft_chain_matches_reference(temperature):
    pred, succ, proj, h, logits, first = _inputs()
    sp = SamplingParams(temperature=temperature)
    draft, q = selector.draft_chain(*_jnp(pred, succ, proj), K, *_jnp(h, logits, first),
                                    jax.random.key(3), sp)
    draft, q = np.asarray(draft), np.asarray(q, np.float64)
    for b in range(B):
        prev = first[b]
        for k in range(G):  # each position conditioned on the token drafted before it
            cand, s = _ref_scores(pred, succ, proj, h[b, k], prev, logits[b, k])
            if temperature == 0:
                assert draft[b, k] == cand[np.argmax(s)]
                assert q[b, k, draft[b, k]] == pytest.approx(1.0)
            else:
                want = np.zeros(V)
                e = np.exp((s - s.max()) / temperature)
                want[cand] = e / e.sum()
                np.testing.assert_allclose(q[b, k], want, atol=2e-5)
                assert draft[b, k] in cand
            prev = draft[b, k]


def test_train_terms_reference_and_gold_insertion():
    pred, succ, proj, h, logits, first = _inputs(1)
    rng = np.random.default_rng(2)
    labels = rng.integers(0, V, size=(B, G))  # mostly outside the top-K: inserted
    labels[:, 0] = np.argmax(logits[:, 0], -1)  # position 1: inside
    check = np.argmax(logits, -1)
    ce, match = selector.train_terms(*_jnp(pred, succ, proj), K,
                                     *_jnp(h, logits, first, labels, check))
    ce, match = np.asarray(ce, np.float64), np.asarray(match)
    for b in range(B):
        for k in range(G):
            prev = first[b] if k == 0 else labels[b, k - 1]  # teacher forcing
            cand = np.argsort(-logits[b, k], kind="stable")[:K]
            if labels[b, k] not in cand:
                cand = np.concatenate([cand[:-1], [labels[b, k]]])
            s = logits[b, k, cand] + (pred[prev] * (h[b, k] @ proj)) @ succ[cand].T
            m = s.max()
            want = -(s[list(cand).index(labels[b, k])] - m - np.log(np.exp(s - m).sum()))
            assert ce[b, k] == pytest.approx(want, rel=1e-4, abs=1e-4)
            prev_c = first[b] if k == 0 else check[b, k - 1]
            c2, s2 = _ref_scores(pred, succ, proj, h[b, k], prev_c, logits[b, k])
            assert match[b, k] == (c2[np.argmax(s2)] == check[b, k])


def test_config_round_trip_and_errors():
    from specjax.drafters import DrafterConfig
    from specjax.errors import SpecjaxError
    from specjax.testing.tiny import tiny_config

    tcfg = tiny_config(64, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
                       head_dim=8, intermediate_size=32)
    base = DrafterConfig.for_target(tcfg, "block", gamma=3)
    assert "selector_rank" not in base.to_json_dict()  # old drafter dirs stay identical
    import dataclasses

    sel = dataclasses.replace(base, selector_rank=4, selector_top_k=8)
    raw = sel.to_json_dict()
    assert raw["selector_rank"] == 4 and DrafterConfig.from_json_dict(raw) == sel
    with pytest.raises(SpecjaxError, match="selector_top_k=65"):
        dataclasses.replace(base, selector_rank=4, selector_top_k=65)
    with pytest.raises(SpecjaxError, match="block drafter setting"):
        dataclasses.replace(DrafterConfig.for_target(tcfg, "eagle3"), selector_rank=4)
