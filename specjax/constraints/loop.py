"""A batch's constraints as the arrays the compiled loop reads (`Constraint`), and the
operations the loop and the drafters apply with them (issue 55; docs/structured.md).

Every row follows one automaton (`specjax.constraints.automaton.TokenAutomaton`); rows
without a constraint follow a one-state automaton that allows every token. The automata
of a batch are stacked into one table: their states are numbered one after another
(automaton a's state s is `offset[a] + s`) and their token classes are padded to the
widest, so a row's state is one int and a step is two gathers:

    token_class  i32[A,V]   class of each token id under automaton a
    next_state   i32[S,C]   next (global) state of class c in state s; DEAD (-1): not allowed
    automaton    i32[B]     the automaton of each row
    state        i32[B]     each row's state after its committed tokens (pending included)

Exactness (docs/design.md section 4, "Constraints"; docs/structured.md): the target's
distribution at every verify position is masked to the tokens its prefix's state allows
(logits -inf elsewhere) BEFORE temperature, top-k and top-p, so every rule verifies
against the constrained target, whatever the drafter proposed: a draft the constraint
forbids has probability 0 and is rejected. Drafters that mask their own q the same way (`draft_logits`) propose
only allowed tokens, each from the masked, renormalised distribution that the returned q
is; that is still an autoregressive proposal (q_k depends on x_<k only), so every
verification rule stays exact.

A DEAD state (a draft the constraint forbids, or a node below one) allows every token:
its position can only be reached through a rejected draft, and a position with nothing
allowed would give NaN probabilities.
"""

# ruff: noqa: F722  (jaxtyping's shape strings are not Python expressions)

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Int

from specjax.constraints.automaton import DEAD, TokenAutomaton
from specjax.core.drafter import take_rows


@struct.dataclass
class Constraint:
    """The batch's constraint tables and each row's state (module docstring)."""

    token_class: Int[Array, "A V"]
    next_state: Int[Array, "S C"]
    automaton: Int[Array, " B"]
    state: Int[Array, " B"]

    def _rows(self, x):
        """automaton i32[B] broadcast against x [B, ...]."""
        return self.automaton.reshape(self.automaton.shape + (1,) * (x.ndim - 1))

    def step(self, state, token):
        """i32[B,...]: the state after `token` i32[B,...] in `state` i32[B,...] (DEAD if the
        token is not allowed there, or the state was DEAD)."""
        cls = self.token_class[self._rows(state), token]
        nxt = self.next_state[jnp.maximum(state, 0), cls]
        return jnp.where(state == DEAD, DEAD, nxt)

    def allowed(self, state):
        """bool[B,...,V]: the tokens allowed in `state` i32[B,...] (every token where DEAD)."""
        rows = self.next_state[jnp.maximum(state, 0)]  # [B,...,C]
        cls = self.token_class[self.automaton]  # [B,V]
        cls = cls.reshape(cls.shape[:1] + (1,) * (state.ndim - 1) + cls.shape[1:])
        cls = jnp.broadcast_to(cls, state.shape + cls.shape[-1:])
        ok = jnp.take_along_axis(rows, cls, axis=-1) != DEAD
        return ok | (state == DEAD)[..., None]

    def mask(self, logits, state):
        """f32[B,...,V]: logits with the tokens `state` i32[B,...] forbids at -inf."""
        return jnp.where(self.allowed(state), logits, -jnp.inf)

    def verify_logits(self, logits, node_states):
        """The target's verify logits f32[B,N,V] under the constraint: masked in each
        node's state i32[B,N] (`node_states`)."""
        return self.mask(logits, node_states)

    def follow(self, node_states, last, next_token, active) -> Constraint:
        """The rows' constraint after a step: the state of the last accepted node (`last`
        i32[B], an index into node_states i32[B,N]) stepped by the emitted `next_token`
        i32[B]; rows not `active` (bool[B]) keep theirs."""
        after = self.step(take_rows(node_states, last), next_token)
        return self.replace(state=jnp.where(active, after, self.state))

    def node_states(self, tokens, parents, depth: int):
        """i32[B,N]: the state after each node of a draft tree (node 0, the pending token,
        is the row's state; node n's is its parent's stepped by its token). tokens,
        parents i32[B,N] (`specjax.core.tree.DraftTree`; parents None: a chain, node j's
        parent j - 1); depth: the tree's largest depth (G)."""
        B, N = tokens.shape
        if parents is None:
            parents = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32) - 1, (B, N))
        root = jnp.arange(N)[None, :] == 0
        states = jnp.broadcast_to(self.state[:, None], (B, N))
        for _ in range(depth):  # after d rounds every node of depth <= d is right
            up = jnp.take_along_axis(states, jnp.maximum(parents, 0), axis=1)
            states = jnp.where(root, self.state[:, None], self.step(up, tokens))
        return states


