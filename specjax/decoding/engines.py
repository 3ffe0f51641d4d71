"""The engines of a decoding session for one shape: the speculative engine ("main"), the
autoregressive reference ("ar", with compare_ar and a drafter), their statistics and
outputs, and the adaptive schedule's cost table (read, or measured once and cached)."""

from __future__ import annotations

import os
import sys
import time

from specjax.compile_cache import cache_subdir
from specjax.decoding import adaptive
from specjax.decoding.adaptive.controller import AdaptiveEngine, make_engine
from specjax.decoding.engine import Engine, Stats
from specjax.errors import SpecjaxError


def weights_id(path: str) -> str:
    """The identity a cost table is keyed by for a target or drafter argument: the cheap
    fingerprint of the weights in that directory (`specjax.models.checkpoint.fingerprint`:
    retraining into the same directory changes it), else the argument itself (ngram,
    logitspec)."""
    from specjax.models.checkpoint import fingerprint

    if not os.path.isdir(path):
        return path
    try:
        return fingerprint(path)
    except SpecjaxError:  # no safetensors there (a drafter of another format)
        return os.path.abspath(path)


def length_bucket(n: int) -> int:
    """The power of two at or above n (at least 256): the context lengths one cached cost
    table serves. A step's cost grows with the context, slowly on the demo's scale, so one
    measurement per doubling of max_length, not one per prompt set."""
    return max(256, 1 << max(int(n) - 1, 1).bit_length())


def default_cost_table(session, schedule, max_length: int) -> str | None:
    """Where --gamma auto caches its measured cost table when --cost-table is not given:
    COMPILE_CACHE/specjax-costs/KEY.json, keyed by everything the costs and the stored
    acceptance depend on: the target's and drafter's weights (their fingerprints, so that
    a drafter retrained into the same directory is measured again), dtypes, drafter
    options, batch size, max_length's `length_bucket` (not the exact lengths: a new prompt
    set of similar length reuses the table), sampling, verification, kernels, mesh,
    choices, backend, device and jax version. None: no cache (--compile-cache none)."""
    import jax

    c = session.cfg
    where = cache_subdir(c.compile_cache, "specjax-costs")
    if where is None:
        return None
    key = adaptive.table_key(
        target=session.model_cfg, target_weights=weights_id(c.target), dtype=session.dtype,
        drafter=weights_id(session.loaded.name),
        drafter_gamma=session.loaded.gamma, drafter_dtype=c.drafter_dtype,
        matmul_dtype=c.matmul_dtype, draft_vocab=c.draft_vocab, draft_stop=c.draft_stop,
        draft_window=c.draft_window, draft_reuse=c.draft_reuse, batch=c.batch_size,
        length_bucket=length_bucket(max_length), temperature=c.temperature,
        top_k=c.top_k, top_p=c.top_p, verify=c.verify, kernels=c.kernels, mesh=c.mesh,
        **({"exact": True} if c.exact else {}),
        choices=schedule.choices, table_version=7, backend=jax.default_backend(),
        device=jax.devices()[0].device_kind, jax=jax.__version__)
    return os.path.join(where, key + ".json")


