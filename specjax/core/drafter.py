"""The drafter interface the speculative loop calls (docs/design.md section 5), in the
floor package that drafters and decoding both import (`specjax.core`).

A drafter is a frozen, hashable object (a static argument of `jax.jit`) plus a
params pytree (a jit argument) and a state pytree it threads through the loop. The
loop calls, inside one compiled `lax.while_loop`:

  state = drafter.init(params, view, key)                after the target prefill
  draft, q, state = drafter.propose(params, state, view, key)      every step
  state = drafter.update(params, state, view, num_accepted)        after verification

`view` is a `LoopView`: the committed tokens and per-row lengths, the target's KV
cache and the target hidden states at the depths the drafter asked for in
`capture` (from the prefill for `init`, from the verify forward for `update`).
Hidden-state, KV-reuse and block drafters of later issues fit this interface: they
read `view.hidden` and `view.target_cache` in place.

`LoopView`'s fields and the protocols' signatures carry jaxtyping shape annotations
(docs/design.md section 2's letters; S for the token buffer's width S'). They are
documentation: nothing checks them at run time in the library; tests/core/test_shapes.py
checks real values against them.
"""

# ruff: noqa: F722  (jaxtyping's shape strings are not Python expressions)

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int, PRNGKeyArray

from specjax.core.sampling import SamplingParams
from specjax.core.tree import DraftTree
from specjax.models.kv_cache import KVCache

# The attention kernel a learned drafter may attend with (`specjax.drafters.attend.attend`'s
# `kernel`; `specjax.decoding.kernel_policy` chooses it):
# fn(q [B,T,N,H], k [B,K,S,H], v [B,K,S,H], limit i32[B,T]) -> (o [B,T,N,H], lse f32[B,T,N])
AttentionKernel = Callable


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for every row b: x [B,T,...], index i32[B] -> [B,...]."""
    return jnp.take_along_axis(x, index.reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]


@struct.dataclass
class LoopView:
    """What a drafter may read from the loop.

    tokens: i32[B,S'] committed tokens (prompt + output); row b's tokens 0..lengths-1
      are valid and token lengths-1 is pending (its target K/V not yet cached).
    lengths: i32[B].
    target_cache: the target KVCache (k, v [L,B,K,S,H]).
    hidden: [C,B,T,D] target residual stream at `Drafter.capture` depths for the
      tokens of the latest target forward (prefill: the prompt; verify: the G+1 fed
      tokens), or None when `capture` is empty.
    positions: i32[B,T] positions of those tokens.
    prefill_sizes: the static piece sizes of the loop's prefill
      (`LoopConfig.prefill_sizes()`, not a pytree leaf), for a drafter's own pass over
      the prompt in `init`; () outside the prefill.
    logits: f32[B,V] the target's logits that the pending token came from (prefill: at
      the last prompt token; after a step: at the last accepted token), in `init` and
      `update` (None in `propose`). LogitSpec reads its next-next-token guesses here.
    constraint: the rows' `specjax.constraints.loop.Constraint` (its `state`: each row's
      automaton state after the pending token), or None. A drafter that masks its draft
      logits with it (`specjax.constraints.loop.draft_logits`, stepping the state with
      each token it drafts) proposes only allowed tokens; one that does not stays exact
      (the masked target rejects a forbidden draft), at a lower acceptance.
    """

    tokens: Int[Array, "B S"]
    lengths: Int[Array, " B"]
    target_cache: KVCache
    hidden: Float[Array, "C B T D"] | None
    positions: Int[Array, "B T"]
    prefill_sizes: tuple[int, ...] = struct.field(pytree_node=False, default=())
    logits: Float[Array, "B V"] | None = None
    constraint: Any = None

    @property
    def pending(self) -> Int[Array, " B"]:
        """i32[B]: each row's pending token, tokens[b, lengths[b] - 1]."""
        return take_rows(self.tokens, self.lengths - 1)


class Drafter(Protocol):
    """Proposes G draft tokens with their (filtered) draft distributions q."""

    gamma: int  # G, the draft length
    capture: tuple[int, ...]  # target depths the drafter needs in `LoopView.hidden`
    sampling: SamplingParams

    def init(self, params: Any, view: LoopView, key: PRNGKeyArray) -> Any: ...

    def propose(self, params: Any, state: Any, view: LoopView, key: PRNGKeyArray
                ) -> tuple[Int[Array, "B G"], Float[Array, "B G V"], Any]:
        """-> draft i32[B,G], q f32[B,G,V] (filtered; one-hot when greedy), new state."""
        ...

    def update(self, params: Any, state: Any, view: LoopView, num_accepted: Int[Array, " B"]
               ) -> Any:
        """State after the target accepted `num_accepted` (i32[B]) drafts; `view.lengths`
        already counts them and the correction/bonus token."""
        ...


def drafter_report(drafter: Any, state: Any) -> dict:
    """{counter: array} a drafter reports about its own work at the end of a loop (its
    optional `report(state)` method: medc's draft reuse counts), {} for a drafter without
    one. The loop reads a drafter's state only through this."""
    report = getattr(drafter, "report", None)
    return {} if report is None else report(state)


class TreeDrafter(Drafter, Protocol):
    """A drafter that proposes a draft tree itself (LogitSpec's retrieval tree, EAGLE-2's
    dynamic tree) instead of one chain: the loop calls `propose_tree` in place of
    `propose` and verifies the tree (`specjax.core.tree`, `tree_verify`); `update`
    then sees the accepted path as if it had been a chain (view.positions = the root's
    position + 0..G, view.hidden the path's hidden states)."""

    tree_nodes: int  # N, the static node budget (root included)
    max_children: int  # the most children any node has (the token rule's sibling loop)

    def propose_tree(self, params: Any, state: Any, view: LoopView, key: PRNGKeyArray
                     ) -> tuple[DraftTree, Any]:
        """-> (DraftTree with N = tree_nodes and depths <= gamma, new state)."""
        ...
