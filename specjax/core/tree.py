"""Draft trees with a static node budget: the fixed-shape structure the speculative loop
carries when a step verifies more than one chain (docs/design.md, "Draft trees").

A tree of N nodes per row (N static). Node 0 is the root: the row's pending token
(committed, its target K/V not cached yet). Every other node is one draft token whose
parent comes earlier in the node order (topological: parents[i] < i), so one pass in
index order visits parents before children. The depth of a node is its distance from the
root (root 0, at most G); its position is the root's position plus its depth. Unused
nodes (a budget that a source does not fill) have valid = False and are never accepted,
attended to or attended from.

  tokens:  i32[B,N]   node tokens (tokens[:, 0] = the pending token)
  parents: i32[B,N]   parent node index (-1 for the root and for unused nodes)
  depths:  i32[B,N]   root 0; unused nodes 0
  valid:   bool[B,N]  node in the tree (valid[:, 0] = True)
  q:       f32[B,N,V] or None: q[b, i] is the draft distribution node i was proposed
           from (the drafter's filtered distribution at its parent; one-hot at the token
           for a deterministic choice such as a top-K child); q[:, 0] is unused. None at
           temperature 0, where only tokens matter.

A chain of G drafts is the tree with N = G + 1 and parents = [-1, 0, 1, ..., G-1].
The verdict of a tree (`specjax.decoding.tree_verify`) is the accepted path: node
indices path i32[B,G+1] with path[:, 0] = 0 and path[:, j] the accepted node of depth j
for j <= tau (entries past tau repeat the last accepted node).

`DraftTree`'s fields carry these shapes as jaxtyping annotations: documentation, not
checked at run time in the library (tests/core/test_shapes.py checks real trees).
"""

# ruff: noqa: F722  (jaxtyping's shape strings are not Python expressions)

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int


@struct.dataclass
class DraftTree:
    """See the module docstring for the fields and their shapes."""

    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]
    depths: Int[Array, "B N"]
    valid: Bool[Array, "B N"]
    q: Float[Array, "B N V"] | None = None

    @property
    def num_nodes(self) -> int:
        """N, the static node budget (root included)."""
        return self.tokens.shape[1]


def chain_tree(pending, draft, q=None) -> DraftTree:
    """The chain [pending, x_1..x_G] as a tree of N = G + 1 nodes.

    pending: i32[B]; draft: i32[B,G]; q: f32[B,G,V] (the chain's draft distributions) or
    None."""
    B, G = draft.shape
    idx = jnp.arange(G + 1, dtype=jnp.int32)
    tokens = jnp.concatenate([pending[:, None].astype(jnp.int32), draft.astype(jnp.int32)], 1)
    qn = None
    if q is not None:
        qn = jnp.concatenate([jnp.zeros_like(q[:, :1]), q], axis=1)
    return DraftTree(tokens=tokens, parents=jnp.broadcast_to(idx - 1, (B, G + 1)),
                     depths=jnp.broadcast_to(idx, (B, G + 1)),
                     valid=jnp.ones((B, G + 1), bool), q=qn)


def tree_from_drafts(pending, drafts, q=None) -> DraftTree:
    """K drafts of length G per row as a tree of N = 1 + K*G nodes: every draft is its own
    branch from the root (no prefix sharing), draft k's token j is node 1 + k*G + j.

    pending: i32[B]; drafts: i32[B,K,G]; q: f32[B,K,G,V] (draft k's distributions) or
    None. Drafts that share a prefix stay separate branches; verification treats them as
    siblings (a duplicate of a rejected sibling is rejected again, see tree_verify)."""
    B, K, G = drafts.shape
    j = jnp.arange(G, dtype=jnp.int32)
    k = jnp.arange(K, dtype=jnp.int32)
    node = 1 + k[:, None] * G + j[None, :]  # [K,G]
    parent = jnp.where(j[None, :] == 0, 0, node - 1)
    parents = jnp.concatenate([jnp.array([-1], jnp.int32), parent.reshape(-1)])
    depths = jnp.concatenate([jnp.array([0], jnp.int32),
                              jnp.broadcast_to(j[None, :] + 1, (K, G)).reshape(-1)])
    tokens = jnp.concatenate([pending[:, None].astype(jnp.int32),
                              drafts.reshape(B, K * G).astype(jnp.int32)], axis=1)
    qn = None
    if q is not None:
        V = q.shape[-1]
        qn = jnp.concatenate([jnp.zeros((B, 1, V), q.dtype), q.reshape(B, K * G, V)], 1)
    N = 1 + K * G
    return DraftTree(tokens=tokens, parents=jnp.broadcast_to(parents, (B, N)),
                     depths=jnp.broadcast_to(depths, (B, N)), valid=jnp.ones((B, N), bool),
                     q=qn)


