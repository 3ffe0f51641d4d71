"""`--gamma auto` per batch: an adaptive engine runs a batch with its autoregressive
program when `adaptive.speculation_pays` predicts that speculation would not finish it
sooner (the drafter's prefill and the loop's autoregressive branch cost more than the
autoregressive program; docs/adaptive.md)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from specjax.decoding import adaptive
from specjax.decoding.adaptive.controller import AdaptiveEngine, make_engine
from specjax.decoding.engine import Engine, Stats
from specjax.errors import SpecjaxError
from tests.decoding.test_speculative_greedy import TP, models, prompts
from tests.decoding.test_speculative_greedy import make_drafter as simple_drafter

CHOICES = (0, 1, 2, 3)


@pytest.mark.parametrize("rows,alpha,g", [(1, 0.7, 3), (8, 0.8, 2), (32, 0.6, 1)])
def test_predicted_ms_against_simulation(rows, alpha, g):
    """The speculative prediction, with the table making g the only affordable length,
    against a Monte Carlo simulation in numpy of `rows` rows each needing `budget` tokens
    (the batch runs until its slowest row): prefill + cost x E[max steps], within 6%; the
    autoregressive prediction is prefill + step x budget exactly."""
    budget, trials = 96, 400
    rng = np.random.default_rng(rows * 10 + g)
    acc = rng.random((trials, rows, budget, g)) < alpha
    tokens = 1 + np.argmin(np.concatenate([acc, np.zeros((trials, rows, budget, 1), bool)],
                                          -1), -1)
    steps = np.argmax(np.cumsum(tokens, axis=2) >= budget, axis=2) + 1  # [trials, rows]
    costs = np.full(len(CHOICES), 1e9)
    costs[CHOICES.index(g)] = 3.0
    base = adaptive.Baseline(prefill_ms=50.0, ar_prefill_ms=40.0, ar_ms_per_step=2.0)
    spec, ar = adaptive.predicted_ms([alpha] * 3, CHOICES, costs, base, budget, rows)
    sim = 50.0 + 3.0 * steps.max(axis=1).mean()
    assert abs(spec - sim) / sim < 0.06, (spec, sim)
    assert ar == 40.0 + 2.0 * budget


def test_speculation_pays_decides_by_the_prediction():
    costs = [10.0, 11.0, 12.0, 13.0]
    sure = [0.95] * 3
    cheap_ar = adaptive.Baseline(prefill_ms=100.0, ar_prefill_ms=100.0, ar_ms_per_step=2.0)
    dear_ar = adaptive.Baseline(prefill_ms=100.0, ar_prefill_ms=100.0, ar_ms_per_step=10.0)
    assert not adaptive.speculation_pays(sure, CHOICES, costs, cheap_ar, 64, 1)
    assert adaptive.speculation_pays(sure, CHOICES, costs, dear_ar, 64, 1)
    # nothing accepted: the loop's best is its own AR branch at 10 ms, a tie -> AR program
    assert not adaptive.speculation_pays([0.0] * 3, CHOICES, costs, dear_ar, 64, 1)
    # the drafter's prefill alone can tip it
    dear_prefill = adaptive.Baseline(prefill_ms=10_000.0, ar_prefill_ms=100.0,
                                     ar_ms_per_step=10.0)
    assert not adaptive.speculation_pays(sure, CHOICES, costs, dear_prefill, 64, 1)


def test_margin_needs_a_clear_predicted_gain():
    """With a margin, speculation must be predicted to win by more than that fraction of
    the autoregressive prediction; the same batch without it speculates."""
    costs = [10.0, 11.0, 12.0, 13.0]
    sure = [0.95] * 3
    base = adaptive.Baseline(prefill_ms=100.0, ar_prefill_ms=100.0, ar_ms_per_step=10.0)
    spec, ar = adaptive.predicted_ms(sure, CHOICES, costs, base, 64, 1)
    gain = 1.0 - spec / ar  # the predicted fraction saved, from the prediction itself
    assert 0 < gain < 0.99
    below = dataclasses.replace(base, margin=gain * 0.9)
    above = dataclasses.replace(base, margin=gain * 1.1)
    assert adaptive.speculation_pays(sure, CHOICES, costs, below, 64, 1)
    assert not adaptive.speculation_pays(sure, CHOICES, costs, above, 64, 1)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="margin"):
            dataclasses.replace(base, margin=bad)


def test_measured_margin_is_the_clamped_spread():
    lo, hi = adaptive.MARGIN_RANGE
    assert adaptive.measured_margin([2.0, 2.2, 2.1]) == pytest.approx(0.1)
    assert adaptive.measured_margin([2.0, 2.0]) == lo
    assert adaptive.measured_margin([2.0]) == lo  # one run: no spread seen
    assert adaptive.measured_margin([1.0, 3.0]) == hi
    for bad in ([0.0, 1.0], [], [-1.0]):
        with pytest.raises(ValueError):
            adaptive.measured_margin(bad)


def test_baseline_in_the_table_file(tmp_path):
    path = tmp_path / "costs.json"
    adaptive.write_table(str(path), CHOICES, [1.0, 2.0, 3.0, 4.0], {})
    assert adaptive.read_baseline(str(path)) is None  # old and hand-written tables
    base = adaptive.Baseline(prefill_ms=5.0, ar_prefill_ms=4.0, ar_ms_per_step=1.5)
    adaptive.write_table(str(path), CHOICES, [1.0, 2.0, 3.0, 4.0], {"x": 1}, baseline=base)
    assert adaptive.read_baseline(str(path)) == base
    assert adaptive.read_table(str(path), CHOICES) == [1.0, 2.0, 3.0, 4.0]
    with_margin = dataclasses.replace(base, margin=0.07)
    adaptive.write_table(str(path), CHOICES, [1.0, 2.0, 3.0, 4.0], {}, baseline=with_margin)
    assert adaptive.read_baseline(str(path)) == with_margin
    ok = {"prefill_ms": 1, "ar_prefill_ms": 1, "ar_ms_per_step": 1}
    for bad in ({"prefill_ms": 1.0}, {"prefill_ms": 1, "ar_prefill_ms": 1, "ar_ms_per_step": -1},
                {"prefill_ms": 1, "ar_prefill_ms": True, "ar_ms_per_step": 1}, [1, 2],
                {**ok, "margin": 1.5}, {**ok, "margin": "0.1"}):
        path.write_text(json.dumps({"ms_per_step": {"0": 1}, "baseline": bad}))
        with pytest.raises(SpecjaxError, match="baseline"):
            adaptive.read_baseline(str(path))
    with pytest.raises(ValueError):
        adaptive.Baseline(prefill_ms=float("nan"), ar_prefill_ms=1.0, ar_ms_per_step=1.0)


def test_acceptance_in_the_table_file(tmp_path):
    """The table's optional "alpha" (what calibrate observed) reads back as written; a
    table without one reads None (the prior), and a malformed one is a one-line error."""
    path = tmp_path / "costs.json"
    adaptive.write_table(str(path), CHOICES, [1.0, 2.0, 3.0, 4.0], {})
    assert adaptive.read_alpha(str(path), 3) is None
    adaptive.write_table(str(path), CHOICES, [1.0, 2.0, 3.0, 4.0], {"alpha": [0.9, 0.5, 0]})
    assert adaptive.read_alpha(str(path), 3) == [0.9, 0.5, 0.0]
    for bad in ([0.9, 0.5], [0.9, 0.5, 1.5], [0.9, 0.5, True], "0.9", [0.9, None, 0.1]):
        path.write_text(json.dumps({"ms_per_step": {"0": 1}, "alpha": bad}))
        with pytest.raises(SpecjaxError, match="alpha needs 3 acceptance rates"):
            adaptive.read_alpha(str(path), 3)


def _engines(temperature=0.0, batch=2, kind="self"):
    from specjax.core.sampling import SamplingParams

    target, _ = models()
    drafter, dparams = simple_drafter(kind, 3)
    common = dict(max_length=TP + 24, prompt_width=TP, batch_size=batch,
                  sampling=SamplingParams(temperature=temperature))
    sched = adaptive.GammaSchedule(CHOICES)
    auto = AdaptiveEngine(target, drafter=drafter, drafter_params=dparams, schedule=sched,
                          costs=[1.0, 1.5, 2.0, 2.5], **common)
    return auto, Engine(target, **common)


def _ids():
    toks, lens = prompts()
    return [np.asarray(toks)[b, :int(lens[b])].tolist() for b in range(2)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fallback_batches_are_the_autoregressive_program(temperature):
    """A baseline that makes speculation not pay sends the batch to the autoregressive
    program: the very output of the AR engine with the same key (greedy and sampled),
    reported as a fallback with nothing drafted, and the carried estimates untouched; a
    baseline that makes it pay runs the speculative loop (greedy-identical)."""
    auto, ar = _engines(temperature)
    ids, key = _ids(), jax.random.key(3)
    want = ar.run(ids, 12, key)
    auto.baseline = adaptive.Baseline(prefill_ms=1e6, ar_prefill_ms=0.0, ar_ms_per_step=0.1)
    assert not auto.speculates(len(ids), 12)
    out = auto.run(ids, 12, key)
    assert out.fallback and out.outputs == want.outputs
    assert out.accepted.shape == (2, 3) and out.accepted.sum() == 0
    assert out.chosen.tolist() == [0, 0, 0, 0] and auto.alpha0 is None
    auto.baseline = adaptive.Baseline(prefill_ms=0.0, ar_prefill_ms=1e6, ar_ms_per_step=1e3)
    spec = auto.run(ids, 12, key)
    assert not spec.fallback and spec.chosen.sum() > 0
    if temperature == 0:
        assert spec.outputs == want.outputs
    st = Stats()
    st.add(out)
    st.add(spec)  # batches of both kinds add up in one Stats
    assert (st.batches, st.fallback_batches) == (2, 1)
    assert st.accepted.shape == (3,)


def _pays_at_prior_not_at(auto, low):
    """Gives `auto` a baseline whose AR program (12 tokens, 2 rows) lies between the
    speculative predictions at the prior and at the estimates `low`: speculation pays at
    the prior, not at `low`."""
    base = adaptive.Baseline(prefill_ms=0.0, ar_prefill_ms=0.0, ar_ms_per_step=1.0)
    prior = [auto.cfg.schedule.prior] * 3
    at_prior, _ = adaptive.predicted_ms(prior, CHOICES, auto.costs, base, 12, 2)
    at_low, _ = adaptive.predicted_ms(low, CHOICES, auto.costs, base, 12, 2)
    assert at_prior < at_low
    auto.baseline = dataclasses.replace(base, ar_ms_per_step=(at_prior + at_low) / 2 / 12)


def test_fallback_drifts_back_to_the_prior_and_probes_again():
    """Estimates below break-even send a batch to the AR program; each such batch moves
    them FALLBACK_DRIFT of the way back to the prior, so that after a few batches the
    engine speculates again (where the prior says it pays) instead of never again."""
    auto, _ = _engines()
    ids, key = _ids(), jax.random.key(3)
    prior = auto.cfg.schedule.prior
    low = np.full(3, 0.05, np.float32)
    _pays_at_prior_not_at(auto, low)
    auto.alpha0 = low.copy()
    assert not auto.speculates(2, 12)
    out = auto.run(ids, 12, key)
    assert out.fallback
    r = adaptive.FALLBACK_DRIFT
    np.testing.assert_allclose(auto.alpha0, low + r * (prior - low), rtol=1e-6)
    fallbacks = 1
    while auto.run(ids, 12, key).fallback:
        fallbacks += 1
        assert fallbacks < 30, "never speculated again"


def test_fallback_drifts_toward_the_calibrated_acceptance():
    """With an acceptance observed by the calibration (`alpha_calibrated`) below
    break-even, fallback batches move the estimates toward it, not toward the optimistic
    prior, so the engine stays with the AR program (drift_to "calibrated", the default;
    "pooled" with nothing pooled yet does the same); `drift_to = "prior"` (the old rule)
    re-opens speculation. A bad drift_to raises."""
    auto, _ = _engines()
    assert auto.drift_to == "calibrated" and auto.pooled is None
    ids, key = _ids(), jax.random.key(3)
    low = np.full(3, 0.05, np.float32)
    _pays_at_prior_not_at(auto, low)
    calibrated = np.asarray([0.1, 0.08, 0.06], np.float32)
    auto.alpha0, auto.alpha_calibrated = low.copy(), calibrated
    r = adaptive.FALLBACK_DRIFT
    want = low.copy()
    for _ in range(12):
        assert auto.run(ids, 12, key).fallback
        want = want + r * (calibrated - want)
        np.testing.assert_allclose(auto.alpha0, want, rtol=1e-5)
    np.testing.assert_allclose(auto.alpha0, calibrated, atol=0.01)
    auto.drift_to = "prior"
    fallbacks = 0
    while auto.run(ids, 12, key).fallback:
        fallbacks += 1
        assert fallbacks < 30, "never speculated again"
    auto.drift_to = "calibrated "
    auto.alpha0 = low.copy()
    with pytest.raises(ValueError, match="drift_to"):
        auto.run(ids, 12, key)


def test_pooled_acceptance_sums_every_drafted_batch():
    """`pooled` sums accepted and reached over every speculative run (fallback runs add
    nothing), and drift_target() is their ratio, the calibrated acceptance where a
    position was never reached; "calibrated" and "prior" ignore it."""
    auto, _ = _engines(kind="draft_lm")
    auto.drift_to = "pooled"
    ids = _ids()
    acc, reached = np.zeros(3), np.zeros(3)
    for seed in range(3):
        out = auto.run(ids, 12, jax.random.key(seed))
        assert not out.fallback
        acc += out.accepted.sum(0)
        reached += out.reached.sum(0)
    np.testing.assert_array_equal(auto.pooled[0], acc)
    np.testing.assert_array_equal(auto.pooled[1], reached)
    calibrated = np.asarray([0.11, 0.22, 0.33], np.float32)
    auto.alpha_calibrated = calibrated
    auto.pooled = (acc, np.where(np.arange(3) == 2, 0.0, reached))  # position 2 unseen
    want = np.where(np.arange(3) == 2, 0.33, acc / np.maximum(reached, 1))
    assert reached[:2].min() > 0
    np.testing.assert_allclose(auto.drift_target(), want, rtol=1e-6)
    auto.drift_to = "calibrated"
    np.testing.assert_array_equal(auto.drift_target(), calibrated)
    auto.drift_to = "prior"
    assert auto.drift_target() == auto.cfg.schedule.prior


def test_calibrate_measures_the_baseline_and_the_fallback_shares_the_weights():
    auto, _ = _engines()
    auto.costs = None
    auto.calibrate(_ids(), 12, jax.random.key(0), repeats=1, baseline=True)
    b = auto.baseline
    assert b.prefill_ms > 0 and b.ar_prefill_ms > 0 and b.ar_ms_per_step > 0
    fb = auto.fallback_engine()
    assert fb.drafter is None and fb.cfg.schedule is None and fb.params is auto.params
    assert fb is auto.fallback_engine()  # compiled once
    plain, _ = _engines()
    plain.costs = None
    plain.calibrate(_ids(), 12, jax.random.key(0), repeats=1, baseline=False)
    assert plain.baseline is None and plain.speculates(2, 12)


def test_make_engine_and_the_engine_without_an_adaptive_branch():
    """make_engine gives an AdaptiveEngine for a schedule with a drafter, a plain Engine
    otherwise (the schedule is ignored without a drafter); the AdaptiveEngine's engine
    carries the schedule in its loop config, and starts from a given alpha0 (also its
    drift target, a copy). The Engine itself knows nothing of adaptive draft length."""
    import inspect

    from specjax.decoding import engine as engine_mod

    target, _ = models()
    drafter, dparams = simple_drafter("self", 3)
    kw = dict(max_length=TP + 24, prompt_width=TP, batch_size=2)
    sched = adaptive.GammaSchedule(CHOICES)
    plain = make_engine(target, drafter=drafter, drafter_params=dparams, **kw)
    assert type(plain) is Engine and plain.cfg.schedule is None
    no_drafter = make_engine(target, schedule=sched, **kw)
    assert type(no_drafter) is Engine and no_drafter.cfg.schedule is None
    auto = make_engine(target, drafter=drafter, drafter_params=dparams, schedule=sched,
                       costs=[1.0, 1.5, 2.0, 2.5], alpha0=[0.5, 0.4, 0.3], **kw)
    assert isinstance(auto, AdaptiveEngine) and auto.engine.cfg.schedule is sched
    assert auto.cfg is auto.engine.cfg and auto.gamma == 3 and auto.batch_size == 2
    np.testing.assert_array_equal(auto.alpha0, np.float32([0.5, 0.4, 0.3]))
    np.testing.assert_array_equal(auto.alpha_calibrated, auto.alpha0)
    assert auto.alpha_calibrated is not auto.alpha0
    with pytest.raises(ValueError, match="needs a drafter"):
        AdaptiveEngine(target, drafter=None, schedule=sched, **kw)
    with pytest.raises(ValueError, match="extension fields"):
        Engine(target, drafter=drafter, drafter_params=dparams, extensions={"nope": 1}, **kw)
    assert "schedule" not in inspect.getsource(engine_mod)
    assert not {"schedule", "costs", "baseline"} & set(inspect.signature(Engine).parameters)


@pytest.mark.parametrize("order", ["rounds", "one after another"])
def test_calibrate_runs_in_rounds_and_subtracts_the_fastest_prefill(order, monkeypatch):
    """With synthetic walls (a prefill of 10 ms plus, at choice i, iters x true_ms[i], one
    slow spell adding 50%), calibrate visits the choices in rounds (or one after another
    with order="one after another"), its measured table is the true one (the fastest wall less the
    fastest prefill, per iteration) and it keeps adaptive.fit_costs of that table."""
    auto, _ = _engines()
    true_ms, iters = [4.0, 6.0, 7.0, 8.0], 5
    calls = []

    def fake(prompts, budget, key, costs=None):
        slow = 1.5 if len(calls) in (3, 4) else 1.0  # the slow spell
        if budget == 1:
            return 0.010 * slow, 0
        i = int(np.argmin(costs))
        calls.append(i)
        return (0.010 + iters * true_ms[i] / 1e3) * slow, iters

    monkeypatch.setattr(auto, "_timed", fake)
    auto.alpha0 = np.full(3, 0.8, np.float32)  # carried: no acceptance run among the fakes
    got = auto.calibrate(_ids(), 12, jax.random.key(0), repeats=3, baseline=False,
                         order=order)
    measured = calls[len(CHOICES):]  # after one warm-up run per choice
    want = ([0, 1, 2, 3] * 3 if order == "rounds"
            else [i for i in range(4) for _ in range(3)])
    assert measured == want
    np.testing.assert_allclose(auto.measured_costs, true_ms, rtol=1e-9)
    np.testing.assert_allclose(got, adaptive.fit_costs(CHOICES, true_ms), rtol=1e-9)
    np.testing.assert_allclose(auto.costs, got, rtol=1e-6)


@pytest.mark.parametrize("order", ["rounds", "ar last", "one after another"])
def test_calibrate_measures_the_autoregressive_program_in_the_same_rounds(order,
                                                                            monkeypatch):
    """With the baseline, the autoregressive program is one more stop of every round
    (after the choices; after all of them with the other orders), each of its runs after
    a prefill run of each program. Synthetic walls: prefills of 10 ms (speculative) and
    8 ms (autoregressive), true steps `true_ms` and 5 ms for the autoregressive program,
    the machine 50% slower for the first 11 measured calls (in rounds: the first round,
    prefills included). In rounds, every stop has fast runs, so table and baseline are
    the truth, and the margin, the spread of the AR wall relative to its round's
    speculative walls, divides the spell out (the clamp's 2%, where the plain spread of
    the AR walls is 50%); "ar last" leaves the spell in the table's first rounds (the
    truth still, from the last round); one stop after another leaves the first choice's
    runs all in it."""
    auto, _ = _engines()
    fb = auto.fallback_engine()
    fb.compile()
    true_ms, iters, ar_ms = [4.0, 6.0, 7.0, 8.0], 5, 5.0
    calls, ar_walls = [], []  # the full runs measured (choice index, or "AR"); AR walls
    n_warm = 1 + len(CHOICES) + 1  # warm-ups: one prefill, each choice, the AR program
    slow_calls = n_warm + 2 * len(CHOICES) + 3  # a round: 2 calls per choice, 3 for AR
    seen = [0]

    def clock(t):
        seen[0] += 1
        return t * (1.5 if n_warm < seen[0] <= slow_calls else 1.0)

    def fake(prompts, budget, key, costs=None):
        if budget == 1:
            return clock(0.010), 0
        i = int(np.argmin(costs))
        calls.append(i)
        return clock(0.010 + iters * true_ms[i] / 1e3), iters

    def fake_ar(prompts, budget, key, inputs=None):
        if budget == 1:
            return clock(0.008), 0
        calls.append("AR")
        ar_walls.append(clock(0.008 + budget * ar_ms / 1e3))
        return ar_walls[-1], budget

    monkeypatch.setattr(auto, "_timed", fake)
    monkeypatch.setattr(fb, "timed", fake_ar)
    auto.alpha0 = np.full(3, 0.8, np.float32)  # carried: no acceptance run among the fakes
    auto.calibrate(_ids(), 12, jax.random.key(0), repeats=3, order=order, baseline=True)
    measured = calls[len(CHOICES) + 1:]  # after the warm-ups
    stops = [0, 1, 2, 3, "AR"]
    want = {"rounds": stops * 3, "ar last": stops[:-1] * 3 + ["AR"] * 3,
            "one after another": [i for i in stops for _ in range(3)]}[order]
    assert measured == want
    b = auto.baseline
    np.testing.assert_allclose([b.prefill_ms, b.ar_prefill_ms], [10.0, 8.0], rtol=1e-9)
    np.testing.assert_allclose(b.ar_ms_per_step, ar_ms, rtol=1e-9)
    if order == "one after another":  # the first choice's three runs were all slow
        assert auto.measured_costs[0] > 1.4 * true_ms[0]
    else:
        np.testing.assert_allclose(auto.measured_costs, true_ms, rtol=1e-9)
    assert b.margin == pytest.approx(adaptive.MARGIN_RANGE[0])  # the spell divided out
    if order == "rounds":  # where the AR walls themselves spread by the spell's 50%
        assert max(ar_walls[1:]) / min(ar_walls[1:]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="order"):
        auto.calibrate(_ids(), 12, jax.random.key(0), order="random")


def test_calibrate_adds_rounds_while_they_fit_in_its_seconds(monkeypatch):
    """After `repeats` rounds, calibrate adds rounds while one more, at the mean duration of
    the rounds so far, fits in `seconds` of measuring, up to `max_repeats`; it records the
    rounds run and one ratio per round. A fake clock advances 0.1 s per run, so a round
    (each choice's prefill and run, then two prefills and the AR run) takes 1.1 s."""
    from specjax.decoding.adaptive import controller

    auto, _ = _engines()
    fb = auto.fallback_engine()
    fb.compile()
    clock = [0.0]
    monkeypatch.setattr(controller, "time", type("Clock", (), {
        "perf_counter": staticmethod(lambda: clock[0])}))

    def fake(prompts, budget, key, costs=None):
        clock[0] += 0.1
        if budget == 1:
            return 0.010, 0
        return 0.010 + 5 * (1 + int(np.argmin(costs))) / 1e3, 5

    def fake_ar(prompts, budget, key, inputs=None):
        clock[0] += 0.1
        return (0.008, 0) if budget == 1 else (0.008 + 5 * budget / 1e3, budget)

    monkeypatch.setattr(auto, "_timed", fake)
    monkeypatch.setattr(fb, "timed", fake_ar)
    auto.alpha0 = np.full(3, 0.8, np.float32)
    for seconds, max_repeats, want in [(0.0, 12, 3), (5.0, 12, 4), (6.0, 12, 5),
                                       (100.0, 7, 7), (100.0, 3, 3)]:
        auto.calibrate(_ids(), 12, jax.random.key(0), repeats=3, seconds=seconds,
                       max_repeats=max_repeats)
        assert auto.calibration_rounds == want, (seconds, max_repeats)
        assert len(auto.calibration_relative) == want
    for bad in (dict(seconds=-1.0), dict(repeats=3, max_repeats=2)):
        with pytest.raises(ValueError, match="max_repeats"):
            auto.calibrate(_ids(), 12, jax.random.key(0), **bad)


def test_t_bound_margin_against_numpy():
    """exp(t sd(log w) / sqrt(n)) - 1 in float64 numpy, t Student's 97.5% quantile from a
    printed table (2.776 at 4 degrees of freedom, 2.201 at 11, 4.303 at 2), clamped like
    the range margin; it shrinks as walls of the same spread are added, where the range
    does not."""
    from benchmarks.adaptive import t_bound_margin

    lo, hi = adaptive.MARGIN_RANGE
    w = [1.0, 1.08, 1.03, 0.97, 1.05]

    def want(walls, t):
        return np.expm1(t * np.std(np.log(walls), ddof=1) / np.sqrt(len(walls)))

    assert t_bound_margin(w) == pytest.approx(want(w, 2.776), rel=2e-4)
    w12 = [1.0, 1.06, 1.03, 0.97, 1.09, 1.0, 0.94, 1.03, 1.06, 1.0, 0.97, 1.09]
    assert t_bound_margin(w12) == pytest.approx(want(w12, 2.201), rel=2e-4)
    w3 = [1.0, 1.01, 1.02]
    assert t_bound_margin(w3) == pytest.approx(want(w3, 4.303), rel=2e-4)
    assert t_bound_margin(w * 4) < t_bound_margin(w)
    assert adaptive.measured_margin(w * 4) == adaptive.measured_margin(w)
    assert t_bound_margin([2.0]) == lo
    assert t_bound_margin([2.0, 2.0]) == lo
    assert t_bound_margin([1.0, 3.0]) == hi
    for bad in ([], [1.0, 0.0], [-1.0, 2.0]):
        with pytest.raises(ValueError, match="positive"):
            t_bound_margin(bad)


def test_calibrate_seeds_the_estimates_with_the_batchs_acceptance():
    """Without carried estimates, calibrate sets alpha0 to the first batch's pooled
    per-position acceptance at the longest draft (sum accepted / sum reached of an
    independent run of that forced table, the prior where a position is never reached);
    carried estimates are left alone, and so is the table's measurement."""
    auto, _ = _engines(kind="draft_lm")
    ids, key = _ids(), jax.random.key(0)
    auto.costs = np.where(np.asarray(CHOICES) == max(CHOICES), 1.0, 1e30)
    out = auto.run(ids, 12, key)  # the forced run, as calibrate's warm-up runs it
    acc, reached = out.accepted.sum(0), out.reached.sum(0)
    assert reached[0] > 0 and 0 < acc[0] < reached[0]  # a drafter that is sometimes wrong
    want = np.where(reached > 0, acc / np.maximum(reached, 1), adaptive.GammaSchedule.prior)
    auto.reset_schedule()
    auto.calibrate(ids, 12, key, repeats=1, baseline=False)
    np.testing.assert_allclose(auto.alpha0, want, rtol=1e-6)
    # the fallback's drift target: a copy, not the estimates that later runs move
    np.testing.assert_allclose(auto.alpha_calibrated, want, rtol=1e-6)
    assert auto.alpha_calibrated is not auto.alpha0
    np.testing.assert_array_equal(auto.pooled[0], acc)  # pooled starts from that run
    np.testing.assert_array_equal(auto.pooled[1], reached)
    carried = np.asarray([0.3, 0.2, 0.1], np.float32)
    auto.alpha0 = carried.copy()
    auto.calibrate(ids, 12, key, repeats=1, baseline=False)
    np.testing.assert_array_equal(auto.alpha0, carried)


def test_decode_reports_autoregressive_batches(tmp_path, capsys):
    """decode.py --gamma auto with a table whose baseline makes speculation not pay: every
    batch runs autoregressively, the output is identical to AR, and the summary says so."""
    import decode

    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x\n"})
                                    + "\n" for i in range(2)))
    table = tmp_path / "costs.json"
    adaptive.write_table(str(table), (0, 1, 2, 3, 4), [1.0, 2.0, 3.0, 4.0, 5.0], {},
                         baseline=adaptive.Baseline(prefill_ms=1e6, ar_prefill_ms=1.0,
                                                    ar_ms_per_step=1.0))
    summary = tmp_path / "s.json"
    assert decode.main(["--drafter", "ngram", "--gamma", "auto", "--prompts",
                        str(prompts_file), "--max-new-tokens", "8", "--show", "0",
                        "--compile-cache", "none", "--cost-table", str(table),
                        "--summary", str(summary)]) == 0
    s = json.loads(summary.read_text())
    sched = s["gamma_schedule"]
    assert s["ar_identical"] is True
    assert sched["autoregressive_batches"] == sched["batches"] == 2
    assert sched["baseline"]["prefill_ms"] == 1e6
    out = capsys.readouterr().out
    assert "autoregressive batches" in out and f"read from {table}" in out
    table.write_text(json.dumps({"ms_per_step": {str(g): 1.0 for g in range(5)},
                                 "baseline": {"prefill_ms": 1}}))
    assert decode.main(["--drafter", "ngram", "--gamma", "auto", "--prompts",
                        str(prompts_file), "--show", "0", "--compile-cache", "none",
                        "--cost-table", str(table)]) == 2
    assert "baseline" in capsys.readouterr().err