def draft_logits(constraint: Constraint | None, logits, state):
    """A drafter's logits f32[B,V] masked in `state` i32[B] (unchanged without a
    constraint): what it samples from and returns as q under a constraint."""
    return logits if constraint is None else constraint.mask(logits, state)


def draft_state(constraint: Constraint | None, state, token):
    """The drafter's constraint state after drafting `token` (None without a constraint)."""
    return None if constraint is None else constraint.step(state, token)


def row_state(constraint: Constraint | None):
    """Each row's state i32[B] after its committed tokens (None without a constraint)."""
    return None if constraint is None else constraint.state


def free_automaton(vocab_size: int) -> TokenAutomaton:
    """The one-state automaton that allows every token (rows without a constraint)."""
    return TokenAutomaton("", np.zeros(vocab_size, np.int32), np.zeros((1, 1), np.int32),
                          np.zeros(1, bool))


def stack_automata(automata: Sequence[TokenAutomaton], eos_ids, vocab_size: int
                   ) -> tuple[Constraint, np.ndarray]:
    """The tables of `automata` plus the one-state automaton of unconstrained rows (last),
    host-side (numpy -> jnp), with no rows yet (automaton and state i32[0]); and the start
    state of each automaton i32[A] (the unconstrained one last). eos_ids: the target's
    end-of-sequence ids: a state in which an automaton allows no token at all allows them
    (the row ends there, its output incomplete); vocab_size: V.
    Raises ValueError for an automaton over another vocabulary width, or a state that
    allows nothing when there is no end-of-sequence id to allow."""
    if any(a.token_class.shape[0] != vocab_size for a in automata):
        raise ValueError(f"an automaton was compiled for another vocabulary width than "
                         f"{vocab_size}")
    table = [*automata, free_automaton(vocab_size)]
    C = max(a.num_classes for a in table)
    offsets = np.cumsum([0] + [a.num_states for a in table])
    next_state = np.full((offsets[-1], C), DEAD, np.int32)
    eos = [int(e) for e in eos_ids if 0 <= int(e) < vocab_size]
    for a, off in zip(table, offsets[:-1], strict=False):
        next_state[off:off + a.num_states, :a.num_classes] = np.where(
            a.next_state == DEAD, DEAD, a.next_state + off)
        stuck = np.flatnonzero(~np.any(a.next_state != DEAD, axis=1))
        if len(stuck):  # nothing allowed (a pattern no token can go on with): end the row
            if not eos:
                raise ValueError(f"automaton {a.pattern[:60]!r}: state {stuck[0]} allows no "
                                 "token and there is no end-of-sequence id")
            eos_cls = np.unique(a.token_class[eos])
            for s_ in stuck:
                next_state[off + s_, eos_cls] = off + s_
    none = jnp.zeros((0,), jnp.int32)
    tables = Constraint(
        token_class=jnp.asarray(np.stack([a.token_class for a in table]), jnp.int32),
        next_state=jnp.asarray(next_state), automaton=none, state=none)
    return tables, offsets[:-1].astype(np.int32)


def with_rows(tables: Constraint, starts: np.ndarray, rows: Sequence[int | None]
              ) -> Constraint:
    """`stack_automata`'s tables with B rows: row b follows automaton rows[b] (an index
    into the stacked automata; None: unconstrained) from its start state.
    Raises ValueError for an index out of range."""
    free = len(starts) - 1
    bad = [r for r in rows if r is not None and not 0 <= r < free]
    if bad:
        raise ValueError(f"row automaton index {bad[0]} out of range ({free} automata)")
    which = np.asarray([free if r is None else r for r in rows], np.int32)
    return tables.replace(automaton=jnp.asarray(which), state=jnp.asarray(starts[which]))


def build_constraint(automata: Sequence[TokenAutomaton], rows: Sequence[int | None],
                     eos_ids, vocab_size: int) -> Constraint:
    """The `Constraint` of a batch, host-side: `stack_automata` then `with_rows`.
    automata: the distinct automata; rows: for each of the B rows the index of its
    automaton in `automata`, or None for no constraint. Raises what they raise."""
    return with_rows(*stack_automata(automata, eos_ids, vocab_size), rows)


__all__ = ["Constraint", "build_constraint", "draft_logits", "draft_state",
           "free_automaton", "row_state", "stack_automata", "with_rows"]
