"""Learned drafters (eagle3, kv, hybrid, block) in the real loop: greedy output equals
autoregressive decoding token for token, for every kind, G in {1, 3, 5}, ragged budgets
and EOS; random-init drafters are enough for identity (the verifier decides)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.generate import LoopConfig, speculative_loop
from tests.test_speculative_greedy import (
    BUDGETS,
    PROMPT_LENS,
    TP,
    models,
    prompts,
    rows,
    run_ar,
)

KINDS = [("eagle3", None), ("kv", None), ("hybrid", None), ("block", "hidden"),
         ("block", "kv"), ("block", "both")]


@functools.cache
def drafter_net(kind, context, seed=0):
    target, _ = models()
    dcfg = DrafterConfig.for_target(target.cfg, kind, context=context, gamma=3,
                                    mask_token_id=1 if kind == "block" else None)
    return dcfg, build_network(dcfg, rngs=nnx.Rngs(seed))


def run_learned(kind, context, G, budgets, eos=(), verify="block"):
    target, _ = models()
    dcfg, net = drafter_net(kind, context)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G)
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, eos_token_ids=eos, verify=verify)
    toks, lens = prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


@pytest.mark.parametrize("G", [1, 3, 5])
@pytest.mark.parametrize("kind,context", KINDS)
def test_greedy_equals_autoregressive(kind, context, G):
    sp = run_learned(kind, context, G, BUDGETS)
    assert rows(sp) == rows(run_ar(BUDGETS))
    lens = np.asarray(sp.lengths) - PROMPT_LENS
    assert lens.tolist() == BUDGETS
