"""Adaptive draft length (`--gamma auto`, issue 32) against fixed draft lengths and
autoregressive decoding, measured on this machine with the library's Engine as decode.py
measures (every engine of one (temperature, batch) runs interleaved batch by batch of the
same prompts, in one process, so speedups are ratios on the same machine state).

    python benchmarks/adaptive.py                       # the grid (slow on 2 cores)
    python benchmarks/adaptive.py --drafters eagle3 ngram --batch-sizes 1 4
    python benchmarks/adaptive.py --quick               # eagle3 + ngram, B=1, T=0, 4 x 32
    python benchmarks/adaptive.py --render-only         # docs/adaptive.md from the JSON
    python benchmarks/adaptive.py --ar-branch           # the autoregressive branch's cost
    python benchmarks/adaptive.py --forced --drafters eagle3 --temperatures 1 --batch-sizes 32
                                                        # one batch in every program
    python benchmarks/adaptive.py --calibration --calibration-baseline --batch-sizes 1
                                                        # the cost table's repeatability

Per (drafter, temperature, batch B): AR (no drafter), the drafter at its own G (fixed),
`--gamma auto` (its cost table measured on the first batch by `AdaptiveEngine.calibrate`, not
counted in the wall time, reported as calibration_s), and at B = 1 every other fixed
length among the schedule's choices (the best fixed length is the aim's reference).
Every engine runs the first batch twice untimed before the timed runs (the first calls
of a compiled loop cost far more than the next ones on this CPU), then all prompts
`--repeats` times (interleaved batch by batch, the engines' order reversed every other
batch so that none always runs first or last; the totals over repeats give tokens/s). The
prompts are the bundled demo prompts, repeated to fill the largest batch; EOS on;
temperature 1 verifies with block verification. Results: benchmarks/results/adaptive.json
and the `<!-- adaptive:results -->` section of docs/adaptive.md.

`--ar-branch` measures what the schedule's autoregressive branch costs against the AR
engine: per (drafter, batch), at T = 0, the schedule forced to draft length 0 (choices
(0,)) with the drafter's update deferred (the default, `GammaSchedule.defer_update`) and
with one update per step, interleaved with AR as above. Results:
benchmarks/results/adaptive_ar_branch.json and `<!-- adaptive:ar_branch -->`.

`--forced` prices one batch (the first B prompts) in each program: the AR engine, and
the adaptive loop forced to each draft length, each also run with a budget of one token
(its prefill alone). Results: benchmarks/results/adaptive_forced.json and
`<!-- adaptive:forced -->`.

Unlike the other benchmarks, this one builds its engines by hand (`Engine`,
`AdaptiveEngine`), not as decoding sessions (`benchmarks.lib.sessions`): it measures the
adaptive controller's own parts, which a session keeps inside.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.provenance import git_rev  # noqa: E402
from benchmarks.lib.report import save_results  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "adaptive.json")
AR_RESULTS = os.path.join(ROOT, "benchmarks", "results", "adaptive_ar_branch.json")
FORCED_RESULTS = os.path.join(ROOT, "benchmarks", "results", "adaptive_forced.json")
CALIB_RESULTS = os.path.join(ROOT, "benchmarks", "results", "adaptive_calibration.json")
CALIB_BASELINE_RESULTS = os.path.join(ROOT, "benchmarks", "results",
                                      "adaptive_calibration_baseline.json")
CALIB_ROUNDS_RESULTS = os.path.join(ROOT, "benchmarks", "results",
                                    "adaptive_calibration_rounds.json")
DOC = os.path.join(ROOT, "docs", "adaptive.md")
DEMO = os.path.join(ROOT, "checkpoints", "demo")
DRAFTERS = {"eagle3": os.path.join(DEMO, "drafters", "eagle3"),
            "kv1": os.path.join(DEMO, "drafters", "kv1"),
            "hybrid": os.path.join(DEMO, "drafters", "hybrid"),
            "block": os.path.join(DEMO, "drafters", "block"),
            "draft-lm": os.path.join(DEMO, "draft"),
            "ngram": "ngram"}


def _demo(new_tokens: int):
    """(target, the bundled prompts' ids, the longest prompt's length, max_length) for the
    demo target with `new_tokens` new tokens per prompt."""
    from specjax.decoding.loading import load_target
    from specjax.decoding.prompts import read_prompts

    target = load_target(os.path.join(DEMO, "target"))
    base = [ids for _, ids in read_prompts(target.tokenizer, target.cfg.vocab_size)]
    longest = max(len(ids) for ids in base)
    return target, base, longest, longest + new_tokens


def _machine(rev: str) -> dict:
    """The results record's provenance: code, date, machine and jax."""
    import platform

    import jax

    return {"git": rev, "date": time.strftime("%Y-%m-%d"),
            "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "jax": jax.__version__, "device": jax.devices()[0].device_kind}


def _drop_programs() -> None:
    """Drops every compiled program once a setting is done (the caller has deleted its
    engines): XLA:CPU maps each one into the process, and a full sweep compiles hundreds;
    one died of "Cannot allocate memory" (the mapping limit) near its end."""
    import jax

    jax.clear_caches()
    gc.collect()


def measure(drafters, temps, batches, n_prompts: int, new_tokens: int,
            sweep: bool = True, repeats: int = 2, stragglers: bool = False,
            table_ab: bool = False, calibration_ab: bool = False,
            drift_ab: bool = False, aa: bool = False) -> dict:
    """Runs the grid; returns the results record (see the module docstring). auto
    calibrates on the batch of median prompt length (`adaptive.calibration_batch`, as
    decode.py); with `calibration_ab` also "auto (first batch)": the same loop, compiled
    apart, calibrated on the first batch (the rule before), interleaved with the rest; with
    `drift_ab` also "auto (drift to prior)": its own compiled loop with auto's table and
    starting estimates, drifting toward the prior while batches fall back (the rule
    before 2026-11-28); with `aa` also "auto (copy)": auto's rule and table in its own
    compiled loop (an A/A control for the twins)."""
    import copy

    import jax
    import numpy as np

    from specjax.core.sampling import SamplingParams
    from specjax.decoding import adaptive
    from specjax.decoding.adaptive.controller import DRIFT_TARGETS, AdaptiveEngine
    from specjax.decoding.engine import Engine, Stats, prompt_width_for
    from specjax.decoding.loading import load_drafter

    rev = git_rev(ROOT)  # the code measured
    target, base, longest, max_length = _demo(new_tokens)
    runs = []
    # Engines built by hand throughout this script: it measures the adaptive controller's
    # own parts (fixed lengths through adaptive.with_gamma, calibration rounds, twins that
    # share one cost table, forced branches), which a decoding session keeps inside
    for temp in temps:
        sampling = SamplingParams(temperature=temp)
        for B in batches:
            n = max(n_prompts, B)
            prompts = [base[i % len(base)] for i in range(n)]
            common = dict(sampling=sampling, verify="block", max_length=max_length,
                          prompt_width=prompt_width_for(longest, max_length), batch_size=B,
                          eos_token_ids=target.cfg.eos_token_ids)
            for name in drafters:
                loaded = load_drafter(DRAFTERS[name], target, sampling=sampling)
                G = loaded.gamma
                sched = adaptive.GammaSchedule(adaptive.default_choices(G))
                engines = {"AR": Engine(target.model, **common)}
                fixed = [G] + ([g for g in sched.choices if 0 < g < G] if sweep and B == 1
                               else [])
                for g in fixed:
                    d = adaptive.with_gamma(loaded.drafter, g)
                    engines[f"G={g}"] = Engine(target.model, drafter=d,
                                               drafter_params=loaded.params, **common)
                engines["auto"] = AdaptiveEngine(target.model, drafter=loaded.drafter,
                                                 drafter_params=loaded.params,
                                                 schedule=sched, **common)
                if stragglers:  # the rule with the batch's spread, same cost table
                    engines["auto+stragglers"] = AdaptiveEngine(
                        target.model, drafter=loaded.drafter, drafter_params=loaded.params,
                        schedule=dataclasses.replace(sched, stragglers=True), **common)
                compile_s = {k: e.compile() for k, e in engines.items()}
                key0 = jax.random.key(0)
                t0 = time.perf_counter()
                cal = [prompts[i:i + B] for i in range(0, n, B)]
                cal_at = adaptive.calibration_batch(cal)
                costs = engines["auto"].calibrate(cal[cal_at], new_tokens, key0,
                                                  baseline=True)
                calibration_s = time.perf_counter() - t0
                if stragglers:
                    engines["auto+stragglers"].costs = engines["auto"].costs
                if calibration_ab:  # the same loop, compiled apart (a system right after
                    # its own compiled program measured 3-9% faster: docs/adaptive.md),
                    # calibrated on the first batch
                    first = AdaptiveEngine(target.model, drafter=loaded.drafter,
                                           drafter_params=loaded.params, schedule=sched,
                                           **common)
                    compile_s["auto (first batch)"] = first.compile()
                    first.calibrate(prompts[:B], new_tokens, key0, baseline=True)
                    engines["auto (first batch)"] = first
                # twins with auto's table, baseline and starting estimates, each its own
                # compiled loop: fallback batches drift toward the prior (the old rule), or
                # auto's rule itself (an A/A control: what a twin measures apart from
                # auto when nothing differs but the compiled copy)
                own = engines["auto"].drift_to
                for label, on, drift in (
                        *[(f"auto (drift to {t})", drift_ab, t) for t in DRIFT_TARGETS
                          if t != own],
                        ("auto (copy)", aa, own)):
                    if not on:
                        continue
                    twin = AdaptiveEngine(target.model, drafter=loaded.drafter,
                                          drafter_params=loaded.params, schedule=sched,
                                          **common)
                    compile_s[label] = twin.compile()
                    a = engines["auto"]
                    twin.costs, twin.baseline = a.costs.copy(), a.baseline
                    twin.measured_costs = a.measured_costs
                    twin.alpha0 = None if a.alpha0 is None else a.alpha0.copy()
                    twin.alpha_calibrated = a.alpha_calibrated
                    twin.pooled = a.pooled
                    twin.drift_to = drift
                    engines[label] = twin
                if table_ab:  # the same compiled loop, baseline and measurements, the
                    # table made non-decreasing entry by entry (the rule before fit_costs)
                    old = copy.copy(engines["auto"])
                    old.costs = np.maximum.accumulate(
                        np.asarray(engines["auto"].measured_costs, np.float32))
                    engines["auto (running max)"] = old
                for _ in range(2):  # untimed: a compiled loop's first calls are slow
                    for e in engines.values():
                        e.run(prompts[:B], new_tokens, key0)
                stats = {k: Stats() for k in engines}
                outs = {k: [] for k in engines}
                order = list(engines.items())
                shuffle = np.random.default_rng(0)
                for rep in range(repeats):
                    for i in range(0, n, B):
                        key = jax.random.fold_in(key0, i)
                        # a random order per batch (seeded): forwards-then-backwards
                        # put the last system after itself or after its own compiled
                        # loop every time, and that measured 3-8% faster at B = 1
                        # (docs/adaptive.md, "Each program's prediction scaled by its
                        # own batches")
                        turn = [order[j] for j in shuffle.permutation(len(order))]
                        for k, e in turn:
                            out = e.run(prompts[i:i + B], new_tokens, key)
                            stats[k].add(out)
                            if rep == 0:
                                outs[k].extend(out.outputs)
                ar = stats["AR"].tokens_per_s
                rec = {"drafter": name, "gamma": G, "temperature": temp, "batch": B,
                       "prompts": n, "ar_tokens_per_s": ar, "choices": list(sched.choices),
                       "ms_per_step": [round(float(c), 3) for c in costs],
                       "measured_ms_per_step": [round(float(c), 3)
                                                for c in engines["auto"].measured_costs],
                       "baseline": (None if engines["auto"].baseline is None
                                    else dataclasses.asdict(engines["auto"].baseline)),
                       "calibration_s": calibration_s, "compile_s": compile_s,
                       "calibration_batch": cal_at,
                       "order": "random", "systems": {}}
                for k, st in stats.items():
                    if k == "AR":
                        continue
                    sys_rec = {"tokens_per_s": st.tokens_per_s, "speedup": st.tokens_per_s / ar,
                               "tau": st.tau, "alpha": st.alpha,
                               "identical": outs[k] == outs["AR"] if temp == 0 else None}
                    if k.startswith("auto"):
                        sys_rec["autoregressive_batches"] = [st.fallback_batches, st.batches]
                        steps = [int(c) for c in st.chosen]
                        sys_rec["steps_per_length"] = steps
                        sys_rec["mean_draft_length"] = sum(
                            g * c for g, c in zip(sched.choices, steps, strict=True)) / max(
                            sum(steps), 1)
                    rec["systems"][k] = sys_rec
                fixed_best = max((v["speedup"], k) for k, v in rec["systems"].items()
                                 if not k.startswith("auto"))
                rec["best_fixed"] = fixed_best[1]
                runs.append(rec)
                print(f"[adaptive] {name} T={temp:g} B={B}: AR {ar:.1f} tok/s; "
                      + ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in rec["systems"].items())
                      + "; mean g " + ", ".join(f"{k} {v['mean_draft_length']:.2f}"
                                                for k, v in rec["systems"].items()
                                                if k.startswith("auto"))
                      + f"; costs {rec['ms_per_step']} (measured "
                      f"{rec['measured_ms_per_step']})", file=sys.stderr, flush=True)
                del engines, loaded
                _drop_programs()
    return {"runs": runs, "new_tokens": new_tokens, "repeats": repeats, **_machine(rev),
            "schedule": {"ema": adaptive.GammaSchedule.ema,
                         "prior": adaptive.GammaSchedule.prior}}


