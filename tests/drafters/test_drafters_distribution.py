"""Sampling with a learned drafter is lossless: through the real speculative loop, with a
random-init (scaled, so opinionated) eagle3 and block drafter on a 6-token vocabulary,
the first N_NEW tokens follow the target's exact distribution (float64 enumeration),
under token and block verification (same harness as tests/decoding/test_distribution.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.testing import distribution as du
from tests.decoding.test_distribution import (
    BATCH,
    LEVEL,
    N_NEW,
    PAD,
    PLAIN,
    PROMPT,
    PROMPT_WIDTH,
    _exact,
    _models,
)


@functools.cache
def _learned(kind: str, gamma: int, hot: tuple[int, ...] | None = None, stop: float = 0.0,
             selector: tuple[int, int] | None = None):
    target = _models()[0]
    dcfg = DrafterConfig.for_target(du.CFG, kind, gamma=gamma,
                                    mask_token_id=PAD if kind == "block" else None)
    if selector is not None:  # DFlash2's path selector: (rank, top-K)
        dcfg = dataclasses.replace(dcfg, selector_rank=selector[0], selector_top_k=selector[1])
    net = build_network(dcfg, rngs=nnx.Rngs(7))
    state = nnx.state(net, nnx.Param)
    nnx.update(net, jax.tree.map(lambda x: x * 25.0 if x.ndim >= 2 and x.shape[-1] != x.shape[-2]
                                 else x, state))
    if selector is not None:  # its successor codebook starts at 0: give it an opinion
        net.sel_succ.set_value(jax.random.normal(jax.random.key(5), net.sel_succ.shape) * 2.0)
    return make_drafter(dcfg, net, target, gamma=gamma, sampling=PLAIN, draft_vocab=hot,
                        stop_below=stop)


def _tokens(kind, verify, gamma, hot=None, stop=0.0, selector=None):
    _, _, graphdef, params = _models()
    drafter, dparams = _learned(kind, gamma, hot, stop, selector)
    lc = LoopConfig(max_length=len(PROMPT) + N_NEW, prompt_width=PROMPT_WIDTH, sampling=PLAIN,
                    verify=verify)
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    res = speculative_loop(graphdef, params, drafter, dparams, lc,
                           jnp.asarray(np.tile(prompt, (BATCH, 1))),
                           jnp.full((BATCH,), len(PROMPT), jnp.int32),
                           jnp.full((BATCH,), N_NEW, jnp.int32), jax.random.key(0))
    Tp = len(PROMPT)
    assert (np.asarray(res.lengths) == Tp + N_NEW).all()
    return np.asarray(res.tokens)[:, Tp:Tp + N_NEW], np.asarray(res.accepted)


def _assert_lossless(tokens, accepted, label):
    exact = _exact(PLAIN)
    emp = du.empirical_pmf(tokens)
    stat, thresh = du.tv(emp, exact), du.tv_null_quantile(exact, len(tokens), LEVEL)
    print(f"\n[{label}]: TV={stat:.4f} thresh={thresh:.4f}")
    assert (emp[exact == 0] == 0).all()
    assert stat < thresh, (stat, thresh)
    # Meaningful only if drafts are both accepted and rejected.
    assert 0.05 < accepted[:, 0].mean() < 0.95


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_learned_drafter_sampling_is_lossless(kind, verify):
    _assert_lossless(*_tokens(kind, verify, 2), f"learned {kind} {verify}")


@pytest.mark.parametrize("kind", ["eagle3", "block"])
def test_hot_draft_vocabulary_sampling_is_lossless(kind):
    """A hot draft vocabulary (4 of the 6 ids; q is 0 on the other two) leaves the output
    distribution exactly the target's: ids outside the set come from the residual."""
    _assert_lossless(*_tokens(kind, "block", 2, hot=(0, 2, 3, 5)), f"hot vocab {kind}")


@pytest.mark.parametrize("verify", ["token", "block"])
def test_early_stop_sampling_is_lossless(verify):
    """--draft-stop: the fillers after an early stop (one-hot q) keep the output
    distribution exactly the target's, for token and block verification."""
    _assert_lossless(*_tokens("eagle3", verify, 3, stop=0.8), f"early stop {verify}")


@pytest.mark.parametrize("verify", ["token", "block"])
def test_path_selector_sampling_is_lossless(verify):
    """DFlash2's path selector (rank 4 over the top-3 of 6 ids): each draft's q is the
    selector's distribution given the token drafted before it, so the output follows the
    target's exact distribution."""
    _assert_lossless(*_tokens("block", verify, 3, selector=(4, 3)), f"selector {verify}")


def test_path_selector_over_a_hot_vocabulary_is_lossless():
    """The selector over a hot draft vocabulary (4 of 6 ids; its candidates are the top-3
    of the hot ids, mapped back to the target's): still the target's exact distribution."""
    _assert_lossless(*_tokens("block", "token", 3, hot=(0, 2, 3, 5), selector=(4, 3)),
                     "selector hot vocab")


def test_path_selector_with_the_unconditioned_q_fails(monkeypatch):
    """Power check: reporting the block's own distribution as q (not the selector's, which
    the drafts were drawn from) must be caught by the same test."""
    from specjax.core.sampling import filtered_probs
    from specjax.drafters import selector

    real = selector.draft_chain

    def wrong(pred, succ, proj, top_k, h, logits, first, key, sampling, constraint=None):
        draft, _ = real(pred, succ, proj, top_k, h, logits, first, key, sampling, constraint)
        return draft, filtered_probs(logits, sampling)

    monkeypatch.setattr(selector, "draft_chain", wrong)
    with pytest.raises(AssertionError):
        _assert_lossless(*_tokens("block", "token", 3, selector=(5, 3)), "selector wrong q")
