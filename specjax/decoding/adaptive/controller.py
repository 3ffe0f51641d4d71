"""Adaptive draft length beside the engine (`decode.py --gamma auto`; docs/adaptive.md):
the host-side controller that drives one `specjax.decoding.engine.Engine` whose loop
carries the schedule (`GammaSchedule`, a loop extension), feeds it the schedule's
run-time inputs (the cost table and the acceptance estimates a run starts from),
calibrates the cost table and the baseline, decides per batch whether speculation pays
and otherwise runs the batch with an autoregressive `Engine`, carries the estimates
between runs, drifts them while batches fall back, and pools the drafter's acceptance.

    engine = make_engine(target, drafter=drafter, drafter_params=dparams,
                         schedule=GammaSchedule(default_choices(drafter.gamma)),
                         max_length=512, prompt_width=64, batch_size=4)
    batch = engine.run(prompts, max_new_tokens=128, key=jax.random.key(0))

`make_engine` returns a plain `Engine` without a schedule (or without a drafter), so a
caller needs no branch; an `AdaptiveEngine` runs, compiles and reports as an `Engine`
does (`run`, `compile`, `step_timing`, `cfg`, `gamma`, `batch_size`, ...).
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from specjax.decoding.adaptive import policy
from specjax.decoding.engine import BatchOutput, Engine

# AdaptiveEngine.calibrate's orders of runs (its docstring)
CALIBRATION_ORDERS = ("rounds", "ar last", "one after another")
# where the carried estimates drift while batches fall back (`AdaptiveEngine.drift_to`)
DRIFT_TARGETS = ("calibrated", "pooled", "prior")


def _counts(res, n: int):
    """(accepted f64[G], reached f64[G]) of a `LoopResult` (host arrays), summed over its
    first n rows."""
    return (np.asarray(res.accepted)[:n].sum(0).astype(np.float64),
            np.asarray(res.reached)[:n].sum(0).astype(np.float64))


def _acceptance(counts, where_unreached) -> np.ndarray:
    """f32[G]: accepted / reached per position of `counts` (`_counts`), and
    `where_unreached` (a scalar or f32[G]) at the positions never reached."""
    acc, reached = counts
    return np.where(reached > 0, acc / np.maximum(reached, 1),
                    where_unreached).astype(np.float32)


def make_engine(target, *, schedule=None, costs=None, baseline=None, alpha0=None,
                **engine_kw) -> Engine | AdaptiveEngine:
    """An `AdaptiveEngine` for a `schedule` (a `GammaSchedule`) with a drafter, else a
    plain `Engine` (`engine_kw`: `Engine`'s keywords; `costs`, `baseline` and `alpha0`
    are ignored then, as the schedule is without a drafter)."""
    if schedule is None or engine_kw.get("drafter") is None:
        return Engine(target, **engine_kw)
    return AdaptiveEngine(target, schedule=schedule, costs=costs, baseline=baseline,
                          alpha0=alpha0, **engine_kw)


class AdaptiveEngine:
    """Adaptive draft length: an `Engine` whose loop carries `schedule`, and the host-side
    decisions around it.

    Args:
      target, drafter, drafter_params, **engine_kw: as `Engine` (its loop gets the
        schedule as the `LoopConfig.schedule` extension; the engine is `self.engine`).
      schedule: a `specjax.decoding.adaptive.GammaSchedule`.
      costs: the schedule's cost table (ms per step per choice); None: `calibrate`
        measures one on the first batch `run` is given.
      baseline: a `specjax.decoding.adaptive.Baseline` (None: measured by `calibrate`
        with the table, or never where the table is given without one): it prices the
        batch without the drafter. A run whose batch `speculation_pays` says the
        autoregressive program finishes sooner runs that program instead
        (`fallback_engine()`, compiled on first use; `BatchOutput.fallback`).
      alpha0: f32[G] acceptance estimates the first run starts from (a cost table's
        `alpha`, `adaptive.read_alpha`), also the fallback's drift target
        (`alpha_calibrated`); None: the prior.

    Each run starts the schedule from `alpha0` f32[G], the acceptance estimates the
    previous run ended with (averaged over its rows; the schedule's prior before the
    first run), so a long job of many short batches does not relearn its drafter's
    acceptance every batch; `reset_schedule()` returns to the prior. A batch that runs
    without the drafter learns nothing; its estimates drift toward a target set by
    `drift_to`: "calibrated" (the default), the acceptance the calibration observed on
    its batch (`alpha_calibrated`, or the one the cost table recorded; the prior without
    either); "pooled", the drafter's acceptance pooled over every batch it has drafted for
    (`pooled`: sum accepted / sum reached per position, from the calibration's
    observation on; `alpha_calibrated` at positions never reached); "prior", the
    optimistic prior, which re-opens speculation every few batches even for a drafter
    whose acceptance does not pay. The last two are kept for A/B runs
    (`python benchmarks/adaptive.py --drift-ab`; docs/adaptive.md).

    Raises: ValueError without a drafter (`make_engine` returns a plain `Engine` then);
    what `Engine` raises (a schedule the loop refuses: with draft trees, partial
    verification or choices beyond the drafter's G).
    """

    def __init__(self, target, *, drafter, drafter_params=None, schedule, costs=None,
                 baseline=None, alpha0=None, **engine_kw):
        if drafter is None:
            raise ValueError("AdaptiveEngine needs a drafter (make_engine gives a plain "
                             "Engine without one)")
        self.schedule = schedule
        self.engine = Engine(target, drafter=drafter, drafter_params=drafter_params,
                             extensions={"schedule": schedule}, **engine_kw)
        self.costs = None if costs is None else np.asarray(costs, np.float32)
        self.measured_costs = None  # calibrate's table before adaptive.fit_costs
        self.calibration_rounds, self.calibration_relative = 0, []  # calibrate's record
        self.baseline = baseline
        # f32[G] carried between runs; None: the prior
        self.alpha0 = None if alpha0 is None else np.asarray(alpha0, np.float32)
        # f32[G]: the acceptance calibrate observed (or a table recorded), where the
        # estimates drift while batches fall back; None: the prior
        self.alpha_calibrated = None if alpha0 is None else np.asarray(alpha0, np.float32)
        # (accepted f64[G], reached f64[G]) summed over every run that drafted, from the
        # calibration's observation on; None before any
        self.pooled = None
        self.drift_to = "calibrated"  # or "pooled", "prior" (see the class docstring)
        self._fallback = None

    # what callers read from an Engine
    @property
    def cfg(self):
        return self.engine.cfg

    @property
    def gamma(self) -> int:
        return self.engine.gamma

    @property
    def batch_size(self) -> int:
        return self.engine.batch_size

    @property
    def drafter(self):
        return self.engine.drafter

    @property
    def drafter_params(self):
        return self.engine.drafter_params

    @property
    def params(self):
        return self.engine.params

    @property
    def mesh(self):
        return self.engine.mesh

    @property
    def compile_s(self) -> float:
        return self.engine.compile_s

    def step_timing(self, prompts: list[list[int]], max_new_tokens: int, key,
                    repeats: int = 5) -> dict:
        """`Engine.step_timing`: a step at the drafter's G."""
        return self.engine.step_timing(prompts, max_new_tokens, key, repeats=repeats)

    def run_phases(self, prompts, max_new_tokens, key):
        """Not for an adaptive schedule: raises ValueError (`Engine.run_phases`)."""
        raise ValueError("run_phases: a fixed draft length only (schedule None)")

    # the schedule's run-time inputs
    def _inputs(self, costs=None) -> dict:
        """The schedule's run-time inputs of the loop (`speculative_loop`'s `inputs`): the
        cost table (`costs` overriding `self.costs`: calibration) and the acceptance
        estimates it starts from."""
        if costs is not None:
            # f32 on the host first: staging an f64 array is another compiled program
            # (a new compile-cache entry for a run that only reads its table)
            costs = jnp.asarray(np.asarray(costs, np.float32))
        return {self.schedule.name: {"costs": self._costs() if costs is None else costs,
                                     "alpha0": self._alpha0()}}

    def _costs(self):
        if self.costs is None:  # compile-time placeholder; run() calibrates first
            return jnp.ones((len(self.schedule.choices),), jnp.float32)
        return jnp.asarray(self.costs)

    def _alpha0(self):
        sched = self.schedule
        if self.alpha0 is None:
            return jnp.full((max(sched.gamma, 1),), sched.prior, jnp.float32)
        # f32 on the host: a list or f64 array would be converted by a compiled program
        return jnp.asarray(np.asarray(self.alpha0, np.float32))

    def compile(self, key=None) -> float:
        """Compiles the engine's loop (`Engine.compile`, with the schedule's inputs);
        returns seconds spent (0 if done)."""
        return self.engine.compile(key, self._inputs())

    def run(self, prompts: list[list[int]], max_new_tokens: int, key) -> BatchOutput:
        """Generates for up to `batch_size` prompts in one compiled call: calibrates first
        without a cost table, runs the batch with `fallback_engine()` where speculation
        would not pay (`speculates`), else the engine's loop with the carried estimates,
        and carries what that run learned to the next one."""
        self.compile()
        if self.costs is None:
            self.calibrate(prompts, max_new_tokens, key)
        if not self.speculates(len(prompts), max_new_tokens):
            return self._run_fallback(prompts, max_new_tokens, key)
        out, res = self.engine.run_loop(prompts, max_new_tokens, key, self._inputs())
        n = len(prompts)
        report = res.ext[self.schedule.name]  # what this run learned seeds the next one
        self.alpha0 = report["alpha"][:n].mean(axis=0).astype(np.float32)
        acc, reached = _counts(res, n)
        self.pooled = ((acc, reached) if self.pooled is None else
                       (self.pooled[0] + acc, self.pooled[1] + reached))
        return dataclasses.replace(out, chosen=report["chosen"])

    def fallback_engine(self) -> Engine:
        """The autoregressive engine this one runs a batch with when speculation would not
        pay: the same target weights (shared, not copied), shapes, sampling and sharding,
        no drafter (`Engine.without_drafter`); compiled on first use."""
        if self._fallback is None:
            self._fallback = self.engine.without_drafter()
        return self._fallback

    def speculates(self, rows: int, max_new_tokens: int) -> bool:
        """Whether `run` uses the speculative program for a batch of `rows` prompts:
        always without a baseline (`calibrate`), a cost table or under the random
        policy; else `specjax.decoding.adaptive.speculation_pays` on the estimates this
        engine carries (`alpha0`, the prior before the first run) and its cost table."""
        sched = self.schedule
        if self.baseline is None or self.costs is None or sched.policy != "auto":
            return True
        return policy.speculation_pays(np.asarray(self._alpha0()), sched.choices,
                                       self.costs, self.baseline, max_new_tokens, rows)

    def reset_schedule(self) -> None:
        """Starts the next run's adaptive schedule from its prior again."""
        self.alpha0 = None

    def calibrate(self, prompts: list[list[int]], max_new_tokens: int, key,
                  repeats: int = 3, max_tokens: int = 32,
                  min_steps: int = 6, baseline: bool = True,
                  order: str = "rounds", seconds: float = 0.0,
                  max_repeats: int = 12) -> list[float]:
        """Measures the adaptive schedule's cost table, keeps it for the runs that follow,
        and returns it: ms per loop step at each choice, from this engine's own compiled
        loop (no other compilation) run on `prompts` with the schedule forced to one
        choice at a time (a table that makes every other choice infinitely dear):
        (wall - the prefill's wall) / loop iterations, each wall the fastest of `repeats`
        after one warm-up call (the least disturbed run: a median of two let one slow run
        in, and a cached table keeps its noise for good). The runs go in rounds, each
        round visiting every choice once, so a slow spell of the machine touches several
        choices a little rather than one choice in all its runs (measured one choice
        after another, a table once came out [10.6, 14.2, 16.0, 22.4, 20.3, 17.1] ms for
        g = 0, 1, 2, 3, 5, 7). A prefill run precedes each run (a spike hits both alike);
        the prefill's wall is the fastest of all of them, and a choice whose difference
        is not positive is measured again (up to twice more). Each run generates
        min(max_new_tokens, max(max_tokens, min_steps * (g + 1))) tokens at draft length
        g (a step's cost hardly depends on how many follow it; the cap bounds each run, yet
        a whole calibration at batch 32 took 3.5-12 minutes on the 2-core CPU, 5-8 s at
        batch 1: `benchmarks/results/adaptive.json`, and min_steps keeps long drafts from being timed
        over two or three iterations); the prefill's wall comes from runs with a budget of
        one token (no loop iteration). A busy machine still skews the table: measure it
        on a quiet one (decode.py caches it). The table kept is `adaptive.fit_costs` of the
        measured one (a line through the speculative choices; the measured table stays in
        `measured_costs`).
        With `baseline` (the default, as decode.py), the autoregressive program (compiled
        here) is one more stop of every round, for `self.baseline` (`adaptive.Baseline`,
        used by `speculates`): its prefill and step, measured as the table is, each of its
        runs after a prefill run of each program (the speculative prefill's minimum over
        those runs only, so the two prefills' minima have as many draws). Its margin
        (`adaptive.measured_margin`) is the spread over the rounds of its wall divided by
        the geometric mean of the same round's speculative walls, so a slow spell that
        hits a whole round divides out (the plain spread of its walls for the other
        orders). The fallback compares the table with this step, so both come from the
        same spells of the machine (before git 4d1f7d7 the step was measured after the
        table: docs/adaptive.md, "The baseline in the same rounds"). Without `baseline`
        every batch runs the speculative program.
        Without carried estimates (`alpha0` None: the first calibration, or after
        `reset_schedule`), the warm-up run at the longest draft also sets `alpha0` to the
        batch's observed per-position acceptance (`_observed_alpha`), so the first run
        starts from the drafter's measured acceptance, not the prior (0.8 everywhere;
        from it, eagle3 at batch 1 ran every batch autoregressively: docs/adaptive.md).
        `order` (kept for A/B measurements, benchmarks/adaptive.py --calibration):
        "rounds" (the default, above); "ar last": the choices in rounds, then the
        autoregressive program's runs (the order before git 4d1f7d7); "one after
        another": every stop's runs together, the autoregressive program last (the order
        before the rounds).
        `seconds` (0, the default, as decode.py): after the `repeats` rounds, more rounds,
        up to `max_repeats` in all, while the rounds so far, at their mean duration, leave
        room for one more within `seconds` of measuring (cheap at small batches, none at
        large ones). Measured at batch 1 on a 2-core CPU (7-11 rounds in 20 s), it did not
        make the table/step ratio repeatable between calibrations (docs/adaptive.md,
        "More rounds"), so it is off. `calibration_rounds` records how many rounds ran and
        `calibration_relative` each round's autoregressive wall / geometric mean of its
        speculative walls (order "rounds" with `baseline`; the margin's input).
        Raises ValueError for another order, or for seconds < 0 or max_repeats < repeats."""
        if seconds < 0 or max_repeats < repeats:
            raise ValueError(f"calibrate: seconds {seconds} must be >= 0 and max_repeats "
                             f"{max_repeats} >= repeats {repeats}")
        if order not in CALIBRATION_ORDERS:
            raise ValueError(f"calibrate: order {order!r} is not one of {CALIBRATION_ORDERS}")
        self.compile()
        choices = self.schedule.choices
        n = len(choices)
        AR = n  # the autoregressive program's stop in the rounds
        ones = np.ones(n)

        def timed(costs, budget):
            return self._timed(prompts, budget, key, costs)

        timed(ones, 1)  # warm-up
        forced, budgets = [], []
        for i, g in enumerate(choices):
            forced.append(np.where(np.arange(n) == i, 1.0, 1e30))
            budgets.append(min(max_new_tokens, max(max_tokens, min_steps * (g + 1))))
            if g == max(choices) and g > 0 and self.alpha0 is None:
                # the warm-up at the longest draft reaches every position: the batch's
                # acceptance seeds the first run's estimates in place of the prior
                self.alpha0, self.pooled = self._observed_alpha(prompts, budgets[i], key,
                                                                forced[i])
                self.alpha_calibrated = self.alpha0.copy()
            else:
                timed(forced[i], budgets[i])  # warm-up
        ar_budget = min(max_new_tokens, max_tokens)
        if baseline:
            fb = self.fallback_engine()
            fb.compile()
            fb.timed(prompts, ar_budget, key)  # warm-up
        pre, full, iters = [], [[] for _ in range(n + 1)], [1] * (n + 1)
        pre_sp, pre_ar = [], []  # the prefills measured beside the autoregressive runs
        relative = []  # order "rounds": each AR wall / its round's speculative walls

        def rounds(which, times=repeats):
            if order == "one after another":
                runs = [i for i in which for _ in range(times)]
            else:
                last = [AR] if order == "ar last" and AR in which else []
                runs = ([i for _ in range(times) for i in which if i not in last]
                        + last * times)
            own = []  # this round's speculative walls (order "rounds": AR comes last)
            for k, i in enumerate(runs):  # in rounds over the stops: a spell is shared
                if k % len(which) == 0:
                    own = []
                pre.append(timed(ones, 1)[0])  # interleaved: a spike hits both alike
                if i == AR:
                    pre_sp.append(pre[-1])
                    pre_ar.append(fb.timed(prompts, 1, key)[0])
                    t, iters[i] = fb.timed(prompts, ar_budget, key)
                    if order == "rounds" and own and len(which) == len(stops):
                        relative.append(t / float(np.exp(np.mean(np.log(own)))))
                else:
                    t, iters[i] = timed(forced[i], budgets[i])
                    own.append(t)
                full[i].append(t)

        def floor(i):
            return min(pre_ar) if i == AR else min(pre)

        stops = [*range(n), AR] if baseline else list(range(n))
        t_rounds = time.perf_counter()
        rounds(stops)
        done = repeats
        while seconds > 0 and done < max_repeats:  # more rounds where they are cheap
            per_round = (time.perf_counter() - t_rounds) / done
            if (done + 1) * per_round > seconds:
                break
            rounds(stops, 1)
            done += 1
        self.calibration_rounds, self.calibration_relative = done, list(relative)
        for _ in range(2):  # a load spike can make a difference <= 0: measure it again
            redo = [i for i in stops if min(full[i]) <= floor(i)]
            if not redo:
                break
            rounds(redo)
        ms = [1e3 * max(min(full[i]) - floor(i), 1e-6) / max(iters[i], 1) for i in stops]
        # one line through the speculative choices: entry-by-entry noise misleads the rule
        self.measured_costs = ms[:n]
        fitted = policy.fit_costs(choices, ms[:n])
        self.costs = np.asarray(fitted, np.float32)
        if baseline:
            self.baseline = policy.Baseline(
                prefill_ms=1e3 * min(pre_sp), ar_prefill_ms=1e3 * min(pre_ar),
                ar_ms_per_step=ms[AR], margin=policy.measured_margin(relative or full[AR]))
        return fitted

    def _observed_alpha(self, prompts, budget, key, costs):
        """(alpha f32[G], counts) of one run (costs: the cost table it runs with): the
        per-position acceptance pooled over the prompts' rows, sum accepted[k] / sum
        reached[k] (`LoopResult`; the schedule's prior where position k was never
        reached), and those sums (`_counts`)."""
        _, res = self.engine.run_loop(prompts, budget, key, self._inputs(costs))
        counts = _counts(res, len(prompts))
        return _acceptance(counts, self.schedule.prior), counts

    def _timed(self, prompts, budget, key, costs=None) -> tuple[float, int]:
        """(seconds, loop iterations) of one run of the engine's compiled loop with the
        cost table `costs` (None: `self.costs`): `Engine.timed`."""
        return self.engine.timed(prompts, budget, key, self._inputs(costs))

    def _run_fallback(self, prompts, max_new_tokens, key) -> BatchOutput:
        """The batch through `fallback_engine()`, reported in this engine's shapes: no
        drafts (accepted and reached zeros [rows, G], chosen zeros), fallback True.
        Nothing is drafted, so nothing is learned: the carried estimates drift toward
        `drift_target()` (by default the acceptance the calibration observed:
        `adaptive.drift_to_prior`), so that a later batch probes the drafter again where
        that acceptance says speculation pays, and does not where it says it does not
        (the optimistic prior re-opened speculation every few batches for n-gram at
        T = 1, whose acceptance is 0.08: docs/adaptive.md).
        Raises ValueError for a `drift_to` not in DRIFT_TARGETS."""
        out = self.fallback_engine().run(prompts, max_new_tokens, key)
        if self.alpha0 is not None:
            self.alpha0 = policy.drift_to_prior(self.alpha0, self.drift_target())
        n, G = len(prompts), max(self.gamma, 1)
        zeros = np.zeros((n, G), np.int32)
        return dataclasses.replace(
            out, accepted=zeros, reached=zeros,
            chosen=np.zeros((len(self.schedule.choices),), np.int32),
            verified=None if self.cfg.partial is None else np.zeros((2,), np.int32),
            reused=None if not getattr(self.drafter, "reuse", False) else np.zeros((4,), np.int32),
            fallback=True)

    def drift_target(self):
        """Where the carried estimates drift while batches fall back (f32[G], or the
        prior as a float), by `drift_to` (see the class docstring). Raises ValueError for
        a `drift_to` not in DRIFT_TARGETS."""
        if self.drift_to not in DRIFT_TARGETS:
            raise ValueError(f"drift_to={self.drift_to!r} must be one of {DRIFT_TARGETS}")
        prior = self.schedule.prior
        if self.drift_to == "prior":
            return prior
        G = max(self.gamma, 1)
        base = (np.full(G, prior, np.float32) if self.alpha_calibrated is None
                else np.asarray(self.alpha_calibrated, np.float32))
        if self.drift_to == "calibrated" or self.pooled is None:
            return base
        return _acceptance(self.pooled, base)