class EngineSet:
    """The engines of one shape (`build_engines`). engines: {"main": ..., "ar": ...};
    stats, outputs: per engine; schedule: the GammaSchedule under --gamma auto (else
    None); table: the cost table's path; mesh: the device mesh or None; measured_at, table_written, relative,
    calibrated_s: its provenance for the report."""

    def __init__(self, session, engines: dict, schedule, table, max_new_tokens: int,
                 mesh=None, measured_at: str | None = None):
        self.session, self.engines, self.schedule, self.table = session, engines, schedule, table
        self.mesh = mesh
        self.max_new_tokens = max_new_tokens
        self.stats = {name: Stats() for name in engines}
        self.outputs = {name: [] for name in engines}
        self.measured_at, self.table_written, self.relative = measured_at, False, None
        self.calibrated_s = None

    def reset(self) -> None:
        """Starts a new run's figures and outputs (the compiled engines stay)."""
        self.stats = {name: Stats() for name in self.engines}
        self.outputs = {name: [] for name in self.engines}

    @property
    def main(self) -> Engine | AdaptiveEngine:
        return self.engines["main"]

    def compile(self) -> None:
        for name, eng in self.engines.items():
            self.stats[name].compile_s = eng.compile()

    def calibrate(self, batches, key) -> None:
        """--gamma auto without a cost table: measures it once, on the batch of median
        prompt length (costs grow with the context), and caches it unless its rounds spread
        too much (a busy machine) or --cost-table names the file."""
        if self.schedule is None or self.main.costs is not None:
            return
        c, eng = self.session.cfg, self.main
        t0 = time.perf_counter()
        cal = batches[adaptive.calibration_batch([[ids for _, ids in b] for b in batches])]
        costs = eng.calibrate([ids for _, ids in cal], self.max_new_tokens, key, baseline=True)
        self.calibrated_s = time.perf_counter() - t0
        self.measured_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        # each round's AR wall over its speculative walls (the margin's input)
        self.relative = [round(float(r), 4) for r in eng.calibration_relative]
        spread = adaptive.calibration_spread(eng.calibration_relative)
        noisy = spread > adaptive.NOISY_SPREAD
        if noisy:
            print(f"decode.py: --gamma auto: the calibration's repeated runs spread "
                  f"{spread:.0%} (a busy machine?); its cost table "
                  + ("is written to --cost-table all the same" if c.cost_table
                     else "is used for this run only, not cached")
                  + ": measure it on a quiet machine", file=sys.stderr)
        where = ("not cached (--compile-cache none)" if self.table is None else
                 "not cached" if (c.cost_table is None and noisy) else f"written to {self.table}")
        print(f"decode.py: --gamma auto: measured the cost table in {self.calibrated_s:.0f} s, "
              f"once per setting; {where}", file=sys.stderr)
        if self.table is None or (c.cost_table is None and noisy):
            return
        import jax

        try:
            adaptive.write_table(self.table, self.schedule.choices, costs, {
                "measured_on": jax.devices()[0].device_kind, "batch_size": c.batch_size,
                "drafter": self.session.loaded.name,
                # before adaptive.fit_costs (ms_per_step is the fitted table)
                "measured_ms_per_step": {str(g): round(float(m), 4) for g, m in zip(
                    self.schedule.choices, eng.measured_costs, strict=True)},
                "calibration_relative": self.relative, "measured_at": self.measured_at,
                # the acceptance calibrate observed: the next run starts from it
                **({} if eng.alpha0 is None else {"alpha": [round(float(a), 4)
                                                            for a in eng.alpha0]})},
                baseline=eng.baseline)
            self.table_written = True
        except OSError as e:
            if c.cost_table is not None:
                raise SpecjaxError(f"--cost-table {self.table} cannot be written "
                                   f"({e.strerror})") from None
            # the default place is in the compile cache: where that cannot be written the
            # cache is off, and so is this one (the next run measures again)

    def run(self, prompts: list[list[int]], key) -> None:
        """One batch through every engine, interleaved (both see the same machine state)."""
        for name, eng in self.engines.items():
            out = eng.run(prompts, self.max_new_tokens, key)
            self.stats[name].add(out)
            self.outputs[name].extend(out.outputs)


def build_engines(session, max_length: int, prompt_width: int, eos: tuple[int, ...]
                  ) -> EngineSet:
    """The EngineSet of a session (weights loaded) for one shape."""
    c = session.cfg
    mesh = None
    if c.mesh:
        from specjax.decoding.sharding import check_batch, decode_mesh

        mesh = decode_mesh(c.mesh)
        check_batch(mesh, c.batch_size)
    drafter, loaded = session.drafter, session.loaded
    common = dict(sampling=session.sampling, verify=session.rule(), max_length=max_length,
                  prompt_width=prompt_width, batch_size=c.batch_size, eos_token_ids=eos,
                  kernels=c.kernels, mesh=mesh, constraints=session.constraint_set,
                  exact=c.exact)
    schedule = table = costs = baseline = alpha = measured_at = None
    if c.adaptive and drafter is not None:
        # a drafter with a confidence head (DSpark's) picks each step's verify length from
        # its confidence in the drafts (one policy: GammaSchedule.confidence)
        schedule = adaptive.GammaSchedule(adaptive.default_choices(loaded.gamma),
                                          confidence=getattr(drafter, "has_confidence",
                                                             False))
        table = c.cost_table or default_cost_table(session, schedule, max_length)
        if table is not None and os.path.isfile(table):
            costs = adaptive.read_table(table, schedule.choices)
            baseline = adaptive.read_baseline(table)
            alpha = adaptive.read_alpha(table, schedule.gamma)
            measured_at = adaptive.read_field(table, "measured_at")
    target = session.target.model
    # alpha0: the acceptance the table's calibration observed (the first run's estimates,
    # and where they drift while batches fall back)
    main = make_engine(target, drafter=drafter, drafter_params=loaded.params,
                       num_drafts=c.num_drafts if drafter is not None else 1,
                       schedule=schedule, costs=costs, baseline=baseline, alpha0=alpha,
                       partial=session.partial(), **common)
    engines = {"main": main}
    if c.compare_ar and drafter is not None:
        # under --gamma auto the AR reference is the program auto falls back to (one
        # compilation for both)
        engines["ar"] = main.fallback_engine() if schedule is not None else Engine(target,
                                                                                   **common)
    return EngineSet(session, engines, schedule, table, c.max_new_tokens, mesh, measured_at)
