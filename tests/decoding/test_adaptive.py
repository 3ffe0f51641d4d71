"""Adaptive draft length (specjax.decoding.adaptive, `--gamma auto`): the rule against a
float64 enumeration, the EMA update, lossless output under adversarial (random)
schedules for every drafter family, the auto rule's choices on known costs, and the
cost-table file."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding import adaptive
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.drafters import make_drafter
from specjax.errors import SpecjaxError
from tests.decoding.test_speculative_greedy import BUDGETS, TP, models, prompts, rows, run_ar
from tests.decoding.test_speculative_greedy import make_drafter as simple_drafter
from tests.drafters.test_drafters_decode import drafter_net


def test_expected_tokens_matches_enumeration():
    """E[tokens | g] against an explicit sum over acceptance patterns in float64, and the
    finish time against its definition."""
    rng = np.random.default_rng(0)
    alpha = rng.uniform(0.1, 0.95, (3, 5))
    active = np.array([True, False, True])
    remaining = np.array([10, 50, 3])
    choices = (0, 1, 2, 3, 5)
    got = np.asarray(adaptive.expected_tokens(jnp.asarray(alpha, jnp.float32), choices))
    want = np.zeros((3, len(choices)))
    for b in range(3):
        for i, g in enumerate(choices):
            # independent Bernoulli(alpha_j) outcomes; tau = the leading run of accepts
            # (alpha_j is conditional on the earlier drafts, so this is the chain's law)
            for pattern in itertools.product([0, 1], repeat=g):
                p = np.prod([alpha[b, j] if a else 1 - alpha[b, j]
                             for j, a in enumerate(pattern)])
                tau = next((j for j, a in enumerate(pattern) if not a), g)
                want[b, i] += p * (tau + 1)  # a step emits tau drafts and one more token
    np.testing.assert_allclose(got, want, rtol=1e-5)
    costs = np.array([1.0, 1.3, 1.6, 2.0, 2.9])
    t = np.asarray(adaptive.finish_time(jnp.asarray(alpha, jnp.float32), choices,
                                        jnp.asarray(costs, jnp.float32), jnp.asarray(active),
                                        jnp.asarray(remaining)))
    slowest = np.max(np.where(active[:, None], remaining[:, None] / want, 0), axis=0)
    np.testing.assert_allclose(t, costs * slowest, rtol=1e-5)


def test_token_variance_matches_enumeration():
    rng = np.random.default_rng(1)
    alpha = rng.uniform(0.1, 0.95, (2, 5))
    choices = (0, 1, 3, 5)
    got = np.asarray(adaptive.token_variance(jnp.asarray(alpha, jnp.float32), choices))
    for b in range(2):
        for i, g in enumerate(choices):
            m1 = m2 = 0.0
            for pattern in itertools.product([0, 1], repeat=g):
                p = np.prod([alpha[b, j] if a else 1 - alpha[b, j]
                             for j, a in enumerate(pattern)])
                x = next((j for j, a in enumerate(pattern) if not a), g) + 1
                m1, m2 = m1 + p * x, m2 + p * x * x
            np.testing.assert_allclose(got[b, i], m2 - m1 * m1, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("B,alpha,g", [(32, 0.8, 3), (16, 0.6, 5), (4, 0.9, 7), (1, 0.7, 3)])
def test_straggler_finish_time_against_simulation(B, alpha, g):
    """The batch's steps under `stragglers` (the slowest of B rows, each needing 128
    tokens at draft length g) against a Monte Carlo simulation in numpy, within 6%;
    without the spread term the estimate is too low by more than that at B >= 16."""
    R, trials = 128, 400
    rng = np.random.default_rng(B * 10 + g)
    acc = rng.random((trials, B, R, g)) < alpha  # per step, per draft position
    tokens = 1 + np.argmin(np.concatenate([acc, np.zeros((trials, B, R, 1), bool)], -1), -1)
    steps = np.argmax(np.cumsum(tokens, axis=2) >= R, axis=2) + 1  # [trials, B]
    sim = steps.max(axis=1).mean()
    a = jnp.full((B, g), alpha, jnp.float32)
    args = (a, (g,), jnp.ones((1,), jnp.float32), jnp.ones((B,), bool),
            jnp.full((B,), R, jnp.int32))
    est = float(adaptive.finish_time(*args, stragglers=True)[0])
    plain = float(adaptive.finish_time(*args)[0])
    assert abs(est - sim) / sim < 0.06, (est, sim)
    if B >= 16:
        assert (sim - plain) / sim > 0.06, (plain, sim)


def test_observe_updates_reached_positions_only():
    s = adaptive.GammaSchedule((0, 1, 2, 4), ema=0.5, prior=0.8, recover=0.5)
    st = adaptive.init_state(s, 3).replace(alpha=jnp.full((3, 4), 0.6, jnp.float32))
    tau = jnp.array([1, 4, 0])
    active = jnp.array([True, True, False])
    new = adaptive.observe(s, st, 2, 2, tau, active)  # index 2: drafted 2
    a = np.asarray(new.alpha)
    # row 0: tau 1 of 2 -> position 0 accepted, position 1 reached and rejected; 2 and 3
    # not drafted: half way back to the prior 0.8
    np.testing.assert_allclose(a[0], [0.8, 0.3, 0.7, 0.7])
    np.testing.assert_allclose(a[1], [0.8, 0.8, 0.7, 0.7])  # both accepted
    np.testing.assert_allclose(a[2], [0.6] * 4)  # inactive: unchanged
    assert np.asarray(new.chosen).tolist() == [0, 0, 1, 0]
    # an autoregressive step observes nothing: every position drifts to the prior
    ar = adaptive.observe(s, st, 0, 0, jnp.zeros(3, jnp.int32), active)
    np.testing.assert_allclose(np.asarray(ar.alpha)[:2], 0.7)
    # positions past the draft drift toward the deepest observable position when it beats
    # the prior; a drafted position behind a rejection keeps its value (no information)
    hi = st.replace(alpha=jnp.array([[0.9, 0.96, 0.5, 0.5], [0.9, 0.96, 0.5, 0.5],
                                     [0.9, 0.96, 0.5, 0.5]], jnp.float32))
    new = adaptive.observe(s, hi, 2, 2, jnp.array([2, 0, 2]), active)
    a = np.asarray(new.alpha)
    np.testing.assert_allclose(a[0], [0.95, 0.98, 0.74, 0.74], rtol=1e-6)  # toward 0.98
    np.testing.assert_allclose(a[1], [0.45, 0.96, 0.73, 0.73], rtol=1e-6)  # toward 0.96


def test_auto_rule_picks_the_fastest_finish():
    s = adaptive.GammaSchedule((0, 1, 3))
    st = adaptive.AdaptState(jnp.full((2, 3), 0.9, jnp.float32), jnp.zeros(3, jnp.int32))
    act, rem = jnp.array([True, True]), jnp.array([20, 20])
    # E = 1, 1.9, 1 + .9 + .81 + .729: with flat costs the longest wins, with steep costs AR
    assert int(adaptive.choose(s, st, jnp.array([1.0, 1.0, 1.0]), act, rem, None)) == 2
    assert int(adaptive.choose(s, st, jnp.array([1.0, 5.0, 9.0]), act, rem, None)) == 0
    # the batch waits for its slowest row: one row whose drafts fail makes drafting lose
    # even though the other row would gain
    mixed = st.replace(alpha=jnp.array([[0.95] * 3, [0.05] * 3], jnp.float32))
    costs = jnp.array([1.0, 1.2, 1.6])
    assert int(adaptive.choose(s, mixed, costs, act, rem, None)) == 0
    # ... unless that row is done, or has nearly nothing left
    assert int(adaptive.choose(s, mixed, costs, jnp.array([True, False]), rem, None)) == 2
    assert int(adaptive.choose(s, mixed, costs, act, jnp.array([20, 1]), None)) == 2


# ----------------------------------------------------------------------------- in the loop

def _run_sched(drafter, dparams, budgets, policy="random", key=0, costs=None, G=3,
               alpha0=None):
    target, _ = models()
    g, p = nnx.split(target)
    sched = adaptive.GammaSchedule(adaptive.default_choices(G), policy=policy)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, schedule=sched)
    toks, lens = prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(key),
                            {"adaptive": {
                                "costs": None if costs is None else jnp.asarray(costs, jnp.float32),
                                "alpha0": None if alpha0 is None else jnp.asarray(alpha0, jnp.float32)}})


LEARNED = [("eagle3", None), ("kv", None), ("hybrid", None), ("block", "hidden"),
           ("block", "kv"), ("block", "both"), ("medc", None)]


FAST_KINDS = {("eagle3", None), ("block", "both"), ("draft_lm", None), ("ngram", None)}


@pytest.mark.parametrize("kind,context", [
    k if k in FAST_KINDS else pytest.param(*k, marks=pytest.mark.slow)
    for k in LEARNED + [("draft_lm", None), ("ngram", None)]])
def test_random_schedules_are_greedy_identical(kind, context):
    """Every drafter family: a random draft length (0 = an autoregressive step) every step,
    two different schedules, output token for token that of autoregressive decoding."""
    target, _ = models()
    if context is None and kind in ("draft_lm", "ngram"):
        drafter, dparams = simple_drafter(kind, 3)
    else:
        dcfg, net = drafter_net(kind, context)
        drafter, dparams = make_drafter(dcfg, net, target, gamma=3)
    want = rows(run_ar(BUDGETS))
    seen = set()
    for key in (1, 2):
        res = _run_sched(drafter, dparams, BUDGETS, key=key)
        assert rows(res) == want, key
        chosen = np.asarray(res.ext["adaptive"]["chosen"])
        assert chosen.sum() > 0
        seen |= set(np.flatnonzero(chosen).tolist())
    assert seen == set(range(4)), seen  # every choice (0, 1, 2, 3) ran


def test_the_drafter_stays_in_sync_across_lengths():
    """The target drafting for itself (a draft LM that is the target) must have every
    drafted token accepted under any schedule: a branch that skipped the drafter's update
    (the autoregressive one) or fed it the wrong positions would leave its cache stale
    and show as rejections."""
    drafter, dparams = simple_drafter("self", 3)
    res = _run_sched(drafter, dparams, BUDGETS, key=3)
    assert rows(res) == rows(run_ar(BUDGETS))
    acc, reach = np.asarray(res.accepted), np.asarray(res.reached)
    np.testing.assert_array_equal(acc, reach)  # alpha_k = 1 at every reached position
    assert np.asarray(res.ext["adaptive"]["chosen"])[0] > 0 and reach.sum() > 0


def test_the_schedule_starts_from_alpha0_and_returns_its_estimates():
    """alpha0 seeds the schedule (what a previous run learned, `AdaptiveEngine.alpha0`):
    the target drafting for itself is accepted every time, so started at alpha 1 it never
    decodes autoregressively, while started at 0 it does until the drift toward the prior
    makes drafting worth trying; both greedy-identical, and the final estimates come
    back."""
    drafter, dparams = simple_drafter("self", 3)
    want = rows(run_ar(BUDGETS))
    costs = [1.0, 1.5, 2.0, 2.5]
    sure = _run_sched(drafter, dparams, BUDGETS, "auto", costs=costs, alpha0=[1.0] * 3)
    doubt = _run_sched(drafter, dparams, BUDGETS, "auto", costs=costs, alpha0=[0.0] * 3)
    assert rows(sure) == want and rows(doubt) == want
    assert np.asarray(sure.ext["adaptive"]["chosen"])[0] == 0 and np.asarray(doubt.ext["adaptive"]["chosen"])[0] > 0
    alpha = np.asarray(sure.ext["adaptive"]["alpha"])
    assert alpha.shape == (len(BUDGETS), 3) and np.all(alpha > 0.99)


def test_engine_carries_the_schedule_between_runs():
    """AdaptiveEngine.run seeds each run's schedule with the estimates the previous run
    ended with (`AdaptiveEngine.alpha0`), and `reset_schedule` returns to the prior."""
    from specjax.decoding.adaptive.controller import AdaptiveEngine

    target, _ = models()
    drafter, dparams = simple_drafter("self", 3)
    sched = adaptive.GammaSchedule(adaptive.default_choices(3))
    eng = AdaptiveEngine(target, drafter=drafter, drafter_params=dparams,
                         max_length=TP + 24, prompt_width=TP, schedule=sched,
                         costs=[1.0, 1.5, 2.0, 2.5])
    toks, lens = prompts()
    ids = [np.asarray(toks)[0, :int(lens[0])].tolist()]
    assert eng.alpha0 is None
    first = eng.run(ids, 12, jax.random.key(0))
    assert eng.alpha0.shape == (3,)
    assert np.all(eng.alpha0 >= sched.prior) and eng.alpha0.max() > sched.prior
    assert eng.run(ids, 12, jax.random.key(0)).outputs == first.outputs
    eng.reset_schedule()
    assert eng.alpha0 is None


def test_auto_schedule_follows_the_costs():
    """With AR made cheap the auto rule decodes autoregressively; with AR made expensive
    it drafts; both greedy-identical, and the counters add up."""
    drafter, dparams = simple_drafter("draft_lm", 3)
    want = rows(run_ar(BUDGETS))
    cheap_ar = _run_sched(drafter, dparams, BUDGETS, "auto", costs=[1.0, 50.0, 60.0, 70.0])
    assert rows(cheap_ar) == want
    assert np.asarray(cheap_ar.ext["adaptive"]["chosen"]).tolist()[1:] == [0, 0, 0]
    assert np.asarray(cheap_ar.accepted).sum() == 0 and np.asarray(cheap_ar.reached).sum() == 0
    dear_ar = _run_sched(drafter, dparams, BUDGETS, "auto", costs=[100.0, 1.0, 1.0, 1.0])
    assert rows(dear_ar) == want
    chosen = np.asarray(dear_ar.ext["adaptive"]["chosen"])
    assert chosen[0] == 0 and chosen.sum() == np.asarray(dear_ar.steps).max()
    # reached counts only drafted positions: alpha_k = accepted / reached stays in [0, 1]
    acc, reach = np.asarray(dear_ar.accepted).sum(0), np.asarray(dear_ar.reached).sum(0)
    assert (acc <= reach).all() and reach[0] > 0


def test_cost_table_file(tmp_path):
    path = tmp_path / "costs.json"
    adaptive.write_table(str(path), (0, 1, 3), [1.0, 2.0, 3.5], {"device": "cpu"})
    assert adaptive.read_table(str(path), (0, 1, 3)) == [1.0, 2.0, 3.5]
    assert json.loads(path.read_text())["device"] == "cpu"
    with pytest.raises(SpecjaxError, match="draft length 2"):
        adaptive.read_table(str(path), (0, 2))
    path.write_text('{"ms_per_step": {"0": -1}}')
    with pytest.raises(SpecjaxError, match="positive"):
        adaptive.read_table(str(path), (0,))
    path.write_text("not json")
    with pytest.raises(SpecjaxError, match="unreadable"):
        adaptive.read_table(str(path), (0,))


def test_schedule_validation():
    with pytest.raises(ValueError):
        adaptive.GammaSchedule((2, 1))
    with pytest.raises(ValueError):
        adaptive.GammaSchedule((0, 1), policy="greedy")
    assert adaptive.default_choices(7) == (0, 1, 2, 3, 5, 7)
    assert adaptive.default_choices(2) == (0, 1, 2)
    with pytest.raises(SpecjaxError):
        adaptive.default_choices(0)


def test_branches_do_not_copy_the_kv_cache():
    """The compiled adaptive loop holds no more copies of KV-cache-shaped arrays than the
    fixed-length loop: branches as `lax.switch` copied the whole cache in and out of the
    conditional every step (a regression here costs GBs of traffic per step at 8B)."""
    import re

    target, _ = models()
    drafter, dparams = simple_drafter("ngram", 3)
    g, p = nnx.split(target)
    toks, lens = prompts()
    budgets = jnp.asarray(BUDGETS, jnp.int32)
    shape = None

    def copies(cfg, *extra):
        nonlocal shape
        txt = speculative_loop.lower(g, p, drafter, dparams, cfg, toks, lens, budgets,
                                     jax.random.key(0), *extra).compile().as_text()
        c = target.cfg
        shape = rf"\[{c.num_layers},{len(BUDGETS)},{c.num_kv_heads},\d+,{c.head_dim}\]"
        return sum(1 for line in txt.splitlines()
                   if " copy(" in line and re.search(shape, line.split(" copy(")[0]))

    base = LoopConfig(max_length=TP + 24, prompt_width=TP)
    fixed = copies(base)
    sched = adaptive.GammaSchedule((0, 1, 2, 3))
    adaptive_copies = copies(LoopConfig(max_length=TP + 24, prompt_width=TP, schedule=sched),
                             {"adaptive": {"costs": jnp.ones(4, jnp.float32)}})
    assert adaptive_copies <= fixed, (adaptive_copies, fixed)


# ----------------------------------------------------------------------------- decode.py

def test_decode_gamma_auto_end_to_end(tmp_path, capsys):
    """decode.py --gamma auto: greedy output identical to AR, the schedule in the summary,
    the measured cost table written to --cost-table and read back by the next run. On
    this tiny target the per-batch choice may rightly send every batch to the AR program
    (then no loop step ran, and the summary says so)."""
    import decode

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"
                                           f"def g{i}(x):\n"}) + "\n" for i in range(2)))
    table = tmp_path / "costs.json"
    common = ["--drafter", "ngram", "--gamma", "auto", "--prompts", str(prompts),
              "--max-new-tokens", "8", "--show", "0", "--compile-cache", "none",
              "--cost-table", str(table)]
    for run in ("measured", "read"):
        summary = tmp_path / f"{run}.json"
        assert decode.main([*common, "--summary", str(summary)]) == 0
        s = json.loads(summary.read_text())
        sched = s["gamma_schedule"]
        assert s["ar_identical"] is True and sched["choices"] == [0, 1, 2, 3, 4]
        fell_back = sched["autoregressive_batches"] == sched["batches"]
        assert (sum(sched["steps"]) > 0 or fell_back) and len(sched["ms_per_step"]) == 5
        assert (sched["calibration_s"] is None) == (run == "read")
        assert sched["ms_per_step"] == sorted(sched["ms_per_step"])  # non-decreasing
    assert adaptive.read_table(str(table), (0, 1, 2, 3, 4)) == pytest.approx(
        sched["ms_per_step"], rel=1e-3)
    # the acceptance the calibration observed, read back as the next run's start
    alpha = adaptive.read_alpha(str(table), 4)
    assert len(alpha) == 4 and all(0 <= a <= 1 for a in alpha)
    assert "draft length: steps" in capsys.readouterr().out
    raw = json.loads(table.read_text())
    table.write_text(json.dumps({**raw, "alpha": [0.5, 2.0, 0.5, 0.5]}))
    assert decode.main(common) == 2
    err = capsys.readouterr().err
    assert "alpha needs 4 acceptance rates" in err and "Traceback" not in err


@pytest.mark.parametrize("args,needle", [
    (["--gamma", "auto", "--num-drafts", "2"], "fixed --gamma"),
    (["--gamma", "auto", "--drafter", "logitspec"], "fixed --gamma"),
    (["--cost-table", "x.json", "--gamma", "3"], "goes with --gamma auto"),
    (["--cost-table", "x.json", "--gamma", "fixed"], "goes with --gamma auto"),
    (["--gamma", "auto", "--drafter", "none"], "needs a drafter"),
    (["--gamma", "often"], "a draft length, auto or fixed"),
    (["--gamma", "0"], "must be >= 1"),
])
def test_decode_gamma_auto_bad_flags(tmp_path, capsys, args, needle):
    import decode

    out = tmp_path / "o.jsonl"
    try:
        rc = decode.main(["--drafter", "ngram", "--output", str(out), *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
    assert not out.exists()


def test_adaptive_doc_quotes_the_results_file():
    """docs/adaptive.md's table is rendered from benchmarks/results/adaptive.json."""
    import os

    from benchmarks import adaptive as bench

    if not os.path.exists(bench.RESULTS):
        pytest.skip("no results file yet")
    res = json.load(open(bench.RESULTS))
    doc = open(bench.DOC).read()
    assert bench.render(res) in doc
    for r in res["runs"]:
        if r["temperature"] == 0:
            assert all(v["identical"] for v in r["systems"].values()), r
