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


def best_first_tree(pending, scores, tokens, nodes: int, vocab=None) -> DraftTree:
    """The exact best `nodes` - 1 prefixes of a block of independent per-position draft
    distributions, as a DraftTree (DDTree's best-first heap: "Accelerating speculative
    decoding with block diffusion draft trees", arXiv 2604.12989).

    pending: i32[B] the root tokens; scores: f32[B,G,K] log q_d of position d's top-K
    tokens, sorted best first along K (`lax.top_k` of a log_softmax); tokens: i32[B,G,K]
    those tokens; nodes: N (static), the budget with the root; vocab: V for q one-hot at
    each node's token (deterministic choices, sampling), None for q = None (greedy).

    A prefix x_1..x_d (d <= G, x_k among the top-K of position k) scores
    sum_k log q_k(x_k). The tree holds the N - 1 best prefixes; it is closed under
    ancestors because log q <= 0 (a prefix scores at least as much as its extensions).
    The search pops the best candidate N - 1 times (a `lax.fori_loop`) from a static
    array of 1 + 2(N - 1) slots per row: the first candidate is position 1's rank-0
    token; popping (depth d, rank r) records it as the next node and pushes its first
    child (depth d + 1, rank 0; d < G) and its next sibling (depth d, rank r + 1;
    r + 1 < K), scores summed left to right from the parent's. Every prefix is pushed by
    exactly one predecessor (its parent for rank 0, its previous sibling otherwise) whose
    score is at least its own, so the pops come in descending score, every prefix after
    its parent: node i is the i-th pop (parents[i] < i). Ties go to the shallower slot,
    then the lower rank, then the earlier push; a predecessor is never deeper, so among
    prefixes of one score the shallower ones are kept.

    Nodes the budget has no prefix for (N - 1 > sum_d K^d), and prefixes of score -inf,
    are unused (valid False, parent -1, depth 0, token the root's). Same conventions as
    `tree_from_candidates`."""
    B, G, K = scores.shape
    rows = jnp.arange(B)

    def children(prev, d):  # independent positions: the same children for every parent
        del prev
        return scores[rows, d], tokens[rows, d]

    return best_first_path_tree(pending, children, G, K, nodes, vocab)


def best_first_path_tree(pending, children, gamma: int, topk: int, nodes: int,
                         vocab=None) -> DraftTree:
    """`best_first_tree` where a node's children depend on its token: the exact best
    `nodes` - 1 prefixes by summed child log-probability, as a DraftTree.

    children(prev i32[B], d i32[B]) -> (log-probabilities f32[B,K] sorted best first,
    tokens i32[B,K]): the K candidate children at 0-based position d of a node whose
    token is prev (the root's: `pending`) — e.g. DFlash2's path selector, whose
    distribution at position d is conditioned on the token before it
    (`specjax.drafters.selector.children`). Each popped node's children are computed
    once and kept in a per-node table [B,N,K]; siblings are walked in that order, so
    every prefix is still pushed by exactly one predecessor scoring at least as much
    (the order and tie rules of `best_first_tree`). gamma: G, the deepest position;
    topk: K; nodes, vocab: as `best_first_tree`."""
    G, K, N = gamma, topk, nodes
    C = 1 + 2 * (N - 1)
    i32 = jnp.int32
    pending = pending.astype(i32)
    B = pending.shape[0]
    rows = jnp.arange(B)
    slot = jnp.arange(C, dtype=i32)
    root_s, root_t = children(pending, jnp.zeros((B,), i32))
    f32 = root_s.dtype
    # per-node child tables: node n's children, sorted (scores, tokens) [B,N,K]
    ch_s = jnp.full((B, N, K), -jnp.inf, f32).at[:, 0].set(root_s)
    ch_t = jnp.zeros((B, N, K), i32).at[:, 0].set(root_t.astype(i32))
    # candidate slots: alive, score, the parent's score, depth (1..G), rank, parent node
    cand = (jnp.zeros((B, C), bool).at[:, 0].set(True),
            jnp.full((B, C), -jnp.inf, f32).at[:, 0].set(root_s[:, 0]),
            jnp.zeros((B, C), f32), jnp.ones((B, C), i32), jnp.zeros((B, C), i32),
            jnp.zeros((B, C), i32))
    out = (jnp.broadcast_to(pending[:, None], (B, N)),  # tokens
           jnp.full((B, N), -1, i32), jnp.zeros((B, N), i32),  # parents, depths
           jnp.zeros((B, N), bool).at[:, 0].set(True))  # valid

    def pop(t, carry):
        (alive, score, base, depth, rank, parent), (otok, opar, odep, oval), (cs, ct) = carry
        # the best alive slot: score desc, then depth, then rank, then slot (push order)
        best = jnp.max(jnp.where(alive, score, -jnp.inf), axis=1, keepdims=True)
        tied = alive & (score == best)
        d_min = jnp.min(jnp.where(tied, depth, G + 1), axis=1, keepdims=True)
        tied &= depth == d_min
        r_min = jnp.min(jnp.where(tied, rank, K), axis=1, keepdims=True)
        tied &= rank == r_min
        c = jnp.argmax(tied, axis=1)  # the first tied slot; 0 when none is alive
        any_alive = alive.any(axis=1)
        s, b0, d, r, p = (x[rows, c] for x in (score, base, depth, rank, parent))
        ok = any_alive & jnp.isfinite(s)
        node = t + 1
        tok = jnp.where(ok, ct[rows, p, r], pending)
        otok = otok.at[:, node].set(tok)
        opar = opar.at[:, node].set(jnp.where(ok, p, -1))
        odep = odep.at[:, node].set(jnp.where(ok, d, 0))
        oval = oval.at[:, node].set(ok)
        alive = alive & (slot[None, :] != c[:, None])
        # this node's children (position d, 0-based; clamped where d = G: never pushed)
        ks, kt = children(tok, jnp.minimum(d, G - 1))
        cs = cs.at[:, node].set(ks.astype(f32))
        ct = ct.at[:, node].set(kt.astype(i32))
        # push the first child into slot 1 + 2t and the next sibling into slot 2 + 2t
        rs = jnp.minimum(r + 1, K - 1)
        child = (any_alive & (d < G), s + ks[:, 0], s, d + 1, jnp.zeros_like(r),
                 jnp.full_like(p, node))
        sib = (any_alive & (r + 1 < K), b0 + cs[rows, p, rs], b0, d, r + 1, p)
        new = []
        for field, xc, xs in zip((alive, score, base, depth, rank, parent), child, sib,
                                 strict=True):
            field = field.at[:, 1 + 2 * t].set(xc.astype(field.dtype))
            new.append(field.at[:, 2 + 2 * t].set(xs.astype(field.dtype)))
        return tuple(new), (otok, opar, odep, oval), (cs, ct)

    _, (otok, opar, odep, oval), _ = jax.lax.fori_loop(0, N - 1, pop, (cand, out, (ch_s, ch_t)))
    q = None
    if vocab is not None:
        q = jax.nn.one_hot(otok, vocab, dtype=jnp.float32).at[:, 0].set(0.0)
    return DraftTree(tokens=otok, parents=opar, depths=odep, valid=oval, q=q)