def ar_branch(drafters, batches, n_prompts: int, new_tokens: int, repeats: int = 2) -> dict:
    """The autoregressive branch against the AR engine (module docstring)."""

    import jax

    from specjax.decoding import adaptive
    from specjax.decoding.adaptive.controller import AdaptiveEngine
    from specjax.decoding.engine import Engine, Stats, prompt_width_for
    from specjax.decoding.loading import load_drafter

    rev = git_rev(ROOT)
    target, base, longest, max_length = _demo(new_tokens)
    runs = []
    for B in batches:
        n = max(n_prompts, B)
        prompts = [base[i % len(base)] for i in range(n)]
        common = dict(max_length=max_length, batch_size=B,
                      prompt_width=prompt_width_for(longest, max_length),
                      eos_token_ids=target.cfg.eos_token_ids)
        for name in drafters:
            loaded = load_drafter(DRAFTERS[name], target)
            engines = {"AR": Engine(target.model, **common)}
            for label, defer in (("deferred", True), ("every step", False)):
                sched = adaptive.GammaSchedule((0,), defer_update=defer)
                engines[label] = AdaptiveEngine(target.model, drafter=loaded.drafter,
                                                drafter_params=loaded.params,
                                                schedule=sched, costs=[1.0], **common)
            for e in engines.values():
                e.compile()
            key0 = jax.random.key(0)
            for _ in range(2):  # untimed warm-up calls
                for e in engines.values():
                    e.run(prompts[:B], new_tokens, key0)
            stats = {k: Stats() for k in engines}
            same = {k: True for k in engines}
            for _ in range(repeats):
                for i in range(0, n, B):
                    key = jax.random.fold_in(key0, i)
                    got = {k: e.run(prompts[i:i + B], new_tokens, key) for k, e in engines.items()}
                    for k, out in got.items():
                        stats[k].add(out)
                        same[k] &= out.outputs == got["AR"].outputs
            ar = stats["AR"].tokens_per_s
            rec = {"drafter": name, "batch": B, "prompts": n, "ar_tokens_per_s": ar,
                   "ratio": {k: st.tokens_per_s / ar for k, st in stats.items() if k != "AR"},
                   "identical": {k: v for k, v in same.items() if k != "AR"}}
            runs.append(rec)
            print(f"[adaptive] AR branch, {name} B={B}: AR {ar:.1f} tok/s; "
                  + ", ".join(f"{k} {v:.3f}x" for k, v in rec["ratio"].items()),
                  file=sys.stderr, flush=True)
            del engines, loaded
            _drop_programs()
    return {"runs": runs, "new_tokens": new_tokens, "repeats": repeats, **_machine(rev)}


