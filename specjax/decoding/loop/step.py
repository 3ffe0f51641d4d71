"""ONE step of every loop: propose -> verify forward -> rule -> emit -> advance.

Per step the drafter proposes G tokens (a chain, with their q) or a draft tree; the target
verifies [pending, drafts] at positions lengths-1 .. in one forward (a tree with its
ancestor mask); the rule picks tau and the next token (the correction or the bonus); the
row emits its accepted drafts and the next token, cut at its first EOS and at its budget;
a tree's accepted path is compacted into place; the target cache is rewound by length;
the drafter updates from the accepted path. Autoregressive decoding is the same step with
G = 0: nothing proposed, a one-token forward, the next token sampled from its logits.

The chain differs from the tree with one child per node in three places only, each a
measured fast path (docs/design.md, "One step"): the verify forward needs no tree mask,
the rule runs on G + 1 positions (and may be fused, `pallas_kernels.verify`), and the
cache needs no compaction (the path is the chain itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.core.drafter import Drafter, LoopView, take_rows
from specjax.core.sampling import filtered_probs, sample_logits
from specjax.core.tree import (
    DraftTree,
    ancestor_mask,
    chain_tree,
    path_tokens,
    tree_from_drafts,
)
from specjax.decoding import kernel_policy
from specjax.decoding.loop.config import LoopConfig
from specjax.decoding.loop.prefill import is_eos, prefill
from specjax.decoding.loop.state import LoopState
from specjax.models.kv_cache import KVCache
from specjax.models.matmul import DRAFTS_AXIS


class Chain(NamedTuple):
    """A chain proposal: draft i32[B,G], q f32[B,G,V] (filtered; None where unused), the
    drafter's state after proposing."""

    draft: jax.Array
    q: jax.Array | None
    state: Any


class Phases(NamedTuple):
    """A loop's phases, functions of the (traced) weights:

      start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState
        (prefill, first token, drafter init, the extensions' states);
      propose(params, drafter_params, s) -> a `Chain` or a `DraftTree`;
      finish(params, drafter_params, s, proposal) -> LoopState (the rest of the step).
    `step` is finish(propose(s)); timing programs compile the two apart."""

    start: Callable
    propose: Callable
    finish: Callable

    def step(self, params, drafter_params, s: LoopState) -> LoopState:
        return self.finish(params, drafter_params, s, self.propose(params, drafter_params, s))


def emit(s: LoopState, cfg: LoopConfig, draft, tau, next_token):
    """Writes each active row's x_1..x_tau and then `next_token`, cut at its first EOS and
    at its budget. draft i32[B,G]; tau, next_token i32[B].
    -> (tokens, lengths, done, active i32[B] = 1 for rows that were active)."""
    B, G = draft.shape
    offsets = jnp.arange(G + 1, dtype=jnp.int32)
    block = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    block = jnp.where(offsets[None, :] == tau[:, None], next_token[:, None], block)
    in_block = offsets[None, :] <= tau[:, None]
    eos = is_eos(block, cfg.eos_token_ids) & in_block
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), G + 1)
    remaining = s.budgets - (s.lengths - s.prompt_lengths)
    active = ~s.done
    n_emit = jnp.minimum(jnp.minimum(tau + 1, remaining), first_eos + 1)
    n_emit = jnp.where(active, n_emit, 0).astype(jnp.int32)
    write_pos = jnp.where(offsets[None, :] < n_emit[:, None], s.lengths[:, None] + offsets,
                          s.tokens.shape[1])
    tokens = s.tokens.at[jnp.arange(B)[:, None], write_pos].set(block, mode="drop")
    lengths = s.lengths + n_emit
    stop = (first_eos < n_emit) | (lengths - s.prompt_lengths >= s.budgets)
    return tokens, lengths, s.done | (active & stop), active.astype(jnp.int32)


