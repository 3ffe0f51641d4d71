"""The adaptive schedule inside the compiled loop: one step per draft length, chosen per
step (`specjax.decoding.adaptive.policy.choose`), and the deferred drafter update of
autoregressive steps.

Every branch is the loop's one step (`specjax.decoding.loop.step.step_phases`) at a draft
length g of the schedule's choices; g = 0 is an autoregressive step that still gives the
drafter the target's features. An autoregressive step does not feed the drafter at once:
it keeps the captured features in a buffer (`Deferred`, M = G + 1 steps), and the
drafter's update runs once over the whole buffer, as after a speculative step that
accepted M - 1 drafts, when the buffer is full or before the next speculative step. A run
of autoregressive steps then costs the drafter one update per M steps instead of one per
step. The drafter's state after the catch-up is what the per-step updates would have left
(its entries depend on each position's features and the committed tokens only). Not for a
drafter that reads the target's logits in `update`: it is updated every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.core.drafter import Drafter, LoopView
from specjax.decoding import kernel_policy
from specjax.decoding.adaptive import policy
from specjax.decoding.loop.config import LoopConfig
from specjax.decoding.loop.state import LoopState
from specjax.decoding.loop.step import Chain, propose_view, step_phases

NAME = "adaptive"  # the schedule's key in LoopState.ext (GammaSchedule.name)


@struct.dataclass
class Deferred:
    """The drafter update that autoregressive steps put off: hidden [C,B,M,D] the target
    features those steps captured (None for a drafter that captures none), slot i at
    position start[b] + i (i32[B]), count i32[] slots filled, M = G + 1."""

    hidden: jax.Array | None
    start: jax.Array
    count: jax.Array


def _defers(schedule, drafter) -> bool:
    return schedule.defer_update and not getattr(drafter, "reads_logits", False)


def init_adapt(schedule, model, cfg: LoopConfig, drafter: Drafter, s: LoopState, inputs
               ) -> policy.AdaptState:
    """The schedule's state after the prefill: acceptance estimates from inputs["alpha0"]
    (f32[G] or f32[B,G]; None: the prior) and, where updates are deferred, an empty buffer
    shaped as one autoregressive step's captured features."""
    alpha0 = None if inputs is None else inputs.get("alpha0")
    adapt = policy.init_state(schedule, s.tokens.shape[0], alpha0)
    if not _defers(schedule, drafter):
        return adapt
    pos = (s.lengths - 1)[:, None]
    one = jax.eval_shape(lambda: model(pos, pos, s.cache, capture=drafter.capture,
                                       attention=cfg.target_attention()).hidden)
    M = drafter.gamma + 1
    hidden = None if one is None else jnp.zeros(one.shape[:2] + (M,) + one.shape[3:],
                                                one.dtype)
    return adapt.replace(deferred=Deferred(hidden, jnp.zeros_like(s.lengths), jnp.int32(0)))


def _with_adapt(s: LoopState, adapt) -> LoopState:
    return s.replace(ext={**s.ext, NAME: adapt})


class AdaptivePhases(NamedTuple):
    """start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState;
    step(params, drafter_params, s) -> LoopState; branch(params, drafter_params, s, index)
    -> LoopState: one step at draft length choices[index]."""

    start: Callable
    step: Callable
    branch: Callable