def calibration(drafters, temps, batches, new_tokens: int, repeats: int = 4,
                budgets: bool = False, baseline: bool = False,
                more_rounds: float = 0.0) -> dict:
    """How repeatable `AdaptiveEngine.calibrate`'s table is (`--calibration`): per (drafter,
    temperature, batch), `repeats` calibrations in rounds over the choices (the default)
    alternating with `repeats` measuring one choice after another, on the same compiled
    loop and first batch. Per method: each measured entry's spread over the calibrations
    (max / min - 1), the measured tables' inversions (a longer draft measured cheaper
    than a shorter one), and the same spread of the fitted tables (`adaptive.fit_costs`).
    `budgets`: compare runs of 32 tokens (the default budget) with runs of the whole
    `new_tokens` instead, both in rounds. `baseline`: with the autoregressive program
    measured too (`AdaptiveEngine.calibrate(baseline=True)`), in the same rounds as the table
    against after it (the order before git 4d1f7d7); per method also the spread of the
    ratio the fallback decides by, each fitted entry / the autoregressive step.
    `more_rounds` (seconds): three rounds against rounds added for up to that many seconds
    (`AdaptiveEngine.calibrate(seconds=...)`), both with the baseline in the rounds; per
    calibration also the rounds run and two margins from its per-round ratios: the range
    (`adaptive.measured_margin`, the margin calibrate sets) and the Student t bound of
    their mean (`t_bound_margin`), to hold against the ratio's actual spread over the
    calibrations."""
    import jax
    import numpy as np

    from specjax.core.sampling import SamplingParams
    from specjax.decoding import adaptive
    from specjax.decoding.adaptive.controller import AdaptiveEngine
    from specjax.decoding.engine import prompt_width_for
    from specjax.decoding.loading import load_drafter

    rev = git_rev(ROOT)
    baseline = baseline or bool(more_rounds)  # the margins need the AR program
    target, base, longest, max_length = _demo(new_tokens)
    runs = []
    for temp in temps:
        sampling = SamplingParams(temperature=temp)
        for B in batches:
            prompts = [base[i % len(base)] for i in range(B)]
            for name in drafters:
                loaded = load_drafter(DRAFTERS[name], target, sampling=sampling)
                sched = adaptive.GammaSchedule(adaptive.default_choices(loaded.gamma))
                eng = AdaptiveEngine(target.model, drafter=loaded.drafter,
                                     drafter_params=loaded.params, schedule=sched,
                                     verify="block", sampling=sampling,
                                     max_length=max_length, batch_size=B,
                                     prompt_width=prompt_width_for(longest, max_length),
                                     eos_token_ids=target.cfg.eos_token_ids)
                eng.compile()
                if budgets:
                    methods = {"32 tokens": dict(max_tokens=32, min_steps=6),
                               f"{new_tokens} tokens": dict(max_tokens=new_tokens,
                                                            min_steps=new_tokens)}
                elif more_rounds:
                    methods = {"3 rounds": dict(order="rounds"),
                               f"rounds for {more_rounds:g} s": dict(order="rounds",
                                                                    seconds=more_rounds)}
                elif baseline:
                    methods = {"AR program in the rounds": dict(order="rounds"),
                               "AR program after the table": dict(order="ar last")}
                else:
                    methods = {"rounds": dict(order="rounds"),
                               "one after another": dict(order="one after another")}
                tables = {k: [] for k in methods}
                fitted = {k: [] for k in tables}
                ar_steps = {k: [] for k in tables}
                margins = {k: [] for k in tables}  # (rounds, range margin, t margin)
                relative = {k: [] for k in tables}  # each calibration's per-round ratios
                t0 = time.perf_counter()
                for rep in range(repeats):  # the methods' order reversed every other time
                    for label, kw in list(methods.items())[::1 if rep % 2 == 0 else -1]:
                        fitted[label].append(eng.calibrate(prompts, new_tokens,
                                                           jax.random.key(0),
                                                           baseline=baseline, **kw))
                        tables[label].append(list(eng.measured_costs))
                        if baseline:
                            ar_steps[label].append(eng.baseline.ar_ms_per_step)
                            rel = eng.calibration_relative
                            relative[label].append([round(x, 5) for x in rel])
                            margins[label].append(  # the range: calibrate's own margin
                                [eng.calibration_rounds,
                                 round(eng.baseline.margin, 4) if rel else None,
                                 round(t_bound_margin(rel), 4) if rel else None])
                rec = {"drafter": name, "temperature": temp, "batch": B,
                       "choices": list(sched.choices), "seconds": time.perf_counter() - t0,
                       "methods": {}}
                for label, tabs in tables.items():
                    m, f = np.asarray(tabs), np.asarray(fitted[label])
                    inv = sum(int(np.sum(np.diff(t) < 0)) for t in m)
                    rec["methods"][label] = {
                        "measured": m.round(3).tolist(), "fitted": f.round(3).tolist(),
                        "spread": (m.max(0) / m.min(0) - 1).round(4).tolist(),
                        "fitted_spread": (f.max(0) / f.min(0) - 1).round(4).tolist(),
                        "inversions": inv}
                    if baseline:  # what the fallback compares: table / AR step
                        q = f / np.asarray(ar_steps[label])[:, None]
                        rec["methods"][label].update(
                            ar_ms_per_step=np.round(ar_steps[label], 3).tolist(),
                            ratio=q.round(4).tolist(),
                            ratio_spread=(q.max(0) / q.min(0) - 1).round(4).tolist(),
                            margins=margins[label], relative=relative[label])
                runs.append(rec)
                print(f"[adaptive] calibration {name} T={temp:g} B={B}: " + "; ".join(
                    f"{k}: spread {np.mean(v['spread']):.3f} (fitted "
                    f"{np.mean(v['fitted_spread']):.3f}), {v['inversions']} inversions"
                    for k, v in rec["methods"].items()), file=sys.stderr, flush=True)
                del eng, loaded
                _drop_programs()
    return {"runs": runs, "new_tokens": new_tokens, "repeats": repeats, **_machine(rev)}