def test_decode_does_not_cache_a_noisy_calibration(tmp_path, capsys, monkeypatch):
    """A table calibrated while its repeated runs spread more than adaptive.NOISY_SPREAD
    (a busy machine) serves its own run but is not cached at the default place, so the
    next run measures again; a quiet calibration is cached with the time it was measured.
    (The threshold is moved, not the machine: the spread itself is tested below.)"""
    import decode

    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "def f(x):\n    return x\n"}) + "\n")
    cached = tmp_path / "specjax-costs" / "key.json"
    from specjax.decoding import engines

    monkeypatch.setattr(engines, "default_cost_table", lambda *a, **k: str(cached))
    argv = ["--drafter", "ngram", "--gamma", "auto", "--prompts", str(prompts_file),
            "--max-new-tokens", "6", "--show", "0", "--compile-cache", "none"]
    monkeypatch.setattr(adaptive, "NOISY_SPREAD", -1.0)  # every spread counts as noisy
    summary = tmp_path / "noisy.json"
    assert decode.main([*argv, "--summary", str(summary)]) == 0
    err = capsys.readouterr().err
    assert "used for this run only, not cached" in err and not cached.exists()
    sched = json.loads(summary.read_text())["gamma_schedule"]
    assert sched["cost_table"] is None and sched["calibration_s"] is not None
    assert sched["calibration_relative"]  # the rounds whose spread was judged
    monkeypatch.setattr(adaptive, "NOISY_SPREAD", float("inf"))
    assert decode.main(argv) == 0
    assert "not cached" not in capsys.readouterr().err
    meta = json.loads(cached.read_text())
    assert meta["measured_at"].endswith("UTC") and meta["calibration_relative"]


