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


def test_train_terms_soft_target_is_p_over_the_candidates_renormalised():
    """selector_soft_labels: the CE's target is the target's p over the (label-inserted)
    candidates, renormalised; a one-hot p gives back the hard CE (the power check: a soft
    target that ignored p, or did not renormalise, differs)."""
    pred, succ, proj, h, logits, first = _inputs(3)
    rng = np.random.default_rng(4)
    tl = rng.normal(size=logits.shape) * 2.0
    p = np.exp(tl - tl.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labels = np.argmax(tl, -1)
    ce, _ = selector.train_terms(*_jnp(pred, succ, proj), K,
                                 *_jnp(h, logits, first, labels, labels, p))
    ce = np.asarray(ce, np.float64)
    for b in range(B):
        for k in range(G):
            prev = first[b] if k == 0 else labels[b, k - 1]
            cand = np.argsort(-logits[b, k], kind="stable")[:K]
            if labels[b, k] not in cand:
                cand = np.concatenate([cand[:-1], [labels[b, k]]])
            s = logits[b, k, cand] + (pred[prev] * (h[b, k] @ proj)) @ succ[cand].T
            logq = s - s.max() - np.log(np.exp(s - s.max()).sum())
            t = p[b, k, cand] / p[b, k, cand].sum()
            assert ce[b, k] == pytest.approx(-(t * logq).sum(), rel=1e-4, abs=1e-4)
    onehot = np.eye(V)[labels]
    hard, _ = selector.train_terms(*_jnp(pred, succ, proj), K,
                                   *_jnp(h, logits, first, labels, labels))
    soft1, _ = selector.train_terms(*_jnp(pred, succ, proj), K,
                                    *_jnp(h, logits, first, labels, labels, onehot))
    np.testing.assert_allclose(np.asarray(soft1), np.asarray(hard), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(soft1) - ce).max() > 1e-2


def test_soft_selector_labels_need_a_selector():
    from specjax.errors import SpecjaxError
    from specjax.train.config import DrafterTrainConfig

    DrafterTrainConfig(kind="block", selector_rank=4, selector_soft_labels=True)
    with pytest.raises(SpecjaxError, match="selector_soft_labels needs a path selector"):
        DrafterTrainConfig(kind="block", selector_soft_labels=True)


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


def test_candidate_probs_matches_reference():
    pred, succ, proj, h, logits, first = _inputs(2)
    prev_tokens = np.random.default_rng(5).integers(0, V, size=(B, G))
    q, cand = selector.candidate_probs(*_jnp(pred, succ, proj), K,
                                       *_jnp(h, logits, first, prev_tokens))
    q, cand = np.asarray(q, np.float64), np.asarray(cand)
    for b in range(B):
        for k in range(G):  # teacher-forced: the predecessor is prev_tokens[k - 1]
            prev = first[b] if k == 0 else prev_tokens[b, k - 1]
            want_c, s = _ref_scores(pred, succ, proj, h[b, k], prev, logits[b, k])
            assert cand[b, k].tolist() == want_c.tolist()
            e = np.exp(s - s.max())
            np.testing.assert_allclose(q[b, k], e / e.sum(), atol=2e-6)


def test_confidence_target_with_the_selector_is_one_minus_tv_of_its_chain():
    """The block objective with the path selector and a confidence head: the BCE target
    at draft position k is 1 - TV(p_target, q_k), q_k the selector's distribution over its
    K candidates given the target's greedy token before it (0 elsewhere). With the head's
    logit fixed at c (proj 0, bias c), loss(alpha) - loss(0) = alpha x the weighted mean
    of softplus(c) - c y; y from a float64 numpy reference. The plain softmax's TV (what
    the objective uses without a selector) gives another figure, so the check can fail."""
    import dataclasses

    from flax import nnx

    from specjax.drafters import DrafterConfig, build_network
    from specjax.testing.models import peaked_model
    from specjax.train.objectives import Frozen
    from specjax.train.objectives.block import block_loss, sample_anchors
    from tests.decoding.test_speculative_greedy import CFG

    tgt = peaked_model(CFG, seed=1, scale=4.0)
    Gb, Kb, A, c, alpha = 3, 4, 4, 0.7, 0.5
    dcfg = dataclasses.replace(DrafterConfig.for_target(CFG, "block", gamma=Gb),
                               selector_rank=4, selector_top_k=Kb, confidence_head=True)
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for name in ("sel_pred", "sel_succ", "sel_proj"):
        p = getattr(net, name, None)
        if p is not None:  # the successor codebook starts at zero: give it weight
            p.set_value(jnp.asarray(rng.normal(size=p.shape) * 0.5, p.dtype))
    net.conf_proj.set_value(jnp.zeros_like(net.conf_proj[...]))
    net.conf_bias.set_value(jnp.full_like(net.conf_bias[...], c))
    rows_ = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 17)), jnp.int32)
    T = rows_.shape[1] - 1
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    out = tgt(rows_[:, :T], pos, None, capture=dcfg.capture, capture_kv=())
    frozen = Frozen.from_target(tgt)
    key = jax.random.key(3)
    l0 = block_loss(net, out, rows_, frozen, key, num_anchors=A, confidence_alpha=0.0)[0]
    l1 = block_loss(net, out, rows_, frozen, key, num_anchors=A, confidence_alpha=alpha)[0]
    # the reference: the same anchors and block outputs, the target in float64 numpy
    anchors = np.asarray(sample_anchors(key, 2, T, Gb, A))
    contexts = net.contexts(out.hidden, out.kv, pos, frozen.inv_freq)
    blk = net.blocks(contexts, jnp.asarray(anchors), rows_[:, :T], frozen.embed,
                     frozen.inv_freq, Gb, None)[:, :, net.layout(Gb)[1]:]
    h = np.asarray(net.final_hidden(blk), np.float64)
    lg = np.asarray(net.logits(blk, frozen.head), np.float64)
    pred_, succ_, proj_ = (np.asarray(w, np.float64) for w in net.selector())
    tl = np.asarray(out.logits, np.float64)
    w = np.exp(-np.arange(Gb) / 7.0)  # gamma_w 7, block_loss's default
    ys, ys_plain = np.zeros((2, A, Gb)), np.zeros((2, A, Gb))
    for b in range(2):
        for a in range(A):
            prev = int(rows_[b, anchors[b, a]])
            for k in range(Gb):
                t = tl[b, anchors[b, a] + k]
                p = np.exp(t - t.max())
                p /= p.sum()
                cand = np.argsort(-lg[b, a, k], kind="stable")[:Kb]
                s = lg[b, a, k][cand] + (pred_[prev] * (h[b, a, k] @ proj_)) @ succ_[cand].T
                q = np.exp(s - s.max())
                q /= q.sum()
                tv = 0.5 * (np.abs(p[cand] - q).sum() + 1 - p[cand].sum())
                ys[b, a, k] = np.clip(1 - tv, 0, 1)
                qp = np.exp(lg[b, a, k] - lg[b, a, k].max())
                ys_plain[b, a, k] = 1 - 0.5 * np.abs(p - qp / qp.sum()).sum()
                prev = int(np.argmax(t))  # the target's greedy token before k + 1

    def diff(y):
        bce = np.logaddexp(0.0, c) - c * y
        return alpha * (bce * w).sum() / (w.sum() * 2 * A)

    np.testing.assert_allclose(float(l1 - l0), diff(ys), rtol=2e-4)
    assert abs(diff(ys_plain) - diff(ys)) > 20 * 2e-4 * abs(diff(ys))  # the power


def test_selector_with_confidence_is_refused_by_the_dflash_export(tmp_path, capsys):
    """No producer's layout holds the path selector and a confidence head: one line, exit 2,
    nothing written."""
    import dataclasses

    from flax import nnx

    from specjax.drafters import DrafterConfig, build_network
    from specjax.drafters.io import save_drafter
    from specjax.models.checkpoint import save_model
    from specjax.testing.models import peaked_model
    from specjax.tools import convert
    from tests.decoding.test_speculative_greedy import CFG

    save_model(peaked_model(CFG, seed=0), str(tmp_path / "target"))
    dcfg = dataclasses.replace(DrafterConfig.for_target(CFG, "block", gamma=3),
                               selector_rank=4, selector_top_k=4, conv_kernel_size=2,
                               conv_group_size=16, confidence_head=True, capture=(1,))
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    save_drafter(str(tmp_path / "src"), dcfg, nnx.split(net, nnx.Param, ...)[1],
                 str(tmp_path / "target"))
    capsys.readouterr()
    assert convert.main(["--to", "dflash", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "path selector and DSpark's confidence head" in err[0], err
    assert not (tmp_path / "out").exists()