def t_bound_margin(walls, confidence: float = 0.975) -> float:
    """A margin from one calibration's per-round ratios by the upper confidence bound of
    their mean log (the candidate to `adaptive.measured_margin`'s range that
    `--calibration-rounds` weighs): exp(t * sd(log w) / sqrt(n)) - 1, t Student's
    `confidence` quantile at n - 1 degrees of freedom (4.30 for n = 3, 2.20 for n = 12),
    clamped to `adaptive.MARGIN_RANGE` (its lower end for fewer than two walls). Unlike
    the range it shrinks as rounds are added; measured, it understates the ratio's
    spread between calibrations (docs/adaptive.md, "More rounds"). Raises ValueError
    for no walls or one that is not positive."""
    import math
    import statistics

    from scipy.stats import t as student_t

    from specjax.decoding import adaptive

    w = [float(x) for x in walls]
    if not w or min(w) <= 0:
        raise ValueError(f"t_bound_margin needs positive walls, got {walls!r}")
    lo, hi = adaptive.MARGIN_RANGE
    if len(w) < 2:
        return lo
    se = statistics.stdev([math.log(x) for x in w]) / math.sqrt(len(w))
    tq = float(student_t.ppf(confidence, len(w) - 1))
    return min(max(math.expm1(tq * se), lo), hi)


