"""Host-side driver: pads prompts into fixed-shape batches, compiles each loop once,
runs it, and turns the loop's counters into tau and alpha_k (docs/design.md section 7).

    engine = Engine(target, drafter=drafter, drafter_params=dparams,
                    sampling=SamplingParams(), verify="block", max_length=512,
                    prompt_width=64, batch_size=4, eos_token_ids=(0,))
    batch = engine.run(prompts, max_new_tokens=128, key=jax.random.key(0))

One compiled program serves every batch with the same static settings; the first
call compiles (timed separately in `compile_s`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.decoding.kernel_policy import resolve_kernels
from specjax.decoding.loop import LoopConfig, autoregressive_loop, phase_programs, speculative_loop
from specjax.decoding.timing import step_timing
from specjax.errors import SpecjaxError
from specjax.models.model import decoding_params


def prompt_width_for(longest: int, max_length: int, multiple: int = 16) -> int:
    """Tp: the longest prompt rounded up to `multiple` (so nearby prompt sets share one
    compiled shape), at most `max_length`."""
    return min(max_length, -(-longest // multiple) * multiple)


@dataclasses.dataclass
class BatchOutput:
    """outputs: new token ids per real row; steps: target forwards after the prefill per
    row (i32[B]); accepted: i32[B,G] accepted drafts per draft position; wall_s: run
    time without compilation (seconds); reached: i32[B,G] steps that drafted position k
    with drafts < k accepted (None: every step drafted G); chosen: i32[n] steps at each
    draft length of an adaptive schedule (None without one); verified: i32[2] steps
    verified in full and partially under partial verification (None without it);
    reused: i32[4] drafted hidden states reused from the previous step's chain and
    drafted in all (over rows), draft forwards skipped and in all (None unless the
    drafter reuses, medc `--draft-reuse`; `specjax.drafters.eagle3.DraftChain`);
    fallback: True where an adaptive engine ran the batch with its autoregressive
    program (`specjax.decoding.adaptive.speculation_pays` was False)."""

    outputs: list[list[int]]
    steps: np.ndarray
    accepted: np.ndarray
    wall_s: float
    reached: np.ndarray | None = None
    chosen: np.ndarray | None = None
    verified: np.ndarray | None = None
    reused: np.ndarray | None = None
    fallback: bool = False


@dataclasses.dataclass
class Stats:
    """Totals over batches; `tau` and `alpha` follow docs/design.md section 7."""

    new_tokens: int = 0
    wall_s: float = 0.0
    compile_s: float = 0.0
    steps: int = 0
    accepted: np.ndarray | None = None  # i64[G]
    reached: np.ndarray | None = None  # i64[G]
    chosen: np.ndarray | None = None  # i64[n] steps per draft length (adaptive schedule)
    verified: np.ndarray | None = None  # i64[2] full / partial steps (partial verification)
    reused: np.ndarray | None = None  # i64[4] as BatchOutput.reused (medc reuse)
    batches: int = 0
    fallback_batches: int = 0  # batches an adaptive engine ran autoregressively

    def add(self, batch: BatchOutput):
        self.batches += 1
        self.fallback_batches += int(batch.fallback)
        self.new_tokens += sum(len(o) for o in batch.outputs)
        self.wall_s += batch.wall_s
        self.steps += int(batch.steps.sum())
        acc = batch.accepted.sum(axis=0).astype(np.int64)
        self.accepted = acc if self.accepted is None else self.accepted + acc
        if batch.reached is not None:
            r = batch.reached.sum(axis=0).astype(np.int64)
            self.reached = r if self.reached is None else self.reached + r
        if batch.chosen is not None:
            c = np.asarray(batch.chosen, np.int64)
            self.chosen = c if self.chosen is None else self.chosen + c
        if batch.verified is not None:
            v = np.asarray(batch.verified, np.int64)
            self.verified = v if self.verified is None else self.verified + v
        if batch.reused is not None:
            u = np.asarray(batch.reused, np.int64)
            self.reused = u if self.reused is None else self.reused + u

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def alpha(self) -> list[float | None]:
        """alpha_k = P(draft k accepted | drafts < k accepted), k = 0..G-1; None where no
        step reached position k."""
        if self.accepted is None or self.steps == 0:
            return []
        reached = self.reached
        if reached is None:  # every step drafted G
            reached = np.concatenate([[self.steps], self.accepted[:-1]])
        return [float(a / r) if r else None for a, r in zip(self.accepted, reached, strict=True)]

    @property
    def tau(self) -> float:
        """Mean tokens per verification step, bonus included: 1 + accepted / steps."""
        if self.accepted is None or self.steps == 0:
            return float("nan")
        return 1.0 + float(self.accepted.sum()) / self.steps


def _drafter_heads(drafter, params, target_cfg) -> tuple[int, int]:
    """(N, K) of a drafter's attention: its config's, a draft LM's own model's, else the
    target's (n-gram has no weights)."""
    cfg = getattr(drafter, "cfg", None)
    if cfg is None and hasattr(drafter, "graphdef"):
        cfg = nnx.merge(drafter.graphdef, params).cfg
    cfg = cfg if hasattr(cfg, "num_kv_heads") else target_cfg
    return cfg.num_heads, cfg.num_kv_heads


