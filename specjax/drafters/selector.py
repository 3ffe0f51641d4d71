"""DFlash2's path selector over a block's candidates (z-lab/dflash `dflash/model.py`,
`CandidateSelector`): the block forward drafts every position at once, so position k's
distribution cannot see the token drafted at k-1; the selector adds that dependency back
at the cost of a rank-R product per position, no extra transformer forward.

Per block position k (1..G), with h_k the block's final-normed output [D] and prev the
token chosen at k-1 (the block's first, committed token for k = 1):

    candidates c_1..c_K = top-K of the block's logits at k          (`selector_top_k`)
    score(c) = logit_k(c) + < pred[prev] * (h_k @ proj), succ[c] >  (rank R, `selector_rank`)

pred, succ [V,R] (the predecessor and successor codebooks) and proj [D,R] are the
selector's own weights. Drafting walks the block left to right: at temperature 0 the
argmax candidate, above it a sample of the sampling filter over the K scores (every other
token -inf), whose distribution is the q that verification needs: q_k depends on x_{k-1},
the draft is a proper sequential proposal, and the verifiers stay exact.

Training (`train_terms`): teacher forcing (prev = the label at k-1), the label inserted
among the candidates in place of the K-th when the top-K misses it (so that every
position has a target), cross-entropy over the K scores. DFlash2's trainer is not public;
this follows the paper's description (the gold token inserted, rank-limited scoring).
That target is one-hot, so the selector's softmax grows sharper than the target's and a
chain sampled from it at T > 0 is accepted less often. With `target_probs` (specjax's,
`drafter.selector_soft_labels`) the target is instead the target's distribution p over
the same K candidates, renormalised: among distributions q supported on the candidates,
that one maximises the acceptance probability sum_c min(p_c, q_c) (= sum_c p_c), and its
argmax is still the target's greedy token when that is a candidate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specjax.constraints.loop import draft_logits, draft_state, row_state
from specjax.core.sampling import SamplingParams, sample_logits


def scores(pred, succ, proj, h, prev, cand, unary):
    """f32[...,K]: unary [...,K] + <pred[prev] * (h @ proj), succ[cand]>.

    pred, succ: [V,R]; proj: [D,R]; h: [...,D]; prev: i32[...]; cand: i32[...,K]."""
    ph = jnp.take(pred, prev, axis=0).astype(jnp.float32) * \
        (h.astype(jnp.float32) @ proj.astype(jnp.float32))  # [...,R]
    sc = jnp.take(succ, cand, axis=0).astype(jnp.float32)  # [...,K,R]
    return unary.astype(jnp.float32) + jnp.einsum("...r,...kr->...k", ph, sc)


def top_candidates(logits, top_k: int):
    """(unary f32[...,K], candidates i32[...,K]): the top-K of logits f32[...,V], behind an
    optimization barrier: XLA on the CPU otherwise fuses the top-K into each position's
    consumer and recomputes it per position (a G = 7 chain drafted in 11.7 ms instead of
    0.25 ms on the 2-core CPU, V 8192)."""
    unary, cand = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    return jax.lax.optimization_barrier((unary, cand.astype(jnp.int32)))


def draft_chain(pred, succ, proj, top_k: int, h, logits, first, key,
                sampling: SamplingParams, constraint=None):
    """A chain drafted left to right through the selector.

    Args:
      pred, succ [V,R], proj [D,R]: the selector's weights.
      h: [B,G,D] the block's final-normed outputs at positions 1..G;
      logits: f32[B,G,V] the block's draft logits there; first: i32[B] the block's
        committed first token; key: PRNG key (unused at temperature 0); constraint:
        the loop's `specjax.constraints.loop.Constraint` or None (each position's scores
        masked in the state the drafts before it reach).
    Returns: draft i32[B,G] and q f32[B,G,V] (the filtered distribution each token was
      drawn from: zero outside its position's K candidates)."""
    B, G, V = logits.shape
    unary, cand = top_candidates(logits, top_k)
    keys = jax.random.split(key, G)
    prev, draft, qs, cs = first, [], [], row_state(constraint)
    for k in range(G):  # static G: one rank-R product per position
        s = scores(pred, succ, proj, h[:, k], prev, cand[:, k], unary[:, k])  # [B,K]
        full = jnp.full((B, V), -jnp.inf, jnp.float32)
        full = full.at[jnp.arange(B)[:, None], cand[:, k]].set(s)
        x, q = sample_logits(keys[k], draft_logits(constraint, full, cs), sampling)
        draft.append(x)
        qs.append(q)
        prev, cs = x, draft_state(constraint, cs, x)
    return jnp.stack(draft, 1), jnp.stack(qs, 1)


def children(pred, succ, proj, top_k: int, h, logits):
    """The children function of a draft tree over the selector's block
    (`specjax.core.tree.best_first_path_tree`): children(prev i32[B], d i32[B]) -> the K
    candidates of 0-based position d given the token prev before them, sorted best first:
    (log_softmax of their scores f32[B,K], tokens i32[B,K]). h [B,G,D] final-normed block
    outputs, logits f32[B,G,V] the block's logits at positions 1..G."""
    unary, cand = top_candidates(logits, top_k)
    rows = jnp.arange(h.shape[0])

    def fn(prev, d):
        s = scores(pred, succ, proj, h[rows, d], prev, cand[rows, d].astype(jnp.int32),
                   unary[rows, d])
        lp, order = jax.lax.top_k(jax.nn.log_softmax(s, axis=-1), top_k)
        return lp, jnp.take_along_axis(cand[rows, d], order, axis=-1).astype(jnp.int32)

    return fn


def candidate_probs(pred, succ, proj, top_k: int, h, logits, first, prev_tokens):
    """The selector's distribution at temperature 1 over each position's plain top-K
    candidates, teacher-forced: (q f32[...,G,K], candidates i32[...,G,K]).

    h [...,G,D], logits f32[...,G,V] as in `train_terms`; first i32[...] the block's
    first token; prev_tokens i32[...,G]: position k's predecessor is prev_tokens[k-1]
    (first for k = 1). What a drafted chain samples from, given those predecessors."""
    unary, cand = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    cand = cand.astype(jnp.int32)
    prev = jnp.concatenate([first[..., None], prev_tokens[..., :-1]], axis=-1)
    return jax.nn.softmax(scores(pred, succ, proj, h, prev, cand, unary), axis=-1), cand


def train_terms(pred, succ, proj, top_k: int, h, logits, first, labels, check,
                target_probs=None):
    """The selector's training loss and its teacher-forced greedy matches.

    Args:
      h: [...,G,D] final-normed block outputs at positions 1..G; logits: f32[...,G,V];
      first: i32[...] the block's first token; labels: i32[...,G] the tokens to select
        (teacher forcing: the predecessor of position k is labels[k-1]);
      check: i32[...,G] the tokens a greedy chain must draw to be accepted (the target's
        argmax);
      target_probs: optional f32[...,G,V], the target's distribution at each position:
        the cross-entropy's target becomes it restricted to the K candidates (label
        inserted as above) and renormalised, instead of the one-hot label.
    Returns: ce f32[...,G] (cross-entropy over the K scores, the label inserted in place of
      the K-th candidate where the top-K misses it) and match bool[...,G] (the greedy pick
      among the plain top-K, predecessor from `check`, equals `check`)."""
    unary, cand = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    cand = cand.astype(jnp.int32)
    prev = jnp.concatenate([first[..., None], labels[..., :-1]], axis=-1)
    present = jnp.any(cand == labels[..., None], axis=-1, keepdims=True)
    last = jnp.arange(top_k) == top_k - 1
    cand_t = jnp.where(~present & last, labels[..., None], cand)
    unary_t = jnp.take_along_axis(logits.astype(jnp.float32), cand_t, axis=-1)
    s = scores(pred, succ, proj, h, prev, cand_t, unary_t)
    if target_probs is None:
        target = jnp.argmax(cand_t == labels[..., None], axis=-1)
        ce = optax.softmax_cross_entropy_with_integer_labels(s, target)
    else:
        p = jnp.take_along_axis(target_probs.astype(jnp.float32), cand_t, axis=-1)
        p = jax.lax.stop_gradient(p / jnp.maximum(jnp.sum(p, -1, keepdims=True), 1e-30))
        ce = optax.softmax_cross_entropy(s, p)
    prev_c = jnp.concatenate([first[..., None], check[..., :-1]], axis=-1)
    s_c = scores(pred, succ, proj, h, prev_c, cand, unary)
    pick = jnp.take_along_axis(cand, jnp.argmax(s_c, axis=-1)[..., None], axis=-1)[..., 0]
    return ce, pick == check