def render_calibration(res: dict) -> str:
    """The markdown table of a `--calibration` record."""
    lines = [f"Measured on {res['device']} ({res['cores']} cores), git {res['git']}, "
             f"{res['date']}: {res['repeats']} calibrations per method, alternating, on "
             "the same compiled loop and first batch. Spread: each measured entry's max / "
             "min - 1 over the calibrations, mean over the choices (fitted: the same for "
             "the table `adaptive.fit_costs` keeps). Inversions: a longer draft measured "
             "cheaper than a shorter one, summed over the calibrations.", "",
             "| drafter | T | B | method | spread measured | spread fitted | inversions |",
             "|---|---|---|---|---|---|---|"]
    ratios = any("ratio_spread" in v for r in res["runs"] for v in r["methods"].values())
    if ratios:
        lines[0] += (" Ratio: each fitted entry / the autoregressive program's step (what "
                     "the per-batch fallback compares), its spread over the calibrations "
                     "likewise; AR step: its range (ms).")
        lines[-2] += " spread of ratio | AR step |"
        lines[-1] += "---|---|"
    margins = any(v.get("margins") for r in res["runs"] for v in r["methods"].values())
    if margins:
        lines[0] += (" Rounds: the rounds each calibration ran (range). Margins (mean over "
                     "the calibrations): from each calibration's per-round ratios of the "
                     "autoregressive wall to its round's speculative walls, their range "
                     "(`adaptive.measured_margin`) and the 97.5% Student t bound of their "
                     "mean (`benchmarks/adaptive.py`'s `t_bound_margin`), both clamped to 2-25%; to hold "
                     "against the spread of ratio, the error they are meant to cover.")
        lines[-2] += " rounds | margin: range | margin: t bound |"
        lines[-1] += "---|---|---|"
    for r in res["runs"]:
        for k, v in r["methods"].items():
            mean = sum(v["spread"]) / len(v["spread"])
            fmean = sum(v["fitted_spread"]) / len(v["fitted_spread"])
            row = (f"| {r['drafter']} | {r['temperature']:g} | {r['batch']} | {k} | "
                   f"{mean:.1%} | {fmean:.1%} | {v['inversions']} |")
            if ratios:
                q, a = v.get("ratio_spread"), v.get("ar_ms_per_step")
                row += (f" {sum(q) / len(q):.1%} | {min(a):.2f}-{max(a):.2f} |" if q
                        else " - | - |")
            if margins:
                ms = [m for m in v.get("margins") or [] if m[1] is not None]
                row += (f" {min(m[0] for m in ms)}-{max(m[0] for m in ms)} | "
                        f"{sum(m[1] for m in ms) / len(ms):.1%} | "
                        f"{sum(m[2] for m in ms) / len(ms):.1%} |" if ms else " - | - | - |")
            lines.append(row)
    return "\n".join(lines) + "\n"


def write_calibration_doc(res: dict, doc: str = DOC,
                          section: str = "adaptive:calibration") -> None:
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, section, render_calibration(res),
                        "# Adaptive draft length\n\n")


def write_calibration_baseline_doc(res: dict, doc: str = DOC) -> None:
    write_calibration_doc(res, doc, "adaptive:calibration_baseline")


def write_calibration_rounds_doc(res: dict, doc: str = DOC) -> None:
    write_calibration_doc(res, doc, "adaptive:calibration_rounds")


