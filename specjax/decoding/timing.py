"""Where a speculative step's time goes, measured outside the loop (`step_timing`)."""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp

from specjax.core.drafter import Drafter
from specjax.decoding.loop import LoopConfig, step_phases


def step_timing(graphdef, params, drafter: Drafter, drafter_params, cfg: LoopConfig,
                prompts, prompt_lengths, budgets, key, repeats: int = 5) -> dict:
    """Milliseconds of one speculative step's parts, measured outside the loop: the
    drafter's proposal alone ("draft_ms"), the rest of the step on that proposal alone
    (the target's verify forward + the rule + the drafter's update: "verify_ms") and the
    whole step ("step_ms"), each compiled on its own and run `repeats` times on the state
    after the prefill of these prompts, the three interleaved (median wall time of each,
    after one untimed call). -> {"draft_ms", "verify_ms", "step_ms"}, each a measured
    wall time, so never negative (verify_ms was step_ms - draft_ms, which printed
    negative where the noise of the two medians exceeded the verify part). draft_ms +
    verify_ms is about step_ms, not equal: two dispatches instead of one, and within one
    program XLA may fuse across the parts. An estimate of where the loop's time goes: the
    loop may fuse across the parts too, and the context grows as decoding proceeds.

    No program copies what the loop does not: the proposal's program returns the
    drafts and q only (not the drafter state, whose caches grow with the context); the
    verify part and the whole step take the state (and the verify part the proposal)
    donated (a fresh copy per call, made before the clock starts), so they write the KV
    cache in place as the loop does: a returned copy grows with the context (`python
    benchmarks/long_context.py speed --timing-only` times it at 32k tokens)."""
    if any(e.owns_step for e in cfg.extensions()):
        raise ValueError("step_timing: a fixed draft length only (cfg.schedule None)")
    phases = step_phases(graphdef, drafter, cfg)
    start, propose = phases.start, phases.propose
    state = jax.jit(start)(params, drafter_params, prompts, prompt_lengths, budgets, key)
    proposal = jax.jit(propose)(params, drafter_params, state)

    def draft_only(p, d, s):
        proposal = propose(p, d, s)
        return proposal[:2] if isinstance(proposal, tuple) else proposal  # drop the state

    copy = jax.jit(lambda x: jax.tree.map(jnp.copy, x))
    # name -> (program, its arguments after the weights: made fresh per call if donated)
    fns = {"draft_ms": (jax.jit(draft_only), lambda: (state,)),
           "verify_ms": (jax.jit(phases.finish, donate_argnums=(2, 3)),
                         lambda: jax.block_until_ready(copy((state, proposal)))),
           "step_ms": (jax.jit(phases.step, donate_argnums=2),
                       lambda: jax.block_until_ready(copy((state,))))}
    with warnings.catch_warnings():
        # the proposal's drafts and q have no output to alias (its drafter state has):
        # donating them with it is harmless, not worth a warning
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        for fn, args in fns.values():  # compile and warm up
            jax.block_until_ready(fn(params, drafter_params, *args()))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            a = args()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, drafter_params, *a))
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}