def advance(s: LoopState, tokens, lengths, done, active, cache, drafter_state, key, tau,
            drafted: int) -> LoopState:
    """The next loop state; counts the step, the accepted drafts per position, and the
    positions reached among the `drafted` drafts of this step."""
    G = s.accepted.shape[1]
    k = jnp.arange(G)[None, :]
    accepted = s.accepted + active[:, None] * (k < tau[:, None])
    reached = s.reached + active[:, None] * ((k < drafted) & (k <= tau[:, None]))
    return s.replace(tokens=tokens, lengths=lengths, done=done, cache=cache,
                     drafter_state=drafter_state, key=key, steps=s.steps + active,
                     accepted=accepted.astype(jnp.int32), reached=reached.astype(jnp.int32))


def compact_path(cache: KVCache, base, path) -> KVCache:
    """Moves the accepted path's K/V into place after a draft tree's verify forward: node
    path[b, j] was written at slot base[b] + path[b, j]; it goes to slot base[b] + j
    (j = 0..G, every layer), so the cache holds the committed tokens contiguously again
    and the rejected branches' entries sit past the row's length, stale.
    cache k, v [L,B,K,S,H]; base i32[B]; path i32[B,G+1] (`specjax.core.tree`)."""
    B, P = path.shape
    rows = jnp.arange(B)[:, None]
    src = base[:, None] + path
    dst = base[:, None] + jnp.arange(P, dtype=jnp.int32)[None, :]
    # advanced indices around a slice: the gathered block is [B,P,L,K,H]
    k = cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, src], mode="drop")
    v = cache.v.at[:, rows, :, dst].set(cache.v[:, rows, :, src], mode="drop")
    return cache.replace(k=k, v=v)


def propose_drafts(drafter: Drafter, params, state, view: LoopView, key, num_drafts: int,
                   pending) -> DraftTree:
    """K = num_drafts drafts of G tokens from one drafter state, as a tree of 1 + K*G nodes
    (`specjax.core.tree.tree_from_drafts`): `drafter.propose` vmapped over K keys and
    first_rank = (0..K-1, K): at temperature 0 the top-K first tokens, each continued
    greedily (`specjax.core.sampling.ranked_choice`), above it K independent samples (a
    deterministic drafter such as n-gram uses the rank at every temperature). The
    proposals' drafter states are dropped: the loop updates the drafter from the state
    before the step (`update_after_tree` where a drafter has it). The vmap names its
    axis `specjax.models.matmul.DRAFTS_AXIS`: `linear` reads its size while tracing and
    takes bf16 products weight-major on XLA:CPU. pending: i32[B] the root tokens."""
    keys = jax.random.split(key, num_drafts)
    ranks = jnp.arange(num_drafts, dtype=jnp.int32)

    def one(k, r):
        draft, q, _ = drafter.propose(params, state, view, k, first_rank=(r, num_drafts))
        return draft, (None if drafter.sampling.greedy else q)
    # The named axis tells the CPU matmul tuning about the vmap (`matmul.vmapped_copies`).
    drafts, q = jax.vmap(one, axis_name=DRAFTS_AXIS)(keys, ranks)  # [K,B,G], [K,B,G,V] or None
    if q is None:
        return tree_from_drafts(pending, jnp.moveaxis(drafts, 0, 1))
    return tree_from_drafts(pending, jnp.moveaxis(drafts, 0, 1), jnp.moveaxis(q, 0, 1))


UpdateFn = Callable[[Any, LoopState, LoopView, jax.Array], LoopState]

CONSTRAINT = "constraint"  # the key of the rows' Constraint among the loop's inputs


def propose_view(s: LoopState) -> LoopView:
    """What a drafter reads when it proposes: the committed tokens, the target cache, the
    pending token's position and the rows' constraint (`LoopView`)."""
    return LoopView(s.tokens, s.lengths, s.cache, None, (s.lengths - 1)[:, None],
                    constraint=s.constraint)