def forced(drafters, temps, batches, n_prompts: int, new_tokens: int,
           repeats: int = 3, with_fixed: bool = False) -> dict:
    """What a batch costs in each program (module docstring, `--forced`): per (drafter,
    T, B), the AR engine and the adaptive loop forced to each choice (a one-hot cost
    table, as `AdaptiveEngine.calibrate` makes them) on the same batch, each also with a budget
    of one token (its prefill alone); every wall the fastest of `repeats` interleaved
    passes after one warm-up pass. `with_fixed`: also the fixed-length program of every
    speculative choice (and its prefill), for what the loop's branches cost against it."""

    import jax
    import numpy as np

    from specjax.core.sampling import SamplingParams
    from specjax.decoding import adaptive
    from specjax.decoding.adaptive.controller import AdaptiveEngine
    from specjax.decoding.engine import Engine, prompt_width_for
    from specjax.decoding.loading import load_drafter

    rev = git_rev(ROOT)
    target, base, longest, max_length = _demo(new_tokens)
    runs = []
    for temp in temps:
        for B in batches:
            prompts = [base[i % len(base)] for i in range(B)]
            common = dict(sampling=SamplingParams(temperature=temp), verify="block",
                          max_length=max_length, batch_size=B,
                          prompt_width=prompt_width_for(longest, max_length),
                          eos_token_ids=target.cfg.eos_token_ids)
            for name in drafters:
                loaded = load_drafter(DRAFTERS[name], target, sampling=common["sampling"])
                sched = adaptive.GammaSchedule(adaptive.default_choices(loaded.gamma))
                n = len(sched.choices)
                ar = Engine(target.model, **common)
                auto = AdaptiveEngine(target.model, drafter=loaded.drafter,
                                      drafter_params=loaded.params, schedule=sched,
                                      costs=np.ones(n), **common)
                ar.compile()
                auto.compile()
                systems = {"AR": (ar, None, new_tokens), "AR prefill": (ar, None, 1),
                           "prefill": (auto, np.ones(n), 1)}
                for i, g in enumerate(sched.choices):
                    table = np.full(n, 1e30)
                    table[i] = 1.0
                    systems[f"g={g}"] = (auto, table, new_tokens)
                for g in sched.choices if with_fixed else ():
                    if g > 0:
                        fx = Engine(target.model, drafter=adaptive.with_gamma(loaded.drafter, g),
                                    drafter_params=loaded.params, **common)
                        fx.compile()
                        systems[f"G={g} fixed"] = (fx, None, new_tokens)
                        systems[f"G={g} fixed prefill"] = (fx, None, 1)
                key = jax.random.key(0)
                best = {}
                for rep in range(repeats + 1):
                    for k, (e, table, budget) in systems.items():
                        if table is not None:
                            e.costs = table
                        out = e.run(prompts, budget, key)
                        if rep and (k not in best or out.wall_s < best[k][0]):
                            best[k] = (out.wall_s, int(np.max(out.steps)),
                                       sum(len(o) for o in out.outputs))
                ar_pre, pre = best["AR prefill"][0], best["prefill"][0]
                rec = {"drafter": name, "temperature": temp, "batch": B,
                       "prefill_s": pre, "ar_prefill_s": ar_pre, "systems": {}}
                for k, (wall, steps, toks) in best.items():
                    if "prefill" in k:
                        continue
                    p0 = ar_pre if k == "AR" else best.get(k + " prefill", (pre,))[0]
                    rec["systems"][k] = {"wall_s": wall, "steps": steps, "tokens": toks,
                                         "ms_per_step": 1e3 * (wall - p0) / max(steps, 1),
                                         "wall_over_ar": wall / best["AR"][0]}
                runs.append(rec)
                print(f"[adaptive] forced {name} T={temp:g} B={B}: prefill {pre:.2f} s "
                      f"(AR {ar_pre:.2f} s); " + ", ".join(
                          f"{k} {v['wall_s']:.2f} s / {v['ms_per_step']:.1f} ms"
                          for k, v in rec["systems"].items()), file=sys.stderr, flush=True)
                del ar, auto, loaded
                _drop_programs()
    return {"runs": runs, "new_tokens": new_tokens, "repeats": repeats, **_machine(rev)}


def render_forced(res: dict) -> str:
    """The markdown table of a `--forced` record."""
    lines = [f"Measured on this machine ({res['device']}, {res['cores']} cores, git "
             f"{res['git']}, {res['date']}; one batch of the bundled demo prompts, "
             f"{res['new_tokens']} new tokens, EOS on; each wall the fastest of "
             f"{res['repeats']} interleaved passes). ms/step = (wall - that program's "
             "prefill) / loop steps; g = k is the adaptive loop forced to draft length k "
             "(g = 0: its autoregressive branch).", "",
             "| drafter | T | B | prefill s (AR / speculative) | system | wall s | "
             "x AR's wall | steps | ms/step |", "|" + "---|" * 9]
    for r in res["runs"]:
        for i, (k, v) in enumerate(r["systems"].items()):
            head = (f"| {r['drafter']} | {r['temperature']:g} | {r['batch']} | "
                    f"{r['ar_prefill_s']:.2f} / {r['prefill_s']:.2f} |" if i == 0
                    else "| | | | |")
            lines.append(f"{head} {k} | {v['wall_s']:.2f} | {v['wall_over_ar']:.2f} | "
                         f"{v['steps']} | {v['ms_per_step']:.1f} |")
    return "\n".join(lines) + "\n"


def write_forced_doc(res: dict, doc: str = DOC) -> None:
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, "adaptive:forced", render_forced(res))


def render_ar_branch(res: dict) -> str:
    lines = [f"Measured on this machine ({res['device']}, {res['cores']} cores, git "
             f"{res['git']}, {res['date']}; the bundled demo prompts repeated to fill each "
             f"batch, {res['new_tokens']} new tokens, T = 0, EOS on, {res['repeats']} timed "
             "passes interleaved with AR). Ratio = tokens/s of the schedule forced to "
             "draft length 0 over the AR engine's, in the same run.", "",
             "| drafter | B | AR tok/s | deferred update (default) | update every step "
             "| identical |", "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        same = "yes" if all(r["identical"].values()) else "NO"
        lines.append(f"| {r['drafter']} | {r['batch']} | {r['ar_tokens_per_s']:.1f} | "
                     f"{r['ratio']['deferred']:.3f}x | {r['ratio']['every step']:.3f}x | "
                     f"{same} |")
    return "\n".join(lines) + "\n"


def write_ar_doc(res: dict, doc: str = DOC) -> None:
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, "adaptive:ar_branch", render_ar_branch(res))


