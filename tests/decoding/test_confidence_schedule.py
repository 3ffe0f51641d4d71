"""Verification scheduled by the drafter's confidence (`GammaSchedule(confidence=True)`,
issue 52 section 3): a block drafter drafts its whole block, then each step's verify length
is chosen from its confidence in those drafts. The choice reads nothing of the target, so
greedy output equals autoregressive decoding and sampled output follows the target's
exact distribution (float64 enumeration), under the "auto" rule and a random one.

The confidence here is a test-only head: the draft distribution's probability of each
drafted token (`ConfidentBlock`); DSpark's trained head plugs in the same way."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.adaptive import GammaSchedule
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.drafters.block import BlockDrafter
from specjax.testing import distribution as du
from tests.decoding.test_distribution import BATCH, N_NEW, PAD, PLAIN, PROMPT, PROMPT_WIDTH
from tests.drafters.test_drafters_distribution import _assert_lossless, _learned, _models

pytestmark = pytest.mark.timeout(600)


@dataclasses.dataclass(frozen=True)
class ConfidentBlock(BlockDrafter):
    """A block drafter whose confidence in draft k is q_k(x_k) (test only)."""

    has_confidence = True  # not a field: the protocol flag

    def confidence(self, params, state, view, draft):
        q = jax.nn.softmax(self.block_logits(params, state, view), axis=-1)
        return jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]


def _confident(drafter):
    return ConfidentBlock(**{f.name: getattr(drafter, f.name)
                             for f in dataclasses.fields(drafter)})


def _run(policy: str, verify="block", batch=None, budget=N_NEW, seed=0):
    _, _, graphdef, params = _models()
    drafter, dparams = _learned("block", 3)
    drafter = _confident(drafter)
    sched = GammaSchedule((0, 1, 2, 3), policy=policy, confidence=True)
    lc = LoopConfig(max_length=len(PROMPT) + budget, prompt_width=PROMPT_WIDTH,
                    sampling=PLAIN, verify=verify, schedule=sched)
    batch = batch or BATCH
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    res = speculative_loop(graphdef, params, drafter, dparams, lc,
                           jnp.asarray(np.tile(prompt, (batch, 1))),
                           jnp.full((batch,), len(PROMPT), jnp.int32),
                           jnp.full((batch,), budget, jnp.int32), jax.random.key(seed))
    Tp = len(PROMPT)
    assert (np.asarray(res.lengths) == Tp + budget).all()
    return res, np.asarray(res.tokens)[:, Tp:Tp + budget], np.asarray(res.accepted)


@pytest.mark.parametrize("policy,verify", [("auto", "token"), ("random", "block")])
def test_confidence_schedule_sampling_is_lossless(policy, verify):
    res, tokens, accepted = _run(policy, verify)
    chosen = np.asarray(res.ext["adaptive"]["chosen"])
    assert chosen[1:].sum() > 0  # it speculated
    _assert_lossless(tokens, accepted, f"confidence {policy} {verify}")


def test_confidence_picks_the_verify_length_from_the_drafts():
    """The auto rule with unit costs picks the longest verify length whenever any draft
    is trusted; with costs that grow steeply in g it picks shorter ones: the choice
    follows the confidence and the cost table, not the fixed G."""
    from specjax.decoding.adaptive import policy as pol

    conf = jnp.asarray([[0.9, 0.9, 0.9], [0.9, 0.1, 0.1]], jnp.float32)
    flat = pol.finish_time(conf, (1, 2, 3), jnp.ones(3), jnp.ones(2, bool),
                           jnp.full((2,), 10, jnp.int32))
    assert int(jnp.argmin(flat)) == 2
    steep = pol.finish_time(conf[1:], (1, 2, 3), jnp.asarray([1.0, 1.9, 2.8]),
                            jnp.ones(1, bool), jnp.full((1,), 10, jnp.int32))
    assert int(jnp.argmin(steep)) == 0


def test_confidence_schedule_greedy_equals_autoregressive():
    from specjax.core.sampling import SamplingParams
    from specjax.decoding.loop import autoregressive_loop

    _, _, graphdef, params = _models()
    drafter, dparams = _learned("block", 3)
    greedy = dataclasses.replace(_confident(drafter), sampling=SamplingParams())
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    args = (jnp.asarray(np.tile(prompt, (4, 1))), jnp.full((4,), len(PROMPT), jnp.int32),
            jnp.asarray([3, 7, 12, 16], jnp.int32), jax.random.key(0))
    for policy in ("auto", "random"):
        lc = LoopConfig(max_length=len(PROMPT) + 16, prompt_width=PROMPT_WIDTH,
                        schedule=GammaSchedule((0, 1, 2, 3), policy=policy, confidence=True))
        sp = speculative_loop(graphdef, params, greedy, dparams, lc, *args)
        ar = autoregressive_loop(graphdef, params, dataclasses.replace(lc, schedule=None),
                                 *args)
        lengths = np.asarray(ar.lengths)
        np.testing.assert_array_equal(np.asarray(sp.lengths), lengths)
        for b, n in enumerate(lengths):
            assert np.asarray(sp.tokens)[b, :n].tolist() == np.asarray(ar.tokens)[b, :n].tolist()
        assert np.asarray(sp.ext["adaptive"]["chosen"])[1:].sum() > 0  # it speculated


def test_confidence_schedule_needs_a_confidence_head():
    _, _, graphdef, params = _models()
    drafter, dparams = _learned("block", 3)
    lc = LoopConfig(max_length=len(PROMPT) + 4, prompt_width=PROMPT_WIDTH, sampling=PLAIN,
                    schedule=GammaSchedule((0, 1, 3), confidence=True))
    prompt = jnp.asarray(np.tile(np.full((PROMPT_WIDTH,), PAD, np.int32), (1, 1)))
    with pytest.raises(ValueError, match="confidence head"):
        speculative_loop(graphdef, params, drafter, dparams, lc, prompt,
                         jnp.full((1,), 2, jnp.int32), jnp.full((1,), 4, jnp.int32),
                         jax.random.key(0))




@pytest.mark.parametrize("heads", ["dspark", "selector"])
def test_dspark_head_under_the_confidence_schedule_equals_autoregressive(heads):
    """A DSpark-style block drafter (anchor slot drafting, a Markov head, its trained-style
    confidence head: `BlockDrafter.confidence`), and a DFlash2 path-selector drafter with a
    confidence head, under `--gamma auto`'s confidence schedule: greedy output equals
    autoregressive decoding."""
    from flax import nnx

    from specjax.core.sampling import SamplingParams
    from specjax.decoding.loop import autoregressive_loop
    from specjax.drafters import DrafterConfig, build_network, make_drafter

    target, _, graphdef, params = _models()
    base = DrafterConfig.for_target(du.CFG, "block", gamma=3, mask_token_id=PAD)
    dcfg = (dataclasses.replace(base, markov_rank=4, confidence_head=True,
                                confidence_head_with_markov=True, sample_from_anchor=True)
            if heads == "dspark" else
            dataclasses.replace(base, selector_rank=4, selector_top_k=3, confidence_head=True))
    net = build_network(dcfg, rngs=nnx.Rngs(3))
    drafter, dparams = make_drafter(dcfg, net, target, gamma=3, sampling=SamplingParams())
    assert drafter.has_confidence
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    args = (jnp.asarray(np.tile(prompt, (3, 1))), jnp.full((3,), len(PROMPT), jnp.int32),
            jnp.asarray([5, 11, 16], jnp.int32), jax.random.key(0))
    lc = LoopConfig(max_length=len(PROMPT) + 16, prompt_width=PROMPT_WIDTH,
                    schedule=GammaSchedule((0, 1, 2, 3), confidence=True))
    sp = speculative_loop(graphdef, params, drafter, dparams, lc, *args)
    ar = autoregressive_loop(graphdef, params, dataclasses.replace(lc, schedule=None), *args)
    lengths = np.asarray(ar.lengths)
    np.testing.assert_array_equal(np.asarray(sp.lengths), lengths)
    for b, n in enumerate(lengths):
        assert np.asarray(sp.tokens)[b, :n].tolist() == np.asarray(ar.tokens)[b, :n].tolist()
