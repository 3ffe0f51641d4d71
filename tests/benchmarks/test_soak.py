"""Smoke test of benchmarks/soak.py on a tiny random target: 20 prompts in 2 shapes compile
each decoding program exactly once, and the checker catches a shape that compiles twice."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import soak
from specjax.core.sampling import SamplingParams
from specjax.decoding.engine import Engine
from specjax.drafters.ngram import NgramDrafter
from specjax.models.model import Transformer
from specjax.testing.tiny import tiny_config

V = 64
EOS = (0,)
BUCKETS = [16, 32]
CFG = tiny_config(V, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                  intermediate_size=64)


@functools.cache
def target():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def prompts(n=20, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, V, rng.integers(3, 31)).tolist() for _ in range(n)]


def ngram_engine(temperature, width, speculative, batch_size=4, max_new_tokens=12):
    """soak's make_engine for the tiny random target (no checkpoint directory for a
    session: the engines are built by hand, as a session would build them)."""
    sampling = SamplingParams(temperature=temperature)
    drafter = NgramDrafter(3, V, sampling=sampling) if speculative else None
    return Engine(target(), drafter=drafter, drafter_params=() if speculative else None,
                  sampling=sampling, max_length=width + max_new_tokens, prompt_width=width,
                  batch_size=batch_size, eos_token_ids=EOS)


def run(**kw):
    args = dict(vocab_size=V, buckets=BUCKETS, batch_size=4, max_new_tokens=12,
                eos_token_ids=EOS, modes={"greedy": 0.0}, ar_every=2, progress=False)
    return soak.soak(ngram_engine, prompts(), **(args | kw))


def test_one_compilation_per_program_and_complete_rows():
    """2 shapes x (speculative + autoregressive) = 4 programs, each compiled once and
    nothing compiled while decoding; every row complete; T=0 rows equal AR rows."""
    res = run()
    assert len(res["shapes"]) == 2 and res["prompts"]["n"] == 20
    comp = res["checks"]["compilations"]
    assert comp["programs"] == 4 and comp["loop_compilations"] == 4, comp
    assert comp["compilations_while_decoding"] == 0 and comp["ok"]
    greedy = res["modes"]["greedy"]
    assert greedy["rows"] == 20 and greedy["complete_rows"] == 20
    assert greedy["ar_check"]["rows"] > 0
    assert greedy["ar_check"]["equal"] == greedy["ar_check"]["rows"]
    assert res["memory"]["after_warmup"]["rss"] > 0 and res["ok"], res["checks"]
    assert "| greedy (T=0) |" in soak.render(res)


def test_a_second_compilation_of_a_shape_fails_the_check(monkeypatch):
    """An engine that loses its executable mid-run (and jax its caches) compiles a shape
    it already had: the loop count exceeds the programs, the decode phase shows a
    compilation, and the run is not ok."""
    original, calls = Engine.run, []

    def run_forgetting_once(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:  # the warm-up run, then the 2nd decode batch
            jax.clear_caches()
            self.compiled = None
        return original(self, *a, **kw)

    monkeypatch.setattr(Engine, "run", run_forgetting_once)
    res = run(buckets=[32], ar_every=0)  # one program, so the shape is certainly a repeat
    comp = res["checks"]["compilations"]
    assert comp["programs"] == 1 and comp["loop_compilations"] == 2, comp
    assert "jit(speculative_loop)" in comp["late_names"]
    assert not comp["ok"] and not res["ok"]


@pytest.mark.parametrize("ids, problem", [
    ([5, 6, 0], None),  # cut at EOS
    ([0], None),
    ([5, 6, 7, 8], None),  # the full budget
    ([5, 0, 7], "1 tokens after EOS"),
    ([5, 6], "2 tokens, no EOS, budget 4"),
    ([], "empty"),
    ([5, 6, 7, 8, 9], "5 tokens > budget 4"),
    ([5, V], "id outside the vocabulary"),
])
def test_row_problem(ids, problem):
    assert soak.row_problem(ids, 4, EOS, V) == problem


def test_plan_batches_buckets_and_covers_every_prompt():
    ps = prompts(50, seed=1)
    plan = soak.plan_batches(ps, BUCKETS, 4, seed=0)
    assert sorted(i for _, idx in plan for i in idx) == list(range(50))
    for width, idx in plan:
        assert 1 <= len(idx) <= 4
        assert all(len(ps[i]) <= width for i in idx)
        assert width == 32 or all(len(ps[i]) <= 16 for i in idx)
    with pytest.raises(ValueError, match="largest bucket"):
        soak.plan_batches([[1] * 40], BUCKETS, 4, seed=0)