# the twins of auto that an A/B run adds (each its own compiled loop), as render names them
TWINS = {
    "auto (first batch)": (
        "\"auto (first batch)\": the same loop (compiled apart) calibrated on the first "
        "batch instead of the batch of median prompt length "
        "(`adaptive.calibration_batch`), interleaved with the rest."),
    "auto (drift to prior)": (
        "\"auto (drift to prior)\": the same loop (compiled apart) with auto's cost table "
        "and starting estimates, whose estimates drift toward the prior (0.8) while "
        "batches fall back (the rule before 2026-11-28; `AdaptiveEngine.drift_to`), interleaved "
        "with the rest."),
    "auto (drift to calibrated)": (
        "\"auto (drift to calibrated)\": the same, drifting toward the acceptance its "
        "calibration observed on its one batch (the default since git 6ed65cf)."),
    "auto (drift to pooled)": (
        "\"auto (drift to pooled)\": the same, drifting toward the acceptance pooled "
        "over every batch it drafted for (`AdaptiveEngine.pooled`; measured, not "
        "adopted)."),
    "auto (copy)": (
        "\"auto (copy)\": auto's rule, table and starting estimates in a loop compiled "
        "apart, built as the twins are (an A/A control: the difference from auto is the "
        "measurement's, not a rule's), interleaved with the rest."),
}


def render(res: dict) -> str:
    """The markdown table of a results record."""
    lines = [f"Measured on this machine ({res['device']}, {res['cores']} cores, git "
             f"{res['git']}, {res['date']}; the bundled demo prompts repeated to fill each "
             f"batch, {res['new_tokens']} new tokens, EOS on, T = 1 with block "
             "verification; shipped weights in checkpoints/demo). Speedup = tokens/s over "
             "autoregressive decoding, measured in the same run, its batches "
             "interleaved with every system's (in a seeded random order per batch where "
             "the JSON row says `order: random`; before that forwards, then backwards, "
             "which favoured the last system by 3-8%). auto's cost table was "
             "measured on one batch (calibration, not counted): the batch of median prompt "
             "length where the JSON row records `calibration_batch`, else the first. "
             "\"AR program k/n\": "
             "auto ran k of its n timed batches without the drafter "
             "(`adaptive.speculation_pays`; rows kept from earlier commits had no such "
             "choice).",
             *[f"Rows of {d} were measured earlier, at git {g} ({day}), and kept by "
               "`--append`." for d, g, day in sorted(
                   {(r["drafter"], r["git"], r["date"]) for r in res["runs"]
                    if r.get("git", res["git"]) != res["git"]})], "",
             "| drafter | T | B | AR tok/s | fixed G | auto | auto mean g | best fixed "
             "(every choice at B=1, G above) | auto / best fixed | identical |",
             "|" + "---|" * 10]
    twins = [t for t in TWINS if any(t in r["systems"] for r in res["runs"])]
    for t in twins:  # --calibration-ab, --drift-ab
        lines[0] += " " + TWINS[t]
        lines[-2] += f" {t} |"
        lines[-1] += "---|"
    for r in res["runs"]:
        s = r["systems"]
        fixed, auto = s[f"G={r['gamma']}"], s["auto"]
        best = s[r["best_fixed"]]
        ident = {True: "yes", False: "NO", None: "-"}[auto["identical"]]
        fb, nb = auto.get("autoregressive_batches", [0, 0])
        fell = f" (AR program {fb}/{nb})" if fb else ""
        lines.append(
            f"| {r['drafter']} | {r['temperature']:g} | {r['batch']} | "
            f"{r['ar_tokens_per_s']:.1f} | {fixed['speedup']:.2f}x (G={r['gamma']}) | "
            f"**{auto['speedup']:.2f}x**{fell} | {auto['mean_draft_length']:.2f} | "
            f"{best['speedup']:.2f}x ({r['best_fixed']}) | "
            f"{auto['speedup'] / best['speedup']:.2f} | {ident} |")
        for name in twins:
            t = s.get(name)
            lines[-1] += (" - |" if t is None else
                          f" {t['speedup']:.2f}x (AR program "
                          f"{t['autoregressive_batches'][0]}/{t['autoregressive_batches'][1]}) |")
    return "\n".join(lines) + "\n"