def test_calibration_spread():
    """adaptive.calibration_spread: max / min - 1, unclamped (measured_margin clamps)."""
    assert adaptive.calibration_spread([1.0, 1.8, 1.2]) == pytest.approx(0.8)
    assert adaptive.measured_margin([1.0, 1.8, 1.2]) == adaptive.MARGIN_RANGE[1]
    assert adaptive.calibration_spread([0.7]) == 0.0 == adaptive.calibration_spread([])
    with pytest.raises(ValueError, match="positive"):
        adaptive.calibration_spread([1.0, 0.0])


def test_cost_table_key_follows_the_weights_not_the_prompt_length(tiny_demo, tmp_path):
    """The cached table's key (issue 53): a drafter retrained into the same directory gets a
    new table (the stored acceptance was its predecessor's); prompt sets whose max_length
    falls in one `length_bucket` share one; another batch size does not."""
    import types

    from safetensors.numpy import load_file, save_file

    from specjax import DecodeConfig
    from specjax.decoding import engines
    from specjax.models.config import ModelConfig
    from specjax.testing.tiny import save_random_drafter

    tgt = str(tiny_demo / "target")
    d = save_random_drafter(tgt, str(tmp_path / "drafter"))

    def path(max_length, batch=1):
        cfg = DecodeConfig(target=tgt, drafter=d, batch_size=batch,
                           compile_cache=str(tmp_path / "cache"))
        session = types.SimpleNamespace(
            cfg=cfg, model_cfg=ModelConfig.from_dir(tgt), dtype="float32",
            loaded=types.SimpleNamespace(name=d, gamma=3))
        return engines.default_cost_table(session, adaptive.GammaSchedule((0, 1, 3)),
                                          max_length)

    first = path(300)
    assert path(400) == first and path(512) == first  # one bucket: 257..512
    assert path(600) != first and path(300, batch=2) != first
    weights = os.path.join(d, "model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1  # "retrained" in place
    save_file(tensors, weights)
    assert path(300) != first
    assert engines.length_bucket(1) == 256 and engines.length_bucket(257) == 512
    assert engines.length_bucket(512) == 512


# ----------------------------------------------------------------------------- sampled

# ms per step at draft lengths 0, 1, 2 for the sampled test: at the prior (0.8) the
# longest draft pays (2.37 ms for E = 1 + 0.8 + 0.64 tokens, under 1 ms a token), and a
# rejected first draft (alpha_0 0.72 after one observation at ema 0.1) makes every
# speculative length cost more than 1 ms a token for that row, so the batch, which waits
# for its slowest row, decodes autoregressively
SAMPLED_COSTS = (1.0, 1.78, 2.37)


@pytest.mark.timeout(300)
def test_auto_policy_and_its_fallback_are_lossless_when_sampling():
    """T = 1: the real `auto` policy (GammaSchedule's default policy over draft lengths
    0, 1, 2 with a cost table, as `--gamma auto` builds it: the length chosen each step
    from the acceptance estimates the batch's own rows update), and the batch-level
    fallback to the autoregressive program, through AdaptiveEngine.run with decode.py's
    defaults (block verification, kernels auto). B = 25,000 copies of one prompt of the
    6-token target of tests/drafters/test_lossless_drafters.py generate 5 tokens each; the
    rows' law must be the target's exact law over 5 tokens, enumerated in float64 (the
    projection test of specjax/testing/distribution.py, whose power those tests show).
    The speculative run must use more than one draft length and have its first drafts
    both accepted and rejected; the fallback run must have drafted nothing."""
    from specjax.testing import distribution as du
    from tests.drafters import test_lossless_drafters as tl

    sp, n = tl.PLAIN, tl.BATCH
    drafter, dparams = tl._drafter("eagle3", sp)
    sched = adaptive.GammaSchedule(adaptive.default_choices(drafter.gamma))
    assert sched.policy == "auto" and sched.choices == (0, 1, 2)
    pays = adaptive.Baseline(prefill_ms=0.0, ar_prefill_ms=1e6, ar_ms_per_step=1e3)
    auto = AdaptiveEngine(tl._target(), drafter=drafter, drafter_params=dparams,
                          schedule=sched, costs=SAMPLED_COSTS, baseline=pays, sampling=sp,
                          max_length=len(tl.PROMPT) + tl.N_NEW, prompt_width=tl.PROMPT_WIDTH,
                          batch_size=n)
    ids = [list(tl.PROMPT)] * n
    exact, null = tl._exact(sp), tl._null(sp, n)

    def check(out, what):
        seqs = np.asarray(out.outputs)
        assert seqs.shape == (n, tl.N_NEW), what
        assert (du.empirical_pmf(seqs)[exact == 0] == 0).all(), what
        stat, thresh, worst = du.projection_test(seqs, exact, null)
        print(f"\n[{what}] z={stat:.2f} thresh={thresh:.2f} worst {worst}")
        assert stat < thresh, (what, stat, thresh, worst)

    out = auto.run(ids, tl.N_NEW, jax.random.key(11))
    assert not out.fallback
    assert (out.chosen > 0).sum() >= 2, out.chosen  # the policy changed the length
    acc = out.accepted[:, 0].sum() / out.reached[:, 0].sum()
    assert 0.05 < acc < 0.95, acc
    check(out, f"auto policy, steps per length {out.chosen.tolist()}, draft 1 "
               f"accepted in {acc:.2f}")
    auto.baseline = adaptive.Baseline(prefill_ms=1e6, ar_prefill_ms=0.0, ar_ms_per_step=0.1)
    out = auto.run(ids, tl.N_NEW, jax.random.key(12))
    assert out.fallback and out.accepted.sum() == 0 and out.chosen.sum() == 0
    check(out, "fallback to the autoregressive program")
