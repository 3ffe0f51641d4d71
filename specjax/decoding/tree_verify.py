"""Verification of a draft tree (`specjax.core.tree.DraftTree`): greedy, token-level
recursive rejection sampling over siblings, and multi-draft block verification.

Every rule takes the tree, the target's filtered distributions p f32[B,N,V] (p[b, i] is
the target's distribution of the token that follows node i; node 0 is the root, the
pending token) and a PRNG key, and returns a `TreeVerdict`: the row emits the tokens of
path[:, 1..tau] and then `next_token` (the correction, or the bonus when the walk ends on
a node with nothing left to try). B rows, N nodes, G = max_depth, V vocabulary. All
shapes are static and every function is jit-able (loops run over static G, over the
static `max_children` or over the static number of drafts K).

Rules
-----
greedy: from the root, move to the lowest-index valid child whose token is argmax p at
  the current node; emit argmax p at the last node.

token (`verify_tree_token`): recursive rejection sampling over siblings (SpecInfer,
  Miao et al. 2023, arXiv 2305.09781, "multi-step speculative sampling"; the sampling
  branch of EAGLE-2's evaluate_posterior). At the current node the residual target r
  starts as p[node]; its valid children c_1, c_2, ... (index order) are tried in turn:
  child c with token x is accepted w.p. min(1, r(x)/q_c(x)); on rejection
  r <- norm(max(r - q_c, 0)). The first accepted child becomes the current node (r =
  p[child]); if none is accepted, next_token ~ r; at depth G, next_token ~ p[node].
  Exact when each child was drawn from its q_c independently of its earlier siblings
  given the parent: i.i.d. siblings sharing one q (duplicates allowed: a rejected token
  x has r(x) < q(x), so the residual gives it 0 and its duplicates are rejected again),
  and deterministic distinct children with one-hot q (then the rule is "accept x w.p.
  r(x), else zero r(x) and renormalise": sampling without replacement). Proof: one
  sibling step outputs x w.p. min(r, q)(x) and otherwise hands over to the remaining
  siblings with target norm(max(r - q, 0)), whose mass is exactly the rejection
  probability; by induction over the remaining siblings the output follows r.
  Zero residual mass: sum max(r - q, 0) = 0 forces r = q, where the rejection
  probability is 0; the code then keeps r (float rounding only), as verify.py does.

block (`verify_tree_block`): multi-draft block verification for K drafts of length G
  (the tree of `tree_from_drafts`, K branches from the root). NOT the SpecTr-GBV rule
  of Lin et al. (arXiv 2604.25925) or the greedy multi-path rule of Thomas & Pal (arXiv
  2602.16961): neither rule was available here. The rule below, and its proof, are our
  own derivation; it is built on single-draft block verification (Sun et al., arXiv
  2403.10444, Algorithm 2; `verify.block_weights`) and is that rule exactly at K = 1.

  State: an accepted prefix s (|s| = i tokens, the nodes of one branch) and a residual
  target r for the token after s (start: s empty, r = p[root]). Drafts k = 1..K are
  visited once each, in order. Draft k is used when its first i tokens equal s (always
  when i = 0) and i < G: block verification runs on its remaining tokens x_{i+1..G}
  against the target process "r for token i+1, then p along draft k" and returns
  t in 0..G-i accepted tokens and its correction distribution res_t
  (norm(max(w_t p_{t+1} - q_{t+1}, 0)); at t = 0 that is norm(max(r - q_{i+1}, 0)); at
  i + t = G the bonus p at the last node). The state becomes (s + x_{i+1..i+t}, res_t):
  the correction is not sampled yet. Drafts that do not match are skipped. At the end,
  next_token ~ r and tau = |s|.

  Why it is exact (our derivation): claim, for any state (s, r) and any number of
  drafts left, the procedure emits "a token from r after s, then the target" in law.
  With no drafts left it samples r. A skipped draft is independent of everything else,
  so the claim carries over. For a used draft: given that its first i tokens equal s,
  its remaining tokens follow the drafter's law after s, which is what block
  verification needs; block verification is lossless for any target process, so
  "accept t tokens, then a token from res_t, then the target" has the law of the target
  process (r, then p). The later drafts are independent of this draft and of its
  uniforms, and by induction they turn any state (s + accepted, res_t) into "res_t, then
  the target": substituting them for the single draw from res_t keeps the law.
  Requirement: the drafts are independent of each other and draft k's tokens were drawn
  from the q stored at its nodes (K i.i.d. drafts of one drafter; duplicates allowed).
  Consequences: K = 1 is block verification (identical verdicts for the same key); a
  draft appended at the end can only lengthen the accepted prefix (for the same draws of
  the earlier drafts), so E[tau] cannot fall as K grows; at the root the rule is
  recursive rejection over branches, each branch block-verified instead of
  token-verified. Block verification accepts at least one token w.p. sum_x min(r, q)(x)
  averaged over the draft, as the token rule does, so both rules reach draft k with the
  same probability and residual, and block verification's larger expected length per
  branch gives E[tau] >= the token tree rule's (in expectation over the drafts, not for
  every tree).
  What it does not achieve: it does not claim the optimum over all verifiers of K i.i.d.
  drafts (SpecTr-GBV's claim; at G = 1 it is recursive rejection, not SpecTr's optimal
  transport); drafts before the current one are never revisited (their acceptance
  decision depended on their later tokens), and past the root a draft is used only when
  it repeats the whole accepted prefix.

Randomness: every acceptance test has its own uniform (token: per (depth, sibling slot);
block: per (draft, position)), and the one residual/bonus sample uses a separate key
(a split of `key`), so no two random choices share a draw.
"""

