"""Adaptive draft length, the in-loop policy (`decode.py --gamma auto`; docs/adaptive.md).

Every step of the speculative loop picks its draft length g from a static set of choices
(0 = a plain autoregressive step, up to the drafter's G) inside the one compiled
`lax.while_loop`: each choice is a branch with its own static shapes (g drafts, a verify
forward over g + 1 positions; `specjax.decoding.adaptive.loop`), so nothing recompiles.

The rule (`choose`) minimises the expected time to finish the batch, as if the
length chosen now were kept: a compiled batch runs until its last row is done and every
step costs the same for all rows, so the row with the most work left sets the pace:

    g* = argmin_g  cost(g) * max over active rows b of  remaining[b] / E_b(g)
    E_b(g) = 1 + sum_{k<g} prod_{j<=k} alpha[b, j]     (expected tokens of one step)

remaining[b] is row b's budget left. At batch 1 this is the most expected tokens per
millisecond, E(g) / cost(g).

alpha[b, j] is an exponential moving average of row b's per-position acceptance
(P(draft j accepted | drafts < j accepted)), updated after every step from what that
step observed (`observe`: positions j < g with tau >= j), starting from a prior.
Positions past the step's draft length g drift (`recover` per step) toward the larger of
the prior and alpha[b, g - 1], the deepest position the step could observe (the prior
alone after an autoregressive step); drafted positions behind a rejection keep their
value. The drift is what makes the schedule try again: without it, a row that chose
autoregressive steps would never observe acceptance again (n-gram lookup, whose drafts
fail until the text repeats, stayed autoregressive for good), and a row that chose a
short draft would never learn that deeper drafts are accepted as often as the first
ones (eagle3 on the demo settled at g = 3, 1.85x, when its fixed G = 7 gives 2.1x,
because its unobserved positions 3..6 sat at the prior 0.8 against a true 0.94). cost(g) is the measured
wall time of one loop step with draft length g at the engine's batch size (a cost
table, `AdaptiveEngine.calibrate` in specjax.decoding.adaptive.controller, cached on
disk or written by hand); it is
a run-time input of the compiled loop, so a new table needs no recompilation.

Verification is unchanged, so every schedule is lossless: greedy output equals
autoregressive decoding and sampled output follows the target's distribution whatever
the lengths chosen (tests drive the schedule adversarially with `policy="random"`).

Sources: the expected-tokens formula is the standard one (Leviathan et al. 2023, eq. 1,
with per-position instead of i.i.d. acceptance); choosing the length per step against
measured costs is what SGLang's `--speculative-adaptive` and vLLM's batch-size tables
aim at (SEEDS.md); the EMA and the cost table are this project's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.loop.extension import LoopExtension
from specjax.errors import SpecjaxError

POLICIES = ("auto", "random")


@dataclasses.dataclass(frozen=True)
class GammaSchedule(LoopExtension):
    """Static settings of an adaptive schedule (part of the compiled loop's key), and the
    loop extension that runs it (`LoopConfig.schedule`; `specjax.decoding.loop.extension`):
    it replaces the loop's step by a choice among steps of each draft length
    (`specjax.decoding.adaptive.loop`) and reports {"chosen": i32[n] steps at each choice,
    "alpha": f32[B,G] the acceptance estimates at the end (the next run can start from
    them)}.

    choices: sorted distinct draft lengths, 0 <= g <= G; 0 is an autoregressive step.
    policy: "auto" (the rule above) or "random" (uniform over the choices, from the
      loop's key: for tests of losslessness under any schedule).
    ema: weight of one new observation in alpha (0 < ema <= 1). 0.1: an acceptance
      rate of 0.8 then fluctuates by about 0.09 (standard deviation) from step to step;
      at 0.25 it was 0.15, and two rejections in a row sent a kv drafter with alpha_0 0.8
      into dozens of autoregressive steps.
    prior: alpha before any observation (optimistic: the schedule starts long and
      shortens where drafts are rejected).
    recover: per step, the share of the way that a position past the step's draft
      length moves toward its drift target (module docstring; 0: never).
    stragglers: count the spread of each row's step count (`finish_time`): a batch
      waits for its unluckiest row, and only speculation makes rows unlucky.
    confidence: a speculative step drafts the drafter's whole block first and then picks
      its verify length from the speculative choices by the same rule, with E_b(g) from
      the drafter's confidence in this step's drafts (`drafter.confidence(params, state,
      view, draft)` -> f32[B,G], its predicted per-position acceptance, e.g. DSpark's
      confidence head) in place of alpha; alpha still decides between an
      autoregressive and a speculative step, and learns from every step. For drafters
      that draft a block in one forward (its cost does not depend on the verify length).
    defer_update: autoregressive steps buffer the drafter's update and the drafter
      catches up in one update per G + 1 such steps, or before the next speculative step
      (`specjax.decoding.adaptive.loop.Deferred`); False: one update per autoregressive step
      (as before the buffer; kept for A/B measurements, benchmarks/adaptive.py
      --ar-branch).
    """

    choices: tuple[int, ...]
    policy: str = "auto"
    ema: float = 0.1
    prior: float = 0.8
    recover: float = 0.05
    stragglers: bool = False
    defer_update: bool = True
    confidence: bool = False

    def __post_init__(self):
        c = self.choices
        if not c or list(c) != sorted(set(c)) or c[0] < 0:
            raise ValueError(f"choices={c} must be sorted, distinct and >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: expected one of {POLICIES}")
        if not 0 < self.ema <= 1 or not 0 <= self.prior <= 1 or not 0 <= self.recover <= 1:
            raise ValueError(f"ema={self.ema} must be in (0, 1], prior={self.prior} and "
                             f"recover={self.recover} in [0, 1]")

    name = "adaptive"
    owns_step = True

    @property
    def gamma(self) -> int:
        """G, the longest choice."""
        return self.choices[-1]

    def check(self, cfg, drafter, tree_mode: bool) -> None:
        if cfg.num_drafts > 1:
            raise ValueError("an adaptive schedule drafts chains: num_drafts must be 1")
        if drafter is not None and hasattr(drafter, "propose_tree"):
            raise ValueError("an adaptive schedule drafts chains; this drafter proposes trees")
        if self.confidence and drafter is not None and not getattr(
                drafter, "has_confidence", False):
            raise ValueError("a confidence schedule needs a drafter with a confidence head")
        if self.confidence and not any(g > 0 for g in self.choices):
            raise ValueError("a confidence schedule needs a speculative choice")
        if drafter is not None and self.gamma > drafter.gamma:
            raise ValueError(f"schedule choices {self.choices} exceed the drafter's G "
                             f"{drafter.gamma}")

    def init(self, model, cfg, drafter, state, inputs):
        from specjax.decoding.adaptive.loop import init_adapt

        return init_adapt(self, model, cfg, drafter, state, inputs)

    def report(self, ext_state) -> dict:
        return {"chosen": ext_state.chosen, "alpha": ext_state.alpha}

    def phases(self, graphdef, drafter, cfg, inputs=None):
        from specjax.decoding.adaptive.loop import adaptive_phases

        return adaptive_phases(graphdef, drafter, cfg, inputs)[:2]


def calibration_batch(batches) -> int:
    """The index of the batch to calibrate the cost table on: the one whose mean prompt
    length (tokens) is the lower median over `batches` (lists of prompts, each a list of
    token ids; ties: the earliest). A step's cost and both prefills grow with the
    context, so a table priced on an unusually short or long batch misprices the rest
    (the first bundled prompt has 30 tokens, the others up to 384: docs/adaptive.md).
    Raises ValueError for no batches or an empty one."""
    if not batches or not all(batches):
        raise ValueError("calibration_batch needs non-empty batches")
    means = [sum(len(p) for p in b) / len(b) for b in batches]
    order = sorted(range(len(means)), key=lambda i: (means[i], i))
    return order[(len(order) - 1) // 2]


def default_choices(gamma: int) -> tuple[int, ...]:
    """The draft lengths `--gamma auto` chooses from for a drafter of draft length G: 0, 1,
    2, 3, 5 and G (those <= G). Each is a branch compiled into the loop, so the set is
    kept small."""
    if gamma < 1:
        raise SpecjaxError(f"--gamma auto needs a drafter with draft length >= 1, got {gamma}")
    return tuple(sorted({g for g in (0, 1, 2, 3, 5) if g <= gamma} | {gamma}))


@struct.dataclass
class AdaptState:
    """alpha f32[B,G]: per-row EMA of per-position acceptance; chosen i32[n]: steps taken
    at each choice (batch-level); deferred: the drafter update that autoregressive steps
    put off (`specjax.decoding.adaptive.loop.Deferred`; None where the loop updates every
    step)."""

    alpha: jax.Array
    chosen: jax.Array
    deferred: Any = None


def init_state(schedule: GammaSchedule, batch: int, alpha0=None) -> AdaptState:
    """The schedule's state before the first step: alpha = alpha0 (f32[G] or f32[B,G],
    e.g. the estimates a previous run ended with) broadcast to [B, G], or the prior."""
    G = max(schedule.gamma, 1)
    if alpha0 is None:
        alpha = jnp.full((batch, G), schedule.prior, jnp.float32)
    else:
        alpha = jnp.broadcast_to(jnp.asarray(alpha0, jnp.float32), (batch, G))
    return AdaptState(alpha=alpha, chosen=jnp.zeros((len(schedule.choices),), jnp.int32))


def _accepted_moments(alpha, choices: tuple[int, ...], xp=jnp):
    """(E[A], E[A^2]) [B,n] of the drafts A accepted in one step at each draft length g in
    `choices`: P(A >= k) = prod_{j<k} alpha[b, j] for k = 1..g, so E[A] = sum_k P(A >= k)
    and E[A^2] = sum_k (2k - 1) P(A >= k). `xp`: jax.numpy inside the loop, numpy on
    the host (`predicted_ms`: deciding a batch compiles nothing)."""
    reach = xp.cumprod(alpha, axis=1)  # [B,G]: P(A >= k + 1)
    k = xp.arange(1, alpha.shape[1] + 1, dtype=reach.dtype)
    zero = xp.zeros_like(reach[:, :1])
    m1 = xp.concatenate([zero, xp.cumsum(reach, axis=1)], axis=1)
    m2 = xp.concatenate([zero, xp.cumsum((2 * k - 1) * reach, axis=1)], axis=1)
    idx = xp.asarray(choices)
    return m1[:, idx], m2[:, idx]


def expected_tokens(alpha, choices: tuple[int, ...], xp=jnp):
    """f32[B,n]: expected tokens emitted by one step of each row at each draft length in
    `choices`: 1 + sum_{k<g} prod_{j<=k} alpha[b, j] (`xp` as in `_accepted_moments`)."""
    return 1.0 + _accepted_moments(alpha, choices, xp)[0]


def token_variance(alpha, choices: tuple[int, ...], xp=jnp):
    """f32[B,n]: the variance of the tokens one step emits at each draft length g,
    E[A^2] - E[A]^2 (`_accepted_moments`; `xp` as there)."""
    m1, m2 = _accepted_moments(alpha, choices, xp)
    return xp.maximum(m2 - m1 ** 2, 0.0)


def expected_max_normal(n) -> jax.Array:
    """f32[]: about E[max of n i.i.d. standard normals] (Blom's plotting position
    Phi^-1((n - 0.375) / (n + 0.25))); 0 for n <= 1."""
    n = jnp.maximum(jnp.asarray(n, jnp.float32), 1.0)
    return jnp.maximum(jax.scipy.special.ndtri((n - 0.375) / (n + 0.25)), 0.0)


def finish_time(alpha, choices: tuple[int, ...], costs, active, remaining,
                stragglers: bool = False) -> jax.Array:
    """f32[n]: the expected time to finish the batch at each draft length, kept fixed:
    costs[i] * max over active rows of steps_b(choices[i]) (costs f32[n] ms per step,
    active bool[B], remaining i32[B] tokens left), where steps_b(g) = remaining[b] /
    E_b(g), plus with `stragglers` z_n * sqrt(remaining[b] * Var_b(g) / E_b(g)^3): the
    renewal-theory spread of the steps a row needs (`token_variance`), scaled by the
    expected largest of n standard normals for n active rows (`expected_max_normal`),
    since the batch runs until its last row is done."""
    r = remaining[:, None].astype(jnp.float32)
    mu = expected_tokens(alpha, choices)  # [B,n]
    steps = r / mu
    if stragglers:
        z = expected_max_normal(jnp.sum(active))
        steps = steps + z * jnp.sqrt(r * token_variance(alpha, choices) / mu ** 3)
    steps = jnp.where(active[:, None], steps, 0.0)
    return costs * jnp.max(steps, axis=0)


def choose(schedule: GammaSchedule, state: AdaptState, costs, active, remaining,
           key) -> jax.Array:
    """i32[]: the index into `schedule.choices` of this step's draft length (the rule in
    the module docstring; policy "random": uniform, from `key`). costs: f32[n] ms per step
    at each choice (the cost table); active bool[B]; remaining i32[B] tokens left."""
    n = len(schedule.choices)
    if schedule.policy == "random":
        return jax.random.randint(key, (), 0, n, dtype=jnp.int32)
    t = finish_time(state.alpha, schedule.choices, costs, active, jnp.maximum(remaining, 1),
                    schedule.stragglers)
    return jnp.argmin(t).astype(jnp.int32)


def observe(schedule: GammaSchedule, state: AdaptState, index: int, drafted: int,
            tau, active) -> AdaptState:
    """The state after a step at choice `index` (static) that drafted `drafted` tokens and
    accepted tau i32[B] of them on the active rows bool[B]: positions j < drafted with
    tau >= j were reached; of those, j < tau were accepted. Positions j >= drafted of
    active rows move `recover` of the way toward max(prior, alpha[b, drafted - 1]) (after
    this step's update; the prior when drafted is 0); drafted but unreached positions and
    inactive rows keep their values."""
    G = state.alpha.shape[1]
    j = jnp.arange(G)[None, :]
    reached = (j < drafted) & (j <= tau[:, None]) & active[:, None]
    hit = (j < tau[:, None]).astype(jnp.float32)
    alpha = jnp.where(reached, (1 - schedule.ema) * state.alpha + schedule.ema * hit,
                      state.alpha)
    target = jnp.full((alpha.shape[0], 1), schedule.prior, jnp.float32)
    if drafted > 0:
        target = jnp.maximum(target, alpha[:, drafted - 1:drafted])
    drift = alpha + schedule.recover * (target - alpha)
    alpha = jnp.where((j >= drafted) & active[:, None], drift, alpha)
    return state.replace(alpha=alpha, chosen=state.chosen.at[index].add(1))


def fit_costs(choices: tuple[int, ...], measured) -> list[float]:
    """The cost table (ms per step at each choice) that `AdaptiveEngine.calibrate` keeps, from
    the `measured` ms: the speculative choices (g >= 1) replaced by the least-squares line
    a + b g through them (b >= 0: a falling fit is flat at their mean); an
    autoregressive choice (g = 0) keeps its measurement, capped at the line's value at
    the shortest speculative choice. One speculative choice keeps its measurement.

    Why a line: a step at draft length g runs g drafter forwards (chain drafters; one for
    block drafters) and one verify forward over g + 1 positions, each about linear in g on
    a CPU and at worst flat on an accelerator, while each measured entry carries timing
    noise of several percent. A table made non-decreasing entry by entry (the earlier
    rule) turned a noisy dip into equal prices for a long and a shorter draft, and the
    rule then always took the long one (block at batch 1: g = 5 and 7 both 15.4 ms, 197
    of 331 steps at g = 7, 0.98x against 1.06x for a fixed g = 2; docs/adaptive.md).

    Args: choices sorted distinct draft lengths; measured float[n] ms (> 0).
    Returns: float[n] ms, non-decreasing in g, all > 0.
    Raises: ValueError when the lengths differ or a measurement is not positive."""
    import numpy as np

    g = np.asarray(choices, np.float64)
    y = np.asarray(measured, np.float64)
    if g.shape != y.shape or not np.all(y > 0):
        raise ValueError(f"fit_costs: {len(choices)} choices against measured {list(y)} "
                         "(one positive ms per choice)")
    out = y.copy()
    spec = g > 0
    if spec.sum() >= 2:
        gs, ys = g[spec], y[spec]
        b = float(np.sum((gs - gs.mean()) * (ys - ys.mean())) / np.sum((gs - gs.mean()) ** 2))
        b = max(b, 0.0)
        a = ys.mean() - b * gs.mean()
        out[spec] = np.maximum(a + b * gs, ys.min() * 1e-3)
    if g[0] == 0 and spec.any():
        out[0] = min(y[0], out[spec][0])
    return out.tolist()


# ------------------------------------------------------- speculation or not, per batch

@dataclasses.dataclass(frozen=True)
class Baseline:
    """What a batch costs outside the speculative loop's per-step choice, measured by
    `AdaptiveEngine.calibrate` at the engine's batch size (ms, wall clock):

    prefill_ms: the speculative program's prefill (the target's and the drafter's, no
      loop step).
    ar_prefill_ms, ar_ms_per_step: the autoregressive program's prefill and one of its
      steps (the target alone: no drafter state, no per-step branch).

    The per-step rule cannot see these: the drafter's prefill is paid before the first
    step, and the loop's autoregressive branch (choice 0) carries the drafter's state and
    the branch, so it costs more than the autoregressive program's step (measured by
    `python benchmarks/adaptive.py --forced`). Where speculation cannot win back the
    difference, `speculation_pays` sends the whole batch to the autoregressive program.

    margin: the fraction of the autoregressive prediction by which speculation must be
      predicted to win, in [0, 1) (0: any predicted gain). `AdaptiveEngine.calibrate` sets it to
      the spread of repeated runs of one batch in the autoregressive program, each
      relative to the speculative runs of its calibration round (`measured_margin`;
      the machine's slow spells, which hit a round alike, divided out): a prediction closer
      than the timing noise is a coin toss, and the toss is not fair, since a wrong
      fallback loses at most the margin while a wrong speculation lost 20-30% at batch 32
      (docs/adaptive.md). Tables without it (older, or by hand) read as 0."""

    prefill_ms: float
    ar_prefill_ms: float
    ar_ms_per_step: float
    margin: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"Baseline.{f.name}={v!r} must be a number >= 0")
        if not self.margin < 1:
            raise ValueError(f"Baseline.margin={self.margin!r} must be < 1")


MARGIN_RANGE = (0.02, 0.25)  # measured_margin's clamp
# the fraction of the way back to the prior that the carried estimates move per batch run
# without the drafter (`drift_to_prior`)
FALLBACK_DRIFT = 0.25


def drift_to_prior(alpha, prior, rate: float = FALLBACK_DRIFT):
    """The carried estimates f32[G] after a batch that ran without the drafter: each moves
    `rate` of the way toward `prior` (a float, the schedule's optimistic prior, or f32[G],
    the acceptance the calibration observed: `AdaptiveEngine.alpha_calibrated`),
    alpha + rate (prior - alpha). Such a batch observes nothing; without the drift,
    estimates that once fell below break-even would send every later batch to the
    autoregressive program for good (block at batch 1 ran 12 of 16 batches so,
    docs/adaptive.md). With it the engine speculates again after a few batches where
    `prior` says speculation pays, and relearns; where it says it does not (batch 32 on
    this CPU; n-gram at T = 1 toward its calibrated acceptance), nothing changes.
    Returns float32 numpy."""
    import numpy as np

    a = np.asarray(alpha, np.float32)
    return a + np.float32(rate) * (np.asarray(prior, np.float32) - a)


# `calibration_spread` above which decode.py does not cache a table it measured: the
# rounds agree when they spread at most the margin's clamp (MARGIN_RANGE's 25%), the most
# noise the schedule's margin covers; a noisier table serves its own run only, and the next
# run measures again (docs/adaptive.md, "A busy machine's table is not cached")
NOISY_SPREAD = MARGIN_RANGE[1]


def calibration_spread(walls) -> float:
    """max / min - 1 of repeated walls of one batch (s, or relative to a reference
    measured beside each, as `AdaptiveEngine.calibrate` records them), unclamped; 0.0 for fewer
    than two walls. Raises ValueError for a wall that is not positive."""
    w = [float(x) for x in walls]
    if w and min(w) <= 0:
        raise ValueError(f"calibration_spread needs positive walls, got {walls!r}")
    return max(w) / min(w) - 1.0 if len(w) > 1 else 0.0


def measured_margin(walls) -> float:
    """`Baseline.margin` from repeated walls (s, or walls relative to a reference measured
    beside each: `AdaptiveEngine.calibrate`) of one and the same batch: their spread,
    max / min - 1, clamped to MARGIN_RANGE (at least 2%: two or three runs understate a
    spread, and one run shows none; at most 25%: a machine noisier than that needs a
    quieter calibration, not a rule that never speculates). Raises ValueError for no
    walls or one that is not positive."""
    w = [float(x) for x in walls]
    if not w or min(w) <= 0:
        raise ValueError(f"measured_margin needs positive walls, got {walls!r}")
    lo, hi = MARGIN_RANGE
    return min(max(max(w) / min(w) - 1.0, lo), hi)


def predicted_ms(alpha, choices: tuple[int, ...], costs, baseline: Baseline, budget: int,
                 rows: int) -> tuple[float, float]:
    """(speculative, autoregressive): the predicted wall time (ms) of a batch of `rows`
    rows generating `budget` tokens each, in float64 numpy (host side, before the run):

        speculative = prefill_ms + min_g cost(g) * (budget / E(g)
                                                    + z_rows * sqrt(budget Var(g) / E(g)^3))
        autoregressive = ar_prefill_ms + ar_ms_per_step * budget

    alpha f32[G] (the estimates the engine carries between runs, `AdaptiveEngine.alpha0`, or the
    schedule's prior); costs f32[n] ms per loop step at each choice; E and Var as in
    `expected_tokens` and `token_variance`; z_rows the expected largest of `rows`
    standard normals (the batch runs until its unluckiest row is done: `finish_time`
    with stragglers, whose estimates are within 6% of a simulation in
    tests/decoding/test_adaptive.py). The straggler term errs toward the autoregressive program,
    the direction in which a wrong call costs least. EOS is not modelled: both programs
    stop at the same rows' ends."""
    import statistics

    import numpy as np

    # in numpy, host side: deciding compiles nothing
    a = np.asarray(alpha, np.float64).reshape(1, -1)
    mu = expected_tokens(a, choices, xp=np)[0]
    var = token_variance(a, choices, xp=np)[0]
    n = max(float(rows), 1.0)  # expected_max_normal's Blom position, in float64
    z = max(statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)), 0.0)
    steps = budget / mu + z * np.sqrt(budget * var / mu ** 3)
    spec = baseline.prefill_ms + float(np.min(np.asarray(costs, np.float64) * steps))
    ar = baseline.ar_prefill_ms + baseline.ar_ms_per_step * budget
    return spec, ar