def step_phases(graphdef, drafter: Drafter | None, cfg: LoopConfig, *,
                gamma: int | None = None, update: UpdateFn | None = None,
                inputs: dict | None = None, chain_as_tree: bool = False) -> Phases:
    """The phases of one loop step (`Phases`).

    graphdef: the target's `nnx.split` graph; drafter: None for autoregressive decoding
    (drafter_params then unused), else the drafter (static); gamma: the step's draft length
    (None: the drafter's G; 0 with a drafter: an autoregressive step that still feeds the
    drafter the target's features, as the adaptive schedule's autoregressive branch does);
    update: replaces the drafter's update after the step, fn(drafter_params, s, view, tau)
    -> LoopState, where s is the advanced state holding the proposal's drafter state and
    view the accepted path (the adaptive schedule defers updates with it); inputs: the
    caller's run-time inputs per loop extension ({name: value}; `LoopExtension.init`),
    and under CONSTRAINT ("constraint") the rows' `specjax.constraints.loop.Constraint`
    (the target's distribution at every verify position is masked to what the row's
    automaton allows there, before the sampling filters; the state follows the emitted
    tokens; a row ends at the end-of-sequence token, which the automaton allows in its
    accepting states, and alone once the pattern can go no further);
    chain_as_tree: verify a chain as the tree with one child per node, without the chain's
    fast path (the measurement behind it: benchmarks/chain_fast_path.py).
    Raises ValueError for a combination a rule or an extension refuses."""
    G = 0 if drafter is None else (drafter.gamma if gamma is None else gamma)
    attention = cfg.target_attention()
    capture = ()
    if drafter is not None:  # the drafter's attention kernel, fixed by cfg
        drafter = kernel_policy.with_drafter_attention(drafter, cfg.drafter_attention())
        capture = drafter.capture
    own_tree = drafter is not None and hasattr(drafter, "propose_tree")  # a TreeDrafter
    tree_mode = G > 0 and (cfg.num_drafts > 1 or own_tree or chain_as_tree)
    if cfg.exact and tree_mode:
        raise ValueError("exact=True verifies chains only (no draft trees, num_drafts 1)")
    reads_logits = getattr(drafter, "reads_logits", False)
    # a mode extends speculation; autoregressive decoding runs without (as the fallback
    # program of an adaptive engine, built from the same config)
    extensions = cfg.extensions() if drafter is not None else ()
    for ext in extensions:
        ext.check(cfg, drafter, tree_mode)
    forward_ext = next((e for e in extensions if e.replaces_forward), None)
    rule = cfg.rule()
    fused = cfg.fused_verify() if G > 0 and not tree_mode else None
    if tree_mode:
        tree_rule = rule.tree_rule(
            max_depth=G, max_children=drafter.max_children if own_tree else cfg.num_drafts,
            drafts=not own_tree)
    if drafter is not None:  # after a tree of proposals whose states were dropped
        drafter_update = (getattr(drafter, "update_after_tree", drafter.update)
                          if tree_mode and not chain_as_tree else drafter.update)
    offsets = jnp.arange(G + 1, dtype=jnp.int32)

    def keys(s: LoopState):
        """(next loop key, drafting key, verification key)."""
        if drafter is None:
            key, k_verify = jax.random.split(s.key)
            return key, None, k_verify
        return tuple(jax.random.split(s.key, 3))

    def start(params, drafter_params, prompts, prompt_lengths, budgets, key) -> LoopState:
        model = nnx.merge(graphdef, params)
        s, view = prefill(model, cfg, prompts, prompt_lengths, budgets, key, G, capture,
                          drafter, (inputs or {}).get(CONSTRAINT))
        if drafter is not None:
            key, k_init = jax.random.split(s.key)
            with jax.named_scope("drafter_init"):
                s = s.replace(drafter_state=drafter.init(drafter_params, view, k_init),
                              key=key)
        given = inputs or {}
        return s.replace(ext={e.name: e.init(model, cfg, drafter, s, given.get(e.name))
                              for e in extensions})

    def propose(params, drafter_params, s: LoopState):
        del params
        if G == 0:
            return Chain(jnp.zeros((s.tokens.shape[0], 0), jnp.int32), None, s.drafter_state)
        _, k_draft, _ = keys(s)
        view = propose_view(s)
        # Named scopes label the HLO ops for benchmarks/profile_step.py (no run-time cost).
        with jax.named_scope("drafter_propose"):
            if own_tree:
                return drafter.propose_tree(drafter_params, s.drafter_state, view, k_draft)[0]
            if tree_mode and not chain_as_tree:
                return propose_drafts(drafter, drafter_params, s.drafter_state, view,
                                      k_draft, cfg.num_drafts, view.pending)
            return Chain(*drafter.propose(drafter_params, s.drafter_state, view, k_draft))

    def finish(params, drafter_params, s: LoopState, proposal) -> LoopState:
        model = nnx.merge(graphdef, params)
        key, _, k_verify = keys(s)
        base = s.lengths - 1  # the pending token's (the root's) position and slot
        if isinstance(proposal, Chain):  # the drafter's state after proposing
            drafter_state = proposal.state
            if chain_as_tree:  # the tree with one child per node (a measurement)
                proposal = chain_tree(take_rows(s.tokens, base), proposal.draft,
                                      None if cfg.sampling.greedy else proposal.q)
        else:  # a tree: its proposals' states were dropped
            drafter_state = s.drafter_state
        if tree_mode:
            fed, positions = proposal.tokens, base[:, None] + proposal.depths
            mask = ancestor_mask(proposal, G)
        else:
            fed = jnp.concatenate([take_rows(s.tokens, base)[:, None], proposal.draft], axis=1)
            positions, mask = base[:, None] + offsets[None, :], None
        with jax.named_scope("target_verify_forward"):
            if forward_ext is None:
                out = model(fed, positions, s.cache, capture=capture, attention=attention,
                            tree_mask=mask, invariant_rows=cfg.invariant_rows())
                logits, hidden, cache = out.logits, out.hidden, out.cache
            else:  # e.g. SpecPV (lossy): a plain, full or partial forward, chosen per step
                logits, hidden, cache, mine = forward_ext.verify_forward(
                    model, s.ext[forward_ext.name], s, fed, positions, capture, attention)
                s = s.replace(ext={**s.ext, forward_ext.name: mine})
        node_states = None
        if s.constraint is not None:  # the target's distribution under the constraint
            with jax.named_scope("constraint_mask"):
                node_states = (s.constraint.node_states(proposal.tokens, proposal.parents, G)
                               if tree_mode else
                               s.constraint.node_states(fed, None, G))  # [B,N]
                logits = s.constraint.verify_logits(logits, node_states)
        path = None
        with jax.named_scope("verify_rule"):
            if G == 0:  # autoregressive: the next token straight from the logits
                draft, tau = proposal.draft, jnp.zeros_like(s.lengths)
                next_token, _ = sample_logits(k_verify, logits[:, 0], cfg.sampling)
            elif tree_mode:
                tau, next_token, path = tree_rule(
                    proposal, filtered_probs(logits, cfg.sampling), k_verify)
                draft = path_tokens(proposal, path)[:, 1:]  # [B,G] the accepted path
            elif fused is not None:
                draft = proposal.draft
                tau, next_token = fused(logits, draft, proposal.q, k_verify)
            else:
                draft = proposal.draft
                tau, next_token = rule.chain(draft, proposal.q, logits, k_verify, cfg.sampling)
        tokens, lengths, done, active = emit(s, cfg, draft, tau, next_token)
        last = tau  # the last accepted node
        if path is not None:
            cache = compact_path(cache, base, path)
            if hidden is not None:  # [C,B,N,D] -> the path's [C,B,G+1,D]
                hidden = jnp.take_along_axis(hidden, path[None, :, :, None], axis=2)
            last = take_rows(path, tau)
        cache = cache.rewind(lengths - 1)
        constraint = s.constraint
        if constraint is not None:  # the state follows the emitted tokens
            constraint = constraint.follow(node_states, last, next_token, active > 0)
        new = advance(s, tokens, lengths, done, active, cache, drafter_state, key, tau,
                      drafted=G).replace(constraint=constraint)
        if drafter is None:
            return new
        after = LoopView(tokens, lengths, cache, hidden, base[:, None] + offsets[None, :],
                         logits=take_rows(logits, last) if reads_logits else None,
                         constraint=constraint)
        with jax.named_scope("drafter_update"):
            if update is not None:
                return update(drafter_params, new, after, tau)
            return new.replace(drafter_state=drafter_update(drafter_params, new.drafter_state,
                                                            after, tau))

    return Phases(start, propose, finish)