# ruff: noqa: F722  (jaxtyping's shape strings are not Python expressions)

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax.core.drafter import take_rows
from specjax.core.sampling import sample
from specjax.core.tree import DraftTree
from specjax.decoding.verify import (  # chains reproduce verify.py bit for bit
    block_weights,
    normalize_or,
)
from specjax.errors import SpecjaxError


class TreeVerdict(NamedTuple):
    """The outcome of verifying a tree, per row.

    num_accepted: i32[B] tau in 0..G; next_token: i32[B] the correction or the bonus;
    path: i32[B,G+1] node indices, path[:, 0] = 0, path[:, j] the accepted node of depth j
    for j <= tau, entries past tau repeat path[:, tau]. The fields carry jaxtyping shape
    annotations: documentation, not checked at run time in the library
    (tests/core/test_shapes.py checks real verdicts)."""

    num_accepted: Int[Array, " B"]
    next_token: Int[Array, " B"]
    path: Int[Array, "B G+1"]


def _check(tree: DraftTree, p, max_depth: int, need_q: bool):
    B, N = tree.tokens.shape
    if p.ndim != 3 or p.shape[:2] != (B, N):
        raise SpecjaxError(f"p has shape {p.shape}; expected [B, N, V] = [{B}, {N}, V]")
    if max_depth < 1:
        raise SpecjaxError(f"max_depth={max_depth} must be >= 1")
    if need_q and tree.q is None:
        raise SpecjaxError("this rule needs the draft distributions: tree.q is None")
    if need_q and tree.q.shape != p.shape:
        raise SpecjaxError(f"tree.q has shape {tree.q.shape}; expected p's shape {p.shape}")


def children_table(tree: DraftTree, max_children: int) -> jax.Array:
    """i32[B,N,C] (C = max_children): children[b, i, s] = the s-th valid child of node i in
    index order, -1 where there is none. Children past the C-th are left out (a rule that
    reads the table never tries them). Built once with an N x N comparison (no scan).

    Raises SpecjaxError if max_children < 1."""
    if max_children < 1:
        raise SpecjaxError(f"max_children={max_children} must be >= 1")
    B, N = tree.parents.shape
    idx = jnp.arange(N, dtype=jnp.int32)
    # rank of node i among its siblings: earlier valid nodes with the same parent
    same = (tree.parents[:, :, None] == tree.parents[:, None, :]) & tree.valid[:, None, :]
    rank = jnp.sum(same & (idx[None, None, :] < idx[None, :, None]), axis=-1)
    ok = tree.valid & (tree.parents >= 0) & (rank < max_children)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, N))
    par = jnp.where(ok, tree.parents, N)  # out of range: dropped
    table = jnp.full((B, N, max_children), -1, jnp.int32)
    return table.at[rows, par, jnp.where(ok, rank, 0)].set(
        jnp.broadcast_to(idx, (B, N)), mode="drop")