def adaptive_phases(graphdef, drafter: Drafter, cfg: LoopConfig, inputs: dict | None = None
                    ) -> AdaptivePhases:
    """The loop's phases under `cfg.schedule`: start as the fixed loop's at the drafter's G
    plus the schedule's state; step runs the branch at the draft length the schedule
    chooses from inputs["adaptive"]["costs"] (f32[n], ms per step at each choice; ones
    where not given)."""
    sched = cfg.schedule
    mine = (inputs or {}).get(NAME) or {}
    costs = mine.get("costs")
    costs = jnp.ones((len(sched.choices),), jnp.float32) if costs is None else costs
    start = step_phases(graphdef, drafter, cfg, inputs=inputs).start
    fixed = dataclasses.replace(cfg, schedule=None)
    full = kernel_policy.with_drafter_attention(drafter, cfg.drafter_attention())
    M = drafter.gamma + 1  # the deferred updates' window, as a speculative step's
    defer = _defers(sched, drafter)

    def catch_up(drafter_params, s: LoopState, need: int = 1) -> LoopState:
        """The deferred update, if at least `need` slots are filled (once or never: a
        conditional would copy the loop state in and out)."""
        if not defer:
            return s

        def run(c):
            s = c[0]
            d = s.ext[NAME].deferred
            pos = d.start[:, None] + jnp.arange(M, dtype=jnp.int32)[None, :]
            view = LoopView(s.tokens, s.lengths, s.cache, d.hidden, pos)
            with jax.named_scope("drafter_update"):
                dstate = full.update(drafter_params, s.drafter_state, view,
                                     jnp.full_like(s.lengths, d.count - 1))
            adapt = s.ext[NAME].replace(deferred=d.replace(count=jnp.int32(0)))
            return _with_adapt(s.replace(drafter_state=dstate), adapt), False

        return jax.lax.while_loop(lambda c: c[1], run,
                                  (s, s.ext[NAME].deferred.count >= need))[0]

    def keep_features(drafter_params, s: LoopState, view: LoopView, tau) -> LoopState:
        """An autoregressive step's update: keep its features; the drafter catches up when
        the buffer is full."""
        d = s.ext[NAME].deferred
        hidden = d.hidden
        if hidden is not None:
            hidden = jax.lax.dynamic_update_slice_in_dim(
                hidden, view.hidden.astype(hidden.dtype), d.count, axis=2)
        d = Deferred(hidden, jnp.where(d.count == 0, view.positions[:, 0], d.start),
                     d.count + 1)
        s = _with_adapt(s, s.ext[NAME].replace(deferred=d))
        return catch_up(drafter_params, s, need=M)

    def make_branch(index: int, g: int):
        if g == 0:
            one = step_phases(graphdef, drafter, fixed, gamma=0,
                              update=keep_features if defer else None).step
        else:
            spec = step_phases(graphdef, policy.with_gamma(drafter, g), fixed).step

            def one(params, drafter_params, s):
                return spec(params, drafter_params, catch_up(drafter_params, s))

        def branch(params, drafter_params, s: LoopState) -> LoopState:
            new = one(params, drafter_params, s)
            tau = jnp.sum(new.accepted - s.accepted, axis=1)
            # new's schedule state: alpha as before the step, the deferred buffer as after
            return _with_adapt(new, policy.observe(sched, new.ext[NAME], index, g, tau,
                                                   ~s.done))
        return branch

    branches = [make_branch(i, g) for i, g in enumerate(sched.choices)]
    # the steps the schedule takes: with confidence, every speculative index drafts the
    # whole block and picks its verify length after (`branch` keeps the fixed lengths: a
    # cost table times each)
    stepping = branches
    if sched.confidence:  # [the autoregressive branch (if a choice),] the confident step
        stepping = [b for b, g in zip(branches, sched.choices, strict=True) if g == 0]
        stepping.append(confident_step(graphdef, drafter, fixed, full, sched, costs,
                                       catch_up))
    is_ar = jnp.asarray([g == 0 for g in sched.choices])

    def run(steps, params, drafter_params, s: LoopState, index) -> LoopState:
        # Not `lax.switch`: XLA copies the KV cache in and out of a conditional's branches
        # (every step, the whole cache); a while loop that runs once or not at all updates
        # its carry in place, as the outer loop does. One runs per step.
        for i, b in enumerate(steps):
            s, index = jax.lax.while_loop(
                lambda c, i=i: c[1] == i,
                lambda c, b=b: (b(params, drafter_params, c[0]), jnp.int32(-1)),
                (s, index))
        return s

    def run_branch(params, drafter_params, s: LoopState, index) -> LoopState:
        return run(branches, params, drafter_params, s, index)

    def step(params, drafter_params, s: LoopState) -> LoopState:
        k_choose = jax.random.fold_in(s.key, 0x5EED)  # its own stream (policy "random")
        remaining = s.budgets - (s.lengths - s.prompt_lengths)
        index = policy.choose(sched, s.ext[NAME], costs, ~s.done, remaining, k_choose)
        if sched.confidence:  # a speculative index: the confident step (the last)
            index = jnp.where(is_ar[index], 0, len(stepping) - 1).astype(jnp.int32)
        return run(stepping, params, drafter_params, s, index)

    return AdaptivePhases(start, step, run_branch)



def confident_step(graphdef, drafter, fixed: LoopConfig, full, sched, costs, catch_up
                   ) -> Callable:
    """The speculative step of a confidence schedule (`GammaSchedule.confidence`): the
    whole block drafted at the schedule's G, then the verify length chosen among the
    speculative choices by `policy.finish_time` with the drafter's confidence as this
    step's acceptance (policy "random": uniformly, from the loop's key), and the step
    finished with the first g drafts and their q. The choice reads nothing of the target,
    so every verification stays exact."""
    spec = [(i, g) for i, g in enumerate(sched.choices) if g > 0]
    spec_g = tuple(g for _, g in spec)
    spec_costs = costs[jnp.asarray([i for i, _ in spec])]
    propose = step_phases(graphdef, policy.with_gamma(drafter, sched.gamma), fixed).propose
    finishes = [step_phases(graphdef, policy.with_gamma(drafter, g), fixed).finish
                for _, g in spec]

    def step(params, drafter_params, s: LoopState) -> LoopState:
        s = catch_up(drafter_params, s)
        prop = propose(params, drafter_params, s)
        view = propose_view(s)
        with jax.named_scope("drafter_confidence"):
            conf = full.confidence(drafter_params, prop.state, view, prop.draft)  # [B,G]
        remaining = s.budgets - (s.lengths - s.prompt_lengths)
        if sched.policy == "random":
            key = jax.random.fold_in(s.key, 0xC0F)
            j = jax.random.randint(key, (), 0, len(spec), dtype=jnp.int32)
        else:
            t = policy.finish_time(conf.astype(jnp.float32), spec_g, spec_costs, ~s.done,
                                   jnp.maximum(remaining, 1), sched.stragglers)
            j = jnp.argmin(t).astype(jnp.int32)
        for jj, ((i, g), finish) in enumerate(zip(spec, finishes, strict=True)):
            def run(c, i=i, g=g, finish=finish):
                sub = Chain(prop.draft[:, :g], None if prop.q is None else prop.q[:, :g],
                            prop.state)
                new = finish(params, drafter_params, c[0], sub)
                tau = jnp.sum(new.accepted - c[0].accepted, axis=1)
                return (_with_adapt(new, policy.observe(sched, new.ext[NAME], i, g, tau,
                                                        ~c[0].done)), jnp.int32(-1))
            # run once or not at all (see run_branch: no conditional over the cache)
            s, j = jax.lax.while_loop(lambda c, jj=jj: c[1] == jj, run, (s, j))
        return s

    return step
