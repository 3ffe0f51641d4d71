"""The prefill: the prompts' forward, the first token, the loop's initial state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.core.drafter import LoopView
from specjax.core.sampling import sample_logits
from specjax.decoding.loop.config import LoopConfig
from specjax.decoding.loop.state import LoopState
from specjax.models import invariant
from specjax.models.prefill import pad_rows, padded_width, scan_prompt_pieces


def is_eos(tokens, eos_ids):
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def prefill(model, cfg: LoopConfig, prompts, prompt_lengths, budgets, key, gamma, capture,
            drafter=None, constraint=None):
    """Prefill, first token, and the initial loop state of every loop.

    model: the target (merged); prompts i32[B,Tp]; prompt_lengths, budgets i32[B]; gamma:
    the longest draft length the loop verifies (0 for autoregressive decoding; the cache
    holds max_length + N slots, N the verify forward's tokens); capture: the drafter's
    capture depths; constraint: a `specjax.constraints.loop.Constraint` in its rows'
    initial states, or None: the first token is drawn from the constrained distribution
    and the state follows it.
    -> (LoopState with no drafter state yet, the LoopView the drafter's init reads)."""
    B, Tp = prompts.shape
    capacity = cfg.max_length + cfg.tree_nodes(gamma, drafter)
    if cfg.exact:  # whole attention chunks at absolute slots (specjax.models.invariant)
        capacity = -(-capacity // invariant.CHUNK) * invariant.CHUNK
    positions = jnp.broadcast_to(jnp.arange(Tp, dtype=jnp.int32), (B, Tp))
    cache = model.init_cache(B, capacity)
    if cfg.cache_sharding is not None:
        constrain = functools.partial(jax.lax.with_sharding_constraint,
                                      shardings=cfg.cache_sharding)
        cache = cache.replace(k=constrain(cache.k), v=constrain(cache.v))
    sizes = cfg.prefill_sizes()
    rows = cfg.invariant_rows()  # the exact mode's tile, or None
    with jax.named_scope("prefill"):  # benchmarks/profile_step.py reads the scope
        if Tp <= sizes[0]:
            out = model(prompts, positions, cache, capture=capture,
                        logits_at=(prompt_lengths - 1)[:, None], invariant_rows=rows)
            last_logits, hidden, cache = out.logits[:, 0], out.hidden, out.cache
        else:
            last_logits, hidden, cache = chunked_prefill(model, sizes, prompts,
                                                          prompt_lengths, cache, capture,
                                                          invariant_rows=rows)
    key, k_first = jax.random.split(key)
    if constraint is not None:
        last_logits = constraint.mask(last_logits, constraint.state)
    first, _ = sample_logits(k_first, last_logits, cfg.sampling)
    tokens = jnp.zeros((B, capacity), jnp.int32).at[:, :Tp].set(prompts)
    active = budgets > 0
    rows = jnp.arange(B)
    tokens = tokens.at[rows, jnp.where(active, prompt_lengths, capacity)].set(first, mode="drop")
    lengths = prompt_lengths + active.astype(jnp.int32)
    done = ~active | (budgets <= 1) | is_eos(first, cfg.eos_token_ids)
    if constraint is not None:  # the pending token is the first: the state follows it
        constraint = constraint.follow(constraint.state[:, None], jnp.zeros_like(first),
                                       first, active)
    state = LoopState(
        tokens=tokens, lengths=lengths, prompt_lengths=prompt_lengths, budgets=budgets,
        done=done, cache=cache.rewind(prompt_lengths), drafter_state=(), key=key,
        steps=jnp.zeros((B,), jnp.int32), accepted=jnp.zeros((B, max(gamma, 1)), jnp.int32),
        reached=jnp.zeros((B, max(gamma, 1)), jnp.int32), constraint=constraint,
    )
    view = LoopView(tokens, lengths, state.cache, hidden, positions, sizes, last_logits,
                    constraint=constraint)
    return state, view


def chunked_prefill(model, sizes, prompts, prompt_lengths, cache, capture,
                    invariant_rows: int | None = None):
    """The prefill forward over Tp > sizes[0] prompt tokens, in the pieces of
    `specjax.models.prefill.scan_prompt_pieces` (whole chunks of sizes[0], then the rest as one
    piece of the smallest size in `sizes` that covers it).

    Returns (logits f32[B,V] at each row's last prompt token, hidden [C,B,Tp,D] or None,
    cache). A piece's padding past the longest prompt writes slots past it, which the
    caller's rewind to the prompt lengths makes stale, as it does for the prompts' own
    padding; writes past the capacity are dropped. Positions past the pieces that ran
    (past the longest prompt, rounded up to a piece) are not processed: they write
    nothing and their hidden states are zeros."""
    B, Tp = prompts.shape
    last = prompt_lengths - 1  # [B]
    V = model.cfg.vocab_size
    width = padded_width(Tp, sizes)
    padded = pad_rows(prompts, 1, width)

    def run(toks, start, size, cache):
        pos = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, size))
        at = jnp.clip(last - start, 0, size - 1)[:, None]
        return model(toks, pos, cache, capture=capture, logits_at=at,
                     invariant_rows=invariant_rows)

    def forward(carry, start, size):
        cache, logits, hidden = carry
        out = run(jax.lax.dynamic_slice_in_dim(padded, start, size, 1), start, size, cache)
        mine = (last >= start) & (last < start + size)
        logits = jnp.where(mine[:, None], out.logits[:, 0], logits)
        if hidden is not None:  # [C, B, width, D]
            hidden = jax.lax.dynamic_update_slice_in_dim(hidden, out.hidden, start, 2)
        return out.cache, logits, hidden

    one = jax.eval_shape(lambda: run(prompts[:, :1], 0, 1, cache).hidden)
    hidden = None if one is None else jnp.zeros(one.shape[:2] + (width,) + one.shape[3:],
                                                one.dtype)
    cache, logits, hidden = scan_prompt_pieces(
        forward, (cache, jnp.zeros((B, V), jnp.float32), hidden), Tp, sizes, last)
    return logits, None if hidden is None else hidden[:, :, :Tp], cache