def verify_tree_greedy(tree: DraftTree, p, key, *, max_depth: int) -> TreeVerdict:
    """Greedy tree verification (temperature 0).

    tree: DraftTree with N nodes (q unused); p: f32[B,N,V]; key: unused; max_depth: G
    (static), the largest node depth. From the root, move to the lowest-index valid child
    whose token equals argmax p at the current node, while there is one; next_token =
    argmax p at the last accepted node. Returns TreeVerdict (i32[B], i32[B], i32[B,G+1]).
    Raises SpecjaxError on a p whose shape does not match the tree."""
    del key
    _check(tree, p, max_depth, need_q=False)
    B, N = tree.tokens.shape
    target = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [B,N]
    parent_target = jnp.take_along_axis(target, jnp.maximum(tree.parents, 0), axis=1)
    match = tree.valid & (tree.parents >= 0) & (tree.tokens == parent_target)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, N))
    best = jnp.full((B, N), N, jnp.int32).at[rows, jnp.where(match, tree.parents, N)].min(
        jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N)), mode="drop")
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    tau = jnp.zeros((B,), jnp.int32)
    path = [cur]
    for _ in range(max_depth):
        nxt = take_rows(best, cur)
        alive = alive & (nxt < N)
        cur = jnp.where(alive, nxt, cur)
        tau = tau + alive
        path.append(cur)
    return TreeVerdict(tau, take_rows(target, cur), jnp.stack(path, axis=1))


def verify_tree_token(tree: DraftTree, p, key, *, max_depth: int,
                      max_children: int) -> TreeVerdict:
    """Token-level tree verification: recursive rejection sampling over siblings
    (SpecInfer, arXiv 2305.09781, multi-step speculative sampling; see the module
    docstring for the rule and its exactness).

    tree: DraftTree with N nodes and q f32[B,N,V] (q[b, c] the distribution child c was
    drawn from; one-hot for a deterministic child); p: f32[B,N,V]; key: PRNG key;
    max_depth: G (static); max_children: C (static), the most children of any node
    (later children are not tried). Uniforms u[b, depth, slot] from one split of `key`,
    the residual/bonus sample from the other, as `verify.verify_token` does: on a chain
    tree (`chain_tree`) with max_children = 1 the verdicts equal verify_token's for the
    same key. Returns TreeVerdict (i32[B], i32[B], i32[B,G+1]).
    Raises SpecjaxError if tree.q is None, on mismatched shapes or max_children < 1."""
    _check(tree, p, max_depth, need_q=True)
    B, N = tree.tokens.shape
    children = children_table(tree, max_children)
    k_accept, k_next = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, max_depth, max_children))
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    tau = jnp.zeros((B,), jnp.int32)
    r = p[:, 0]
    rejected = jnp.zeros((B,), bool)  # r is a residual (some child of cur was rejected)
    path = [cur]
    for d in range(max_depth):
        kids = take_rows(children, cur)  # [B,C]
        accepted = jnp.zeros((B,), bool)
        pick = cur
        for s in range(max_children):
            c = kids[:, s]
            tried = alive & ~accepted & (c >= 0)
            cc = jnp.maximum(c, 0)
            x = take_rows(tree.tokens, cc)
            qc = take_rows(tree.q, cc)  # [B,V]
            qx = jnp.take_along_axis(qc, x[:, None], axis=1)[:, 0]
            rx = jnp.take_along_axis(r, x[:, None], axis=1)[:, 0]
            ok = tried & (u[:, d, s] * qx < rx)  # u < r/q without dividing; never r(x) = 0
            no = tried & ~ok
            accepted = accepted | ok
            pick = jnp.where(ok, cc, pick)
            r = jnp.where(no[:, None], normalize_or(jnp.maximum(r - qc, 0.0), r), r)
            rejected = rejected | no
        alive = alive & accepted
        cur = jnp.where(alive, pick, cur)
        tau = tau + alive
        r = jnp.where(alive[:, None], take_rows(p, cur), r)
        rejected = rejected & ~alive
        path.append(cur)
    dist = jnp.where(rejected[:, None], r, normalize_or(r, r))  # as verify_token's bonus
    return TreeVerdict(tau, sample(k_next, dist), jnp.stack(path, axis=1))