def ancestor_mask(tree: DraftTree, max_depth: int) -> jax.Array:
    """bool[B,N,N]: mask[b, i, j] = node j is node i itself or one of its ancestors (the
    tree attention mask: node i attends to the committed prefix and to these nodes).
    Unused nodes see only themselves (their rows are never read). `max_depth` (static)
    bounds the depth of every node (G)."""
    B, N = tree.parents.shape
    eye = jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N))
    mask, cur = eye, jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    for _ in range(max_depth):  # walk up one level per iteration
        cur = jnp.where(cur >= 0, jnp.take_along_axis(tree.parents, jnp.maximum(cur, 0), 1), -1)
        mask = mask | ((cur[:, :, None] == jnp.arange(N)[None, None, :]) & (cur >= 0)[..., None])
    return (mask & tree.valid[:, :, None]) | eye


def path_tokens(tree: DraftTree, path) -> jax.Array:
    """i32[B,G+1]: the tokens of the nodes on `path` (i32[B,G+1] node indices)."""
    return jnp.take_along_axis(tree.tokens, path, axis=1)


def tree_from_candidates(pending, score, tokens, parent, depth, nodes: int, vocab=None
                         ) -> DraftTree:
    """The best `nodes` - 1 of M scored candidates as a DraftTree (EAGLE-2's rerank).

    pending: i32[B] the root tokens; score: f32[B,M] cumulative draft log-probabilities
    (-inf: not a candidate); tokens: i32[B,M]; parent: i32[B,M] the parent's candidate
    index (-1: a child of the root); depth: i32[M] (static layout); candidates must be in
    an order where a parent comes before its children. The N - 1 = `nodes` - 1 best by
    score are kept (`lax.top_k`: the lower index first on ties, so a parent, whose score
    is >= its child's, is kept before it and the set is closed under ancestors), laid out
    in candidate order after node 0 = the root. Candidates of score -inf are unused
    nodes. vocab: V for one-hot q at each node (deterministic children, sampling), None
    for no q (greedy)."""
    B, M = score.shape
    i32 = jnp.int32
    rows = jnp.arange(B)[:, None]
    _, best = jax.lax.top_k(score, nodes - 1)
    order = jnp.sort(best, axis=1)  # [B,N-1] candidate order: parents first
    node_of = jnp.zeros((B, M), i32).at[rows, order].set(
        jnp.broadcast_to(jnp.arange(1, nodes, dtype=i32), order.shape))
    pg = jnp.take_along_axis(parent, order, axis=1)
    parents = jnp.where(pg >= 0, jnp.take_along_axis(node_of, jnp.maximum(pg, 0), 1), 0)
    valid = jnp.isfinite(jnp.take_along_axis(score, order, axis=1))
    toks = jnp.concatenate([pending.astype(i32)[:, None],
                            jnp.take_along_axis(tokens, order, 1).astype(i32)], 1)
    true = jnp.ones((B, 1), bool)
    return DraftTree(
        tokens=toks,
        parents=jnp.concatenate([jnp.full((B, 1), -1, i32), jnp.where(valid, parents, -1)], 1),
        depths=jnp.concatenate([jnp.zeros((B, 1), i32), jnp.where(valid, depth[order], 0)], 1),
        valid=jnp.concatenate([true, valid], 1),
        q=None if vocab is None else jax.nn.one_hot(toks, vocab, dtype=jnp.float32)
        .at[:, 0].set(0.0))


def candidate_depths(topk: int, gamma: int) -> jax.Array:
    """i32[K + (G-1)*K*K]: the depth of each candidate of EAGLE-2's expansion (K at depth
    1, then K*K per depth), in candidate order (`tree_from_candidates`' `depth`)."""
    return jnp.concatenate([jnp.ones((topk,), jnp.int32)] + [
        jnp.full((topk * topk,), d + 1, jnp.int32) for d in range(1, gamma)])


def expand_frontier(scores, parent_ids, child_logp, child_tokens, start: int):
    """One depth of EAGLE-2's expansion. scores f32[B,K] and parent_ids i32[B,K] (their
    candidate indices) of the K frontier nodes; child_logp f32[B,K,K] and child_tokens
    i32[B,K,K] each node's top-K children. -> (candidates: (score f32[B,K*K], token
    i32[B,K*K], parent i32[B,K*K]), the next frontier: (scores f32[B,K], candidate
    indices i32[B,K] counted from `start`, the chosen children's positions ni i32[B,K]
    in the K*K candidates))."""
    B, K = scores.shape
    cand_s = (scores[:, :, None] + child_logp).reshape(B, K * K)
    cand_t = child_tokens.astype(jnp.int32).reshape(B, K * K)
    cand_p = jnp.repeat(parent_ids, K, axis=1)
    fs, ni = jax.lax.top_k(cand_s, K)
    ni = ni.astype(jnp.int32)
    return (cand_s, cand_t, cand_p), (fs, start + ni, ni)
