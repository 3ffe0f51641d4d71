"""Where a speculative step's time goes, measured outside the loop (`step_timing`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from specjax.core.drafter import Drafter
from specjax.decoding.loop import LoopConfig, step_phases


def step_timing(graphdef, params, drafter: Drafter, drafter_params, cfg: LoopConfig,
                prompts, prompt_lengths, budgets, key, repeats: int = 5) -> dict:
    """Milliseconds of one speculative step's parts, measured outside the loop: the
    drafter's proposal alone and the whole step (proposal + the target's verify forward +
    the rule + the drafter's update), each compiled on its own and run `repeats` times
    on the state after the prefill of these prompts (median wall time, after one
    untimed call). -> {"draft_ms", "step_ms", "verify_ms" = step_ms - draft_ms}.
    An estimate of where the loop's time goes: inside the loop XLA may fuse across the
    parts, and the context grows as decoding proceeds.

    Neither program copies what the loop does not: the proposal's program returns the
    drafts and q only (not the drafter state, whose caches grow with the context), and
    the whole step takes the state donated (a fresh copy per call, made before the clock
    starts), so it writes the KV cache in place as the loop does: a returned copy grows
    with the context (`python benchmarks/long_context.py speed --timing-only` times it at
    32k tokens)."""
    if any(e.owns_step for e in cfg.extensions()):
        raise ValueError("step_timing: a fixed draft length only (cfg.schedule None)")
    phases = step_phases(graphdef, drafter, cfg)
    start, propose = phases.start, phases.propose
    state = jax.jit(start)(params, drafter_params, prompts, prompt_lengths, budgets, key)

    def draft_only(p, d, s):
        proposal = propose(p, d, s)
        return proposal[:2] if isinstance(proposal, tuple) else proposal  # drop the state

    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
    fns = {"draft_ms": (jax.jit(draft_only), False),
           "step_ms": (jax.jit(phases.step, donate_argnums=2), True)}
    out = {}
    for name, (fn, donates) in fns.items():
        def arg(donates=donates):
            return jax.block_until_ready(copy(state)) if donates else state
        jax.block_until_ready(fn(params, drafter_params, arg()))
        times = []
        for _ in range(repeats):
            s = arg()
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, drafter_params, s))
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * sorted(times)[len(times) // 2]
    out["verify_ms"] = out["step_ms"] - out["draft_ms"]
    return out