def speculation_pays(alpha, choices: tuple[int, ...], costs, baseline: Baseline,
                     budget: int, rows: int) -> bool:
    """True when the speculative program is predicted to finish the batch sooner than
    the autoregressive one (`predicted_ms`) by more than `baseline.margin` of the
    autoregressive prediction: spec < (1 - margin) * ar. Ties go to the autoregressive
    program."""
    spec, ar = predicted_ms(alpha, choices, costs, baseline, budget, rows)
    return spec < (1.0 - baseline.margin) * ar


def with_gamma(drafter, gamma: int):
    """The same drafter proposing `gamma` tokens: `drafter.with_gamma(gamma)` where a
    drafter defines it, else `dataclasses.replace(drafter, gamma=gamma)` (every drafter
    in specjax is a frozen dataclass whose state does not depend on G).

    Raises: SpecjaxError for a drafter that is neither."""
    if hasattr(drafter, "with_gamma"):
        return drafter.with_gamma(gamma)
    if dataclasses.is_dataclass(drafter) and any(
            f.name == "gamma" for f in dataclasses.fields(drafter)):
        return dataclasses.replace(drafter, gamma=gamma)
    raise SpecjaxError(f"--gamma auto: the drafter {type(drafter).__name__} cannot change its "
                       "draft length (define with_gamma)")
