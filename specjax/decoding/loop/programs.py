"""The compiled programs: autoregressive and speculative decoding, each ONE jitted
`lax.while_loop` over the one step (`specjax.decoding.loop.step`), and the same loop as two
programs (prefill, decode) for timing them apart."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.constraints.loop import Constraint
from specjax.core.drafter import Drafter
from specjax.decoding.loop.config import LoopConfig
from specjax.decoding.loop.state import LoopResult, LoopState, result
from specjax.decoding.loop.step import CONSTRAINT, step_phases


def loop_phases(graphdef, drafter: Drafter | None, cfg: LoopConfig, inputs: dict | None = None):
    """(start, step) of the loop: start(params, drafter_params, prompts, prompt_lengths,
    budgets, key) -> LoopState and step(params, drafter_params, s) -> LoopState. The one
    step of `step_phases`, unless a loop extension replaces it (`owns_step`: the adaptive
    schedule chooses among steps of several draft lengths). inputs: run-time inputs per
    extension ({name: value}, traced)."""
    owner = next((e for e in cfg.extensions() if e.owns_step), None)
    if owner is not None and drafter is not None:
        return owner.phases(graphdef, drafter, cfg, inputs)
    phases = step_phases(graphdef, drafter, cfg, inputs=inputs)
    return phases.start, phases.step


def _run(graphdef, params, drafter, drafter_params, cfg, prompts, prompt_lengths, budgets,
         key, inputs, constraint) -> LoopResult:
    if constraint is not None:
        if cfg.lossy:
            raise ValueError("a constraint needs a lossless loop: the verification rule or "
                             "a loop extension here is lossy")
        inputs = {**(inputs or {}), CONSTRAINT: constraint}
    start, step = loop_phases(graphdef, drafter, cfg, inputs)
    state = start(params, drafter_params, prompts, prompt_lengths, budgets, key)
    final = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                               lambda s: step(params, drafter_params, s), state)
    return result(final, cfg, drafter)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def autoregressive_loop(graphdef, params, cfg: LoopConfig, prompts, prompt_lengths, budgets,
                        key, constraint: Constraint | None = None) -> LoopResult:
    """Plain decoding of the target, one token per forward, as one `lax.while_loop`.

    Args:
      graphdef, params: `nnx.split(target)`.
      prompts: i32[B,Tp] left-aligned, right-padded prompts; prompt_lengths: i32[B] >= 1.
      budgets: i32[B] max new tokens per row (0: the row is padding and emits nothing).
      key: PRNG key.
      constraint: a `specjax.constraints.loop.Constraint` (`build_constraint`) or None:
        each row decodes under its automaton (the target's distribution masked to the
        allowed tokens before the sampling filters; end of sequence is allowed in the
        automaton's accepting states only, and is all a finished automaton allows).
    Returns: LoopResult.
    """
    return _run(graphdef, params, None, None, cfg, prompts, prompt_lengths, budgets, key, None,
                constraint)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "drafter"))
def speculative_loop(graphdef, params, drafter: Drafter, drafter_params, cfg: LoopConfig,
                     prompts, prompt_lengths, budgets, key, inputs: dict | None = None,
                     constraint: Constraint | None = None) -> LoopResult:
    """Speculative decoding (draft G, verify G+1 positions in one target forward) as one
    `lax.while_loop`; same arguments as `autoregressive_loop` plus the drafter (static)
    and its params. Lossless: greedy output equals `autoregressive_loop`'s; sampled
    output follows the filtered target distribution (docs/design.md section 4).
    With `cfg.num_drafts` K > 1, or a drafter that proposes trees itself
    (`specjax.core.drafter.TreeDrafter`), each step verifies a draft tree.
    inputs: run-time inputs of the loop extensions, {name: value} (traced, so new values
    need no recompilation): under an adaptive schedule {"adaptive": {"costs": f32[n] ms
    per step at each choice, "alpha0": f32[G] or f32[B,G] or None}}
    (`specjax.decoding.adaptive.loop`).
    constraint: as in `autoregressive_loop`; every verify position, every draft-tree node
    and (for drafters that read `LoopView.constraint`) every draft is masked in the state
    its prefix reaches, so the output follows constrained autoregressive decoding exactly.
    Raises ValueError with a constraint and a lossy config.
    """
    return _run(graphdef, params, drafter, drafter_params, cfg, prompts, prompt_lengths,
                budgets, key, inputs, constraint)


class PhasePrograms(NamedTuple):
    """The loop as two compiled programs (`phase_programs`): prefill(dynamic...) ->
    LoopState, and decode(params, drafter_params, state) -> (LoopResult, the final
    LoopState): the state's buffers are donated and become the final state's, so the
    loop runs in them without a copy of the KV cache."""

    prefill: Callable
    decode: Callable


def phase_programs(graphdef, params, drafter: Drafter | None, drafter_params,
                   cfg: LoopConfig, prompts, prompt_lengths, budgets, key) -> PhasePrograms:
    """The same loop as `autoregressive_loop` (drafter None) or `speculative_loop` (fixed
    draft length: no extension that owns the step), compiled as two programs so that a
    caller can time the prefill and the decoding apart: at long context the prefill takes
    ten times the decode of a few hundred tokens, and its run-to-run spread is larger than
    the whole decode (benchmarks/long_context.py). The arguments are those of the loops
    (shapes only matter: they are compiled for). Raises ValueError for an adaptive
    schedule."""
    if drafter is not None and any(e.owns_step for e in cfg.extensions()):
        raise ValueError("phase_programs: a fixed draft length only (cfg.schedule None)")
    prefill, one = loop_phases(graphdef, drafter, cfg)

    def decode(params, drafter_params, state: LoopState):
        final = jax.lax.while_loop(lambda s: ~jnp.all(s.done),
                                   lambda s: one(params, drafter_params, s), state)
        return result(final, cfg, drafter), final  # the final state: the donated buffers

    pre = jax.jit(prefill).lower(params, drafter_params, prompts, prompt_lengths, budgets,
                                 key).compile()
    state = jax.eval_shape(prefill, params, drafter_params, prompts, prompt_lengths,
                           budgets, key)
    dec = jax.jit(decode, donate_argnums=2).lower(params, drafter_params, state).compile()
    return PhasePrograms(pre, dec)