# Engine.calibrate's orders of runs (its docstring)
CALIBRATION_ORDERS = ("rounds", "ar last", "one after another")
# where the carried estimates drift while batches fall back (`Engine.drift_to`)
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


class Engine:
    """Runs autoregressive (drafter=None) or speculative generation in fixed-shape batches.

    Args:
      target: the target `Transformer`.
      drafter, drafter_params: a Drafter (see specjax.core.drafter) and its params, or
        None for autoregressive decoding.
      sampling: SamplingParams for target and drafter.
      verify: "token" or "block" (greedy is used at temperature 0).
      max_length: prompt + new tokens per row, at most.
      prompt_width: padded prompt width Tp (>= the longest prompt).
      batch_size: rows per compiled batch; short batches are padded with empty rows.
      eos_token_ids: ids that end a row (empty for --ignore-eos).
      layer_loop: "auto", "scan" or "unroll" (see `specjax.models.model.decoding_params`).
      kernels: verification path, see `specjax.decoding.kernel_policy.resolve_kernels`.
      mesh: None (one device) or a (data, fsdp, model) mesh (`specjax.decoding.sharding.decode_mesh`):
        the target's and the drafter's weights and the KV cache are sharded over `model`,
        rows over `data` x `fsdp` (`batch_size` must split evenly).
      prefill_chunk, prefill_min_chunk: the prefill's largest and smallest pieces (see
        `LoopConfig`); None: the backend's defaults.
      num_drafts: drafts per step, verified as one draft tree when > 1 (see `LoopConfig`).
      schedule: None (draft G every step) or a `specjax.decoding.adaptive.GammaSchedule`
        (adaptive draft length); its cost table is `costs` (ms per step per choice; None:
        `calibrate` measures one on the first batch). Each run starts the schedule from
        `alpha0` f32[G], the acceptance estimates the previous run ended with (averaged
        over its rows; the schedule's prior before the first run), so a long job of many
        short batches does not relearn its drafter's acceptance every batch;
        `reset_schedule()` returns to the prior. A batch that runs without the drafter
        (below) learns nothing; its estimates drift toward a target set by `drift_to`:
        "calibrated" (the default), the acceptance the calibration observed on its batch
        (`alpha_calibrated`, or the one the cost table recorded; the prior without
        either); "pooled", the drafter's acceptance pooled over every batch it has
        drafted for (`pooled`: sum accepted / sum reached per position, from the
        calibration's observation on; `alpha_calibrated` at positions never reached);
        "prior", the optimistic prior, which re-opens speculation every few batches even
        for a drafter whose acceptance does not pay. The last two are kept for A/B runs
        (`python benchmarks/adaptive.py --drift-ab`; docs/adaptive.md). `baseline`
        (`specjax.decoding.adaptive.Baseline`; None: measured by `calibrate` with the
        table, or never where the table is given without one) prices the batch without
        the drafter: a run whose batch `speculation_pays` says the autoregressive program
        finishes sooner runs that program instead (compiled on first use;
        `BatchOutput.fallback`).
      partial: None, or a `specjax.decoding.partial.PartialVerify`: SpecPV partial
        verification, LOSSY (a drafter with one chain of fixed length; ignored without a
        drafter).

    Raises: SpecjaxError for a batch size below 1 or one the mesh's data axis does not
    divide.
    """

    def __init__(self, target, *, drafter=None, drafter_params=None,
                 sampling: SamplingParams = SamplingParams(), verify="block",
                 max_length: int, prompt_width: int, batch_size: int = 1,
                 eos_token_ids: tuple[int, ...] = (), layer_loop: str = "auto",
                 kernels: str = "auto", mesh=None, prefill_chunk: int | None = None,
                 prefill_min_chunk: int | None = None, num_drafts: int = 1,
                 schedule=None, costs=None, baseline=None, partial=None):
        if batch_size < 1:
            raise SpecjaxError(f"--batch-size={batch_size} must be >= 1")
        self._fallback = None
        self.graphdef, self.params = nnx.split(target)
        self.params = decoding_params(self.params, layer_loop)
        self.vocab_size = target.cfg.vocab_size
        self.drafter, self.drafter_params = drafter, drafter_params
        self.mesh = mesh
        cache_sharding = None
        if mesh is not None:
            from specjax.decoding import sharding

            c = target.cfg
            sharding.check_batch(mesh, batch_size)
            self.params = sharding.shard_params(mesh, self.params, c.num_heads, c.num_kv_heads)
            if drafter is not None:
                n, k = _drafter_heads(drafter, drafter_params, c)
                self.drafter_params = sharding.shard_params(mesh, drafter_params, n, k)
            gamma = drafter.gamma if drafter is not None else 0
            if hasattr(drafter, "propose_tree"):
                nodes = drafter.tree_nodes
            else:
                nodes = gamma + 1 if num_drafts == 1 else 1 + num_drafts * gamma
            shape = (c.num_layers, batch_size, c.num_kv_heads, max_length + nodes,
                     c.head_dim)
            cache_sharding = sharding.cache_sharding(mesh, shape, c.num_heads)
        self.cfg = LoopConfig(max_length=max_length, prompt_width=prompt_width,
                              sampling=sampling, eos_token_ids=tuple(eos_token_ids),
                              verify=verify, kernels=resolve_kernels(kernels),
                              cache_sharding=cache_sharding, prefill_chunk=prefill_chunk,
                              prefill_min_chunk=prefill_min_chunk, num_drafts=num_drafts,
                              schedule=schedule if drafter is not None else None,
                              partial=partial if drafter is not None else None)
        self.costs = None if costs is None else np.asarray(costs, np.float32)
        self.measured_costs = None  # calibrate's table before adaptive.fit_costs
        self.calibration_rounds, self.calibration_relative = 0, []  # calibrate's record
        self.baseline = baseline
        self.alpha0 = None  # f32[G] carried between runs (adaptive schedule)
        # f32[G]: the acceptance calibrate observed (or a table recorded), where the
        # estimates drift while batches fall back; None: the prior
        self.alpha_calibrated = None
        # (accepted f64[G], reached f64[G]) summed over every run that drafted, from the
        # calibration's observation on; None before any
        self.pooled = None
        self.drift_to = "calibrated"  # or "pooled", "prior" (see the class docstring)
        self.batch_size = batch_size
        self.compiled = None
        self._phases = None  # `run_phases`' two programs, compiled on first use
        self.compile_s = 0.0

    @property
    def gamma(self) -> int:
        return self.drafter.gamma if self.drafter is not None else 0

    def _arrays(self, prompts, max_new_tokens):
        B, Tp = self.batch_size, self.cfg.prompt_width
        if len(prompts) > B:
            raise ValueError(f"{len(prompts)} prompts for a batch of {B}")
        tokens = np.zeros((B, Tp), np.int32)
        lengths = np.ones((B,), np.int32)
        budgets = np.zeros((B,), np.int32)
        for b, ids in enumerate(prompts):
            if not 1 <= len(ids) <= Tp:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit width {Tp}")
            tokens[b, :len(ids)] = ids
            lengths[b] = len(ids)
            budgets[b] = max_new_tokens
        if self.mesh is None:
            return jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(budgets)
        from specjax.decoding.sharding import rows_sharding

        return tuple(jax.device_put(a, rows_sharding(self.mesh, a.shape))
                     for a in (tokens, lengths, budgets))

    def _fn_args(self, args):
        if self.drafter is None:
            return autoregressive_loop, (self.graphdef, self.params, self.cfg, *args)
        return speculative_loop, (self.graphdef, self.params, self.drafter, self.drafter_params,
                                  self.cfg, *args)

    def _dynamic(self, args, costs=None):
        """The compiled loop's arguments; `costs` overrides the cost table (calibration)."""
        if self.drafter is None:
            return (self.params, *args)
        if self.cfg.schedule is not None:
            # f32 on the host first: staging an f64 array is another compiled program
            # (a new compile-cache entry for a run that only reads its table)
            costs = (self._costs() if costs is None
                     else jnp.asarray(np.asarray(costs, np.float32)))
            return (self.params, self.drafter_params, *args, self._inputs(costs))
        return (self.params, self.drafter_params, *args)

    def _inputs(self, costs=None) -> dict:
        """The adaptive schedule's run-time inputs of the loop (`speculative_loop`'s
        `inputs`): the cost table and the acceptance estimates it starts from."""
        return {"adaptive": {"costs": self._costs() if costs is None else costs,
                             "alpha0": self._alpha0()}}

    def _costs(self):
        if self.costs is None:  # compile-time placeholder; run() calibrates first
            return jnp.ones((len(self.cfg.schedule.choices),), jnp.float32)
        return jnp.asarray(self.costs)

    def _alpha0(self):
        sched = self.cfg.schedule
        if self.alpha0 is None:
            return jnp.full((max(sched.gamma, 1),), sched.prior, jnp.float32)
        # f32 on the host: a list or f64 array would be converted by a compiled program
        return jnp.asarray(np.asarray(self.alpha0, np.float32))

    def fallback_engine(self) -> Engine:
        """The autoregressive engine an adaptive engine runs a batch with when speculation
        would not pay: the same target weights (shared, not copied), shapes, sampling and
        sharding, no drafter; compiled on first use."""
        if self._fallback is None:
            import copy

            fb = copy.copy(self)
            fb.drafter = fb.drafter_params = None
            fb.cfg = dataclasses.replace(self.cfg, schedule=None, partial=None, num_drafts=1)
            fb.compiled, fb.compile_s = None, 0.0
            fb.costs = fb.baseline = fb.alpha0 = fb.alpha_calibrated = fb._fallback = None
            fb.pooled = None
            self._fallback = fb
        return self._fallback

    def speculates(self, rows: int, max_new_tokens: int) -> bool:
        """Whether `run` uses the speculative program for a batch of `rows` prompts:
        always without an adaptive schedule, a baseline (`calibrate`) or under the random
        policy; else `specjax.decoding.adaptive.speculation_pays` on the estimates this
        engine carries (`alpha0`, the prior before the first run) and its cost table."""
        sched = self.cfg.schedule
        if sched is None or self.baseline is None or self.costs is None or sched.policy != "auto":
            return True
        from specjax.decoding import adaptive

        return adaptive.speculation_pays(np.asarray(self._alpha0()), sched.choices,
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
        g (a step's cost hardly depends on how many follow it; the cap keeps a batch of 32
        near a minute on a 2-core CPU, and min_steps keeps long drafts from being timed
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
        Raises ValueError without a schedule, for another order, or for seconds < 0 or
        max_repeats < repeats."""
        if self.cfg.schedule is None:
            raise ValueError("calibrate needs an adaptive schedule")
        if seconds < 0 or max_repeats < repeats:
            raise ValueError(f"calibrate: seconds {seconds} must be >= 0 and max_repeats "
                             f"{max_repeats} >= repeats {repeats}")
        if order not in CALIBRATION_ORDERS:
            raise ValueError(f"calibrate: order {order!r} is not one of {CALIBRATION_ORDERS}")
        self.compile()
        choices = self.cfg.schedule.choices
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
            fb._timed(prompts, ar_budget, key)  # warm-up
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
                    pre_ar.append(fb._timed(prompts, 1, key)[0])
                    t, iters[i] = fb._timed(prompts, ar_budget, key)
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
        from specjax.decoding import adaptive

        self.measured_costs = ms[:n]
        fitted = adaptive.fit_costs(choices, ms[:n])
        self.costs = np.asarray(fitted, np.float32)
        if baseline:
            self.baseline = adaptive.Baseline(
                prefill_ms=1e3 * min(pre_sp), ar_prefill_ms=1e3 * min(pre_ar),
                ar_ms_per_step=ms[AR], margin=adaptive.measured_margin(relative or full[AR]))
        return fitted

    def _observed_alpha(self, prompts, budget, key, costs):
        """(alpha f32[G], counts) of one run (costs: the cost table it runs with): the
        per-position acceptance pooled over the prompts' rows, sum accepted[k] / sum
        reached[k] (`LoopResult`; the schedule's prior where position k was never
        reached), and those sums (`_counts`)."""
        res = self._call((*self._arrays(prompts, budget), key), costs)
        counts = _counts(res, len(prompts))
        return _acceptance(counts, self.cfg.schedule.prior), counts

    def _call(self, args, costs=None):
        """The `LoopResult` of one compiled run (compiled already) on `args` = (prompt
        arrays..., key) from `_arrays`, `costs` overriding the cost table."""
        return jax.block_until_ready(self.compiled(*self._dynamic(args, costs)))

    def _timed(self, prompts, budget, key, costs=None) -> tuple[float, int]:
        """(seconds, loop iterations) of one compiled run (`_call`; the prompts are
        staged before the clock starts)."""
        args = (*self._arrays(prompts, budget), key)
        t0 = time.perf_counter()
        res = self._call(args, costs)
        return time.perf_counter() - t0, int(np.asarray(res.steps).max())

    def compile(self, key=None) -> float:
        """Compiles the loop for this engine's shapes; returns seconds spent (0 if done)."""
        if self.compiled is not None:
            return 0.0
        key = jax.random.key(0) if key is None else key
        args = (*self._arrays([], 1), key)
        fn, full = self._fn_args(args)
        if self.drafter is not None and self.cfg.schedule is not None:
            full = (*full, self._inputs())
        t0 = time.perf_counter()
        self.compiled = fn.lower(*full).compile()
        self.compile_s = time.perf_counter() - t0
        return self.compile_s

    def run(self, prompts: list[list[int]], max_new_tokens: int, key) -> BatchOutput:
        """Generates for up to `batch_size` prompts (lists of token ids) in one compiled call."""
        self.compile()
        if self.cfg.schedule is not None and self.costs is None:
            self.calibrate(prompts, max_new_tokens, key)
        if not self.speculates(len(prompts), max_new_tokens):
            return self._run_fallback(prompts, max_new_tokens, key)
        args = (*self._arrays(prompts, max_new_tokens), key)
        t0 = time.perf_counter()
        res = self.compiled(*self._dynamic(args))
        res = jax.tree.map(np.asarray, jax.block_until_ready(res))
        return self._output(res, len(prompts), time.perf_counter() - t0)

    def run_phases(self, prompts: list[list[int]], max_new_tokens: int, key
                   ) -> tuple[BatchOutput, float, float]:
        """`run`, with the loop compiled as two programs (`generate.phase_programs`, on
        first use) so that the prefill and the decoding are timed apart: (the output, its
        `wall_s` the sum of both; prefill seconds; decode seconds). For benchmarks at long
        context, where the prefill's spread between runs exceeds the decode's time.
        Raises ValueError for an adaptive schedule (fixed draft length only)."""
        if self.drafter is not None and self.cfg.schedule is not None:
            raise ValueError("run_phases: a fixed draft length only (schedule None)")
        args = (*self._arrays(prompts, max_new_tokens), key)
        if self._phases is None:
            self._phases = phase_programs(self.graphdef, self.params, self.drafter,
                                          self.drafter_params, self.cfg, *args)
        t0 = time.perf_counter()
        state = jax.block_until_ready(self._phases.prefill(self.params, self.drafter_params,
                                                           *args))
        t1 = time.perf_counter()
        res, _ = self._phases.decode(self.params, self.drafter_params, state)
        res = jax.tree.map(np.asarray, jax.block_until_ready(res))
        t2 = time.perf_counter()
        return self._output(res, len(prompts), t2 - t0), t1 - t0, t2 - t1

    def _output(self, res, n: int, wall: float) -> BatchOutput:
        """The BatchOutput of a host copy of `LoopResult` res for the first n rows."""
        outs = [res.tokens[b, res.prompt_lengths[b]:res.lengths[b]].tolist()
                for b in range(n)]
        G = max(self.gamma, 1)
        chosen = None
        if self.cfg.schedule is not None:  # what this run learned seeds the next one
            chosen = res.ext["adaptive"]["chosen"]
            self.alpha0 = res.ext["adaptive"]["alpha"][:n].mean(axis=0).astype(np.float32)
            acc, reached = _counts(res, n)
            self.pooled = ((acc, reached) if self.pooled is None else
                           (self.pooled[0] + acc, self.pooled[1] + reached))
        verified = res.ext["partial"]["verified"] if self.cfg.partial is not None else None
        reused = res.drafter.get("reused")
        return BatchOutput(outs, res.steps[:n], res.accepted[:n, :G], wall,
                           reached=res.reached[:n, :G], chosen=chosen, verified=verified,
                           reused=reused)

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
        from specjax.decoding import adaptive

        out = self.fallback_engine().run(prompts, max_new_tokens, key)
        if self.alpha0 is not None:
            self.alpha0 = adaptive.drift_to_prior(self.alpha0, self.drift_target())
        n, G = len(prompts), max(self.gamma, 1)
        zeros = np.zeros((n, G), np.int32)
        return dataclasses.replace(
            out, accepted=zeros, reached=zeros,
            chosen=np.zeros((len(self.cfg.schedule.choices),), np.int32),
            verified=None if self.cfg.partial is None else np.zeros((2,), np.int32),
            reused=None if not getattr(self.drafter, "reuse", False) else np.zeros((4,), np.int32),
            fallback=True)

    def drift_target(self):
        """Where the carried estimates drift while batches fall back (f32[G], or the
        prior as a float), by `drift_to` (see the class docstring). Raises ValueError for
        a `drift_to` not in DRIFT_TARGETS."""
        if self.drift_to not in DRIFT_TARGETS:
            raise ValueError(f"drift_to={self.drift_to!r} must be one of {DRIFT_TARGETS}")
        prior = self.cfg.schedule.prior
        if self.drift_to == "prior":
            return prior
        G = max(self.gamma, 1)
        base = (np.full(G, prior, np.float32) if self.alpha_calibrated is None
                else np.asarray(self.alpha_calibrated, np.float32))
        if self.drift_to == "calibrated" or self.pooled is None:
            return base
        return _acceptance(self.pooled, base)

    def step_timing(self, prompts: list[list[int]], max_new_tokens: int, key,
                    repeats: int = 5) -> dict:
        """Milliseconds of one speculative step's parts on this batch's state after the
        prefill: {"draft_ms", "verify_ms", "step_ms"} (`specjax.decoding.timing.step_timing`:
        compiled and timed outside the loop, an estimate). Raises ValueError without a
        drafter."""
        if self.drafter is None:
            raise ValueError("step_timing needs a drafter")
        args = self._arrays(prompts, max_new_tokens)
        cfg = dataclasses.replace(self.cfg, schedule=None)  # a step at the drafter's G
        return step_timing(self.graphdef, self.params, self.drafter, self.drafter_params,
                           cfg, *args, key, repeats=repeats)