def write_doc(res: dict, doc: str = DOC) -> None:
    """Replaces the `<!-- adaptive:results -->` section of docs/adaptive.md."""
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, "adaptive:results", render(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prompts", type=int, default=8, help="prompts (at least one batch)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-sweep", action="store_true", help="skip the B=1 fixed-G sweep")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts")
    ap.add_argument("--quick", action="store_true",
                    help="eagle3 and ngram, T=0, B=1, 4 prompts x 32 tokens")
    ap.add_argument("--table-ab", action="store_true",
                    help="also run auto with the measured table made non-decreasing entry "
                         "by entry (the rule before adaptive.fit_costs), same run")
    ap.add_argument("--calibration-ab", action="store_true",
                    help="also run auto calibrated on the first batch (the rule before "
                         "adaptive.calibration_batch), interleaved")
    ap.add_argument("--drift-ab", action="store_true",
                    help="also run auto whose estimates drift toward the prior while "
                         "batches fall back (the rule before 2026-11-28), same table, "
                         "interleaved")
    ap.add_argument("--aa", action="store_true",
                    help="also run a copy of auto (same rule and table, its own compiled "
                         "loop, as the A/B twins): an A/A control, interleaved")
    ap.add_argument("--stragglers", action="store_true",
                    help="also run the rule that counts the batch's spread "
                         "(GammaSchedule.stragglers), on the same cost table")
    ap.add_argument("--ar-branch", action="store_true",
                    help="measure the autoregressive branch (draft length 0) with and "
                         "without the deferred drafter update against AR (T = 0)")
    ap.add_argument("--forced", action="store_true",
                    help="wall time of one batch in the AR program and in the adaptive loop "
                         "forced to each draft length, with each program's prefill")
    ap.add_argument("--calibration", action="store_true",
                    help="how repeatable the cost table is: --repeats calibrations in "
                         "rounds over the choices against as many one choice after another")
    ap.add_argument("--with-fixed", action="store_true",
                    help="with --forced: also each choice's fixed-length program")
    ap.add_argument("--calibration-budgets", action="store_true",
                    help="with --calibration: 32-token runs against --new-tokens runs")
    ap.add_argument("--calibration-baseline", action="store_true",
                    help="with --calibration: the autoregressive program measured in the "
                         f"table's rounds against after it (default --json "
                         f"{os.path.relpath(CALIB_BASELINE_RESULTS, ROOT)})")
    ap.add_argument("--calibration-rounds", type=float, default=0.0, metavar="SECONDS",
                    help="with --calibration: three rounds against rounds added for up to "
                         "SECONDS, with the margins each would set (default --json "
                         f"{os.path.relpath(CALIB_ROUNDS_RESULTS, ROOT)})")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--append", action="store_true",
                    help="keep the runs already in --json (others than the ones measured now)")
    ap.add_argument("--json", default=RESULTS,
                    help=f"results file (default {os.path.relpath(RESULTS, ROOT)}; with "
                         f"--ar-branch {os.path.relpath(AR_RESULTS, ROOT)})")
    args = ap.parse_args(argv)
    if args.render_only:
        write_doc(json.load(open(args.json)))
        if os.path.exists(AR_RESULTS):
            write_ar_doc(json.load(open(AR_RESULTS)))
        if os.path.exists(FORCED_RESULTS):
            write_forced_doc(json.load(open(FORCED_RESULTS)))
        if os.path.exists(CALIB_RESULTS):
            write_calibration_doc(json.load(open(CALIB_RESULTS)))
        if os.path.exists(CALIB_BASELINE_RESULTS):
            write_calibration_baseline_doc(json.load(open(CALIB_BASELINE_RESULTS)))
        if os.path.exists(CALIB_ROUNDS_RESULTS):
            write_calibration_rounds_doc(json.load(open(CALIB_ROUNDS_RESULTS)))
        return 0
    if args.quick:
        args.drafters, args.temperatures, args.batch_sizes = ["eagle3", "ngram"], [0.0], [1]
        args.prompts, args.new_tokens = 4, 32
    from specjax.compile_cache import enable_compile_cache

    enable_compile_cache(None)
    if args.forced:
        res = forced(args.drafters, args.temperatures, args.batch_sizes, args.prompts,
                     args.new_tokens, repeats=args.repeats, with_fixed=args.with_fixed)
        save_results(FORCED_RESULTS if args.json == RESULTS else args.json, res,
                     FORCED_RESULTS, write_forced_doc)
        print(render_forced(res))
        return 0
    if args.calibration:
        res = calibration(args.drafters, args.temperatures, args.batch_sizes,
                          args.new_tokens, repeats=args.repeats,
                          budgets=args.calibration_budgets,
                          baseline=args.calibration_baseline,
                          more_rounds=args.calibration_rounds)
        canonical, writer = ((CALIB_ROUNDS_RESULTS, write_calibration_rounds_doc)
                             if args.calibration_rounds
                             else (CALIB_BASELINE_RESULTS, write_calibration_baseline_doc)
                             if args.calibration_baseline
                             else (CALIB_RESULTS, write_calibration_doc))
        save_results(canonical if args.json == RESULTS else args.json, res, canonical,
                     writer)
        print(render_calibration(res))
        return 0
    if args.ar_branch:
        res = ar_branch(args.drafters, args.batch_sizes, args.prompts, args.new_tokens,
                        args.repeats)
        save_results(AR_RESULTS if args.json == RESULTS else args.json, res, AR_RESULTS,
                     write_ar_doc)
        print(render_ar_branch(res))
        return 0
    res = measure(args.drafters, args.temperatures, args.batch_sizes, args.prompts,
                  args.new_tokens, sweep=not args.no_sweep, repeats=args.repeats,
                  stragglers=args.stragglers, table_ab=args.table_ab,
                  calibration_ab=args.calibration_ab, drift_ab=args.drift_ab,
                  aa=args.aa)
    if args.append and os.path.exists(args.json):
        def key(r):
            return r["drafter"], r["temperature"], r["batch"]
        new = {key(r) for r in res["runs"]}
        prev = json.load(open(args.json))
        # rows kept from the file keep the commit and date they were measured at
        old = [dict(r, git=r.get("git", prev["git"]), date=r.get("date", prev["date"]))
               for r in prev["runs"] if key(r) not in new]
        order = list(DRAFTERS)
        res["runs"] = sorted(old + res["runs"], key=lambda r: (
            order.index(r["drafter"]), r["temperature"], r["batch"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    save_results(args.json, res, RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