def verify_tree_block(tree: DraftTree, p, key, *, max_depth: int,
                      num_drafts: int | None = None) -> TreeVerdict:
    """Multi-draft block verification of K drafts of length G (our rule: see the module
    docstring for the rule, its derivation and what it does not claim).

    tree: the DraftTree of `tree_from_drafts` (N = 1 + K*G; draft k's token j is node
    1 + k*G + j) with q f32[B,N,V]; p: f32[B,N,V]; key: PRNG key; max_depth: G (static);
    num_drafts: K (static; default (N - 1) // G). A draft with an invalid node is
    skipped. Uniforms u[b, k, j] (draft k, j-th token of the part being verified) from one
    split of `key`, the final residual/bonus sample from the other, as
    `verify.verify_block`: at K = 1 the verdicts equal verify_block's for the same key.
    Built on `verify.block_weights` (Sun et al., arXiv 2403.10444, Algorithm 2).
    Returns TreeVerdict (i32[B], i32[B], i32[B,G+1]).
    Raises SpecjaxError if tree.q is None, on mismatched shapes or if N != 1 + K*G."""
    _check(tree, p, max_depth, need_q=True)
    B, N = tree.tokens.shape
    G = max_depth
    K = (N - 1) // G if num_drafts is None else num_drafts
    if K < 1 or N != 1 + K * G:
        raise SpecjaxError(f"verify_tree_block needs the tree of tree_from_drafts: N={N} "
                           f"nodes is not 1 + K*G for K={K} drafts of length G={G}")
    k_accept, k_next = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, K, G))
    depth = jnp.arange(G + 1, dtype=jnp.int32)  # 0..G
    j = jnp.arange(G, dtype=jnp.int32)
    i = jnp.zeros((B,), jnp.int32)  # accepted prefix length
    owner = jnp.zeros((B,), jnp.int32)  # the draft whose nodes hold the accepted prefix
    acc_tok = tree.tokens[:, :G + 1]  # its tokens by depth (only depths 1..i are read)
    r = p[:, 0]
    for k in range(K):
        nodes = jnp.concatenate([jnp.zeros((1,), jnp.int32), 1 + k * G + j])  # by depth
        tok_k = tree.tokens[:, nodes]  # [B,G+1]
        p_k, q_k = p[:, nodes], tree.q[:, nodes]  # [B,G+1,V]
        usable = jnp.all(tree.valid[:, nodes], axis=1) & (i < G)
        prefix = (tok_k == acc_tok) | (depth[None, :] > i[:, None]) | (depth[None, :] == 0)
        use = usable & jnp.all(prefix, axis=1)
        # the part after the prefix, shifted to start at 0: token j is x_{i+1+j} (j < G-i)
        n_left = G - i  # >= 1 where used
        src = jnp.minimum(i[:, None] + 1 + j[None, :], G)  # [B,G] depth of token j
        draft = jnp.take_along_axis(tok_k, src, axis=1)
        q_s = jnp.take_along_axis(q_k, src[..., None], axis=1)  # [B,G,V]
        par = jnp.minimum(i[:, None] + depth[None, :], G)  # [B,G+1] parent depth of token j
        p_s = jnp.take_along_axis(p_k, par[..., None], axis=1)
        p_s = p_s.at[:, 0].set(r)  # target of the first unverified token: the residual
        w, h = block_weights(draft, q_s, p_s)  # entries j >= n_left are padding
        last = j[None, :] == (n_left - 1)[:, None]
        h = jnp.where(last, w, h)  # the last real token: h = w (bonus case)
        passed = (u[:, k] < h) & (j[None, :] < n_left[:, None])
        t = jnp.max(jnp.where(passed, j[None, :] + 1, 0), axis=1).astype(jnp.int32)
        w0 = jnp.concatenate([jnp.ones_like(w[:, :1]), w], axis=1)  # w_0..w_G
        w_t, p_t = take_rows(w0, t), take_rows(p_s, t)
        q_t = jnp.where((t == n_left)[:, None], 0.0, take_rows(q_s, jnp.minimum(t, G - 1)))
        res = normalize_or(jnp.maximum(w_t[:, None] * p_t - q_t, 0.0), p_t)
        grow = use & (t > 0)
        r = jnp.where(use[:, None], res, r)
        i = jnp.where(use, i + t, i)
        owner = jnp.where(grow, k, owner)
        acc_tok = jnp.where(grow[:, None], tok_k, acc_tok)
    path = jnp.where(depth[None, :] <= i[:, None], 1 + owner[:, None] * G + depth[None, :] - 1,
                     1 + owner[:, None] * G + i[:, None] - 1)
    path = jnp.where(jnp.minimum(depth[None, :], i[:, None]) == 0, 0, path)
    return TreeVerdict(i, sample(k_next, r), path.astype(jnp.int32))
