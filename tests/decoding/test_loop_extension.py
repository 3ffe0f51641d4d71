"""A fifth loop mode is one module and one config field (issue 51): a test-only extension
that counts the tokens each row feeds to the target's verify forwards plugs into the one
loop through `specjax.decoding.loop.extension`, with nothing in the loop naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding.adaptive import GammaSchedule
from specjax.decoding.loop import LoopConfig, LoopExtension, extension_field, speculative_loop
from specjax.decoding.partial import PartialVerify
from tests.decoding import test_speculative_greedy as sg

G = 3
BUDGETS = [12, 9, 0, 14]


@dataclasses.dataclass(frozen=True)
class CountFed(LoopExtension):
    """Counts, per row, the tokens fed to verify forwards while the row was active, and
    runs the target's forward as the loop would (`replaces_forward`)."""

    name = "count_fed"

    def init(self, model, cfg, drafter, state, inputs):
        return jnp.zeros_like(state.lengths)

    def report(self, ext_state):
        return {"fed": ext_state}

    replaces_forward = True

    def verify_forward(self, model, ext_state, s, chain, positions, capture, attention):
        out = model(chain, positions, s.cache, capture=capture, attention=attention)
        fed = ext_state + jnp.where(s.done, 0, chain.shape[1])
        return out.logits, out.hidden, out.cache, fed


@dataclasses.dataclass(frozen=True)
class CountingConfig(LoopConfig):
    count_fed: Any = extension_field()  # the mode's one config field


def _run(cfg):
    target, _ = sg.models()
    drafter, dparams = sg.make_drafter("draft_lm", G)
    g, p = nnx.split(target)
    toks, lens = sg.prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0))


def test_a_test_only_mode_plugs_in_and_changes_nothing_else():
    plain = _run(LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP))
    cfg = CountingConfig(max_length=sg.TP + 24, prompt_width=sg.TP, count_fed=CountFed())
    assert [type(e) for e in cfg.extensions()] == [CountFed]
    counted = _run(cfg)
    assert sg.rows(counted) == sg.rows(plain) == sg.rows(sg.run_ar(BUDGETS))
    fed = np.asarray(counted.ext["count_fed"]["fed"])
    # independent count: every step of an active row feeds its pending token and G drafts
    np.testing.assert_array_equal(fed, np.asarray(plain.steps) * (G + 1))
    assert fed[2] == 0 and fed.sum() > 0  # the padding row fed nothing
    assert "count_fed" not in plain.ext


def test_modes_that_refuse_each_other_say_so():
    with pytest.raises(ValueError, match="schedule None"):
        LoopConfig(max_length=8, prompt_width=4, schedule=GammaSchedule((0, 2)),
                   partial=PartialVerify())
    with pytest.raises(ValueError, match="num_drafts must be 1"):
        LoopConfig(max_length=8, prompt_width=4, schedule=GammaSchedule((0, 2)), num_drafts=2)
