"""Block-wise training (DFlash; docs/design.md section 6) for the parallel block drafter.

Per row, A anchors are drawn without replacement from positions 1 .. T-G (resampled
every step from the step's key); block j = [token at anchor_j, G mask tokens] sees the
context strictly before anchor_j and its own block. Block position k >= 1 predicts the
token at anchor_j + k: soft label softmax(target logits at anchor_j + k - 1), or hard
label the data token. Loss weights w_k = exp(-(k-1) / gamma_w); the loss is the
w-weighted mean over all block positions (with a loss mask, over the block positions
whose token has mask 1; anchors a with mask[a+1] = 1 are drawn first, and a block counts
in the statistics only when all its G predicted tokens have mask 1). With DFlash2's path
selector (`specjax.drafters.selector`), its cross-entropy over each position's candidates
is added to the block's (same weights), and the statistics count the selector's picks;
with `selector_soft` its target is the target's distribution over the candidates
(renormalised) instead of the label (`selector.train_terms`).

DSpark (`specjax.drafters.markov`; SpecForge's `OnlineDSparkModel`): with
`sample_from_anchor` the block is [token at anchor_j, G-1 mask tokens] and slot k (0..G-1)
predicts the token at anchor_j + k + 1: the same targets, one slot fewer. A Markov head is
teacher-forced: its predecessor at draft position k is the data token at anchor_j + k (the
anchor token first; the token the soft label at k is conditioned on, the label at k-1 under
hard labels), and its corrected logits replace the block's in the cross-entropy; the
statistics count its greedy chain (predecessors the target's argmax). A confidence head
adds confidence_alpha x BCE(c_k, 1 - TV(p_target, q_k)) per position (q_k the softmax of
the draft logits there, p_target the target's softmax, TV = half the L1 distance; the
target is not differentiated), under the same weights and normaliser. With the path
selector, q_k is the selector's distribution over its K candidates, each predecessor the
target's greedy token (`selector.candidate_probs`; no producer combines the two, so this is
specjax's: the confidence of the chain the selector drafts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specjax.drafters import markov, selector


def sample_anchors(key, batch: int, seq_len: int, gamma: int, num_anchors: int,
                   prefer=None):
    """i32[B,A], A = min(num_anchors, T-G): distinct anchors in 1 .. T-G per row, sorted.
    prefer: optional f32[B, T-G], 1 where anchor a = index + 1 is wanted first."""
    n = seq_len - gamma
    A = min(num_anchors, n)
    noise = jax.random.uniform(key, (batch, n))
    if prefer is not None:
        noise = noise + (1.0 - prefer)  # preferred anchors sort first
    return jnp.sort(jnp.argsort(noise, axis=1)[:, :A] + 1, axis=1).astype(jnp.int32)


def block_loss(net, tgt, rows, frozen, key, *, num_anchors: int, soft: bool = True,
               gamma_w: float = 7.0, gamma: int | None = None, kernel=None, mask=None,
               confidence_alpha: float = 1.0, selector_soft: bool = False):
    """Weighted block loss and acceptance statistics.

    Args:
      net: BlockNet; tgt: the target's cache-free ForwardOutput on rows[:, :T] (hidden at
        net.cfg.capture, kv at net.cfg.kv_layers); rows: i32[B,T+1]; frozen:
        objectives.Frozen; key: anchor sampling; gamma: G (default net.cfg.gamma);
        kernel: the drafter's attention kernel (`specjax.decoding.kernel_policy`; None: jnp);
        mask: optional f32[B,T+1] loss mask (1 where the row's token is a target).
        confidence_alpha: weight of a confidence head's BCE (SpecForge's
          `confidence_head_alpha`, 1.0).
        selector_soft: the path selector's target is the target's distribution over its
          candidates, not the label (`drafter.selector_soft_labels`).
    Returns: (loss f32[], stats): one chain per anchor; accepted[k] counts anchors whose
      draft positions 0..k all equal the target's argmax.
    """
    G = gamma or net.cfg.gamma
    B, T = rows.shape[0], rows.shape[1] - 1
    prefer = None if mask is None else mask[:, 2:T - G + 2]  # mask[a+1], a = 1 .. T-G
    anchors = sample_anchors(key, B, T, G, num_anchors, prefer)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    contexts = net.contexts(tgt.hidden, tgt.kv, pos, frozen.inv_freq)
    out = net.blocks(contexts, anchors, rows[:, :T], frozen.embed, frozen.inv_freq, G,
                     kernel)[:, :, net.layout(G)[1]:]  # the G draft slots [B,A,G,D]
    logits = net.logits(out, frozen.head)  # [B,A,G,V]
    at = anchors[:, :, None] + jnp.arange(G, dtype=jnp.int32)  # target positions [B,A,G]
    tl = jnp.take_along_axis(tgt.logits, at.reshape(B, -1)[:, :, None], axis=1)
    tl = tl.reshape(*at.shape, -1)
    p_t = jax.nn.softmax(tl.astype(jnp.float32), -1)  # the target's distribution
    head, conf = net.markov(), net.cfg.confidence_head
    if head is not None or conf:  # DSpark: the token before each draft position
        h = net.final_hidden(out)
        prev = jnp.take_along_axis(rows, at.reshape(B, -1), axis=1).reshape(at.shape)
    if head is not None:
        base, logits = logits, markov.block_logits(head, logits, h, prev)
    if soft:
        ce = optax.softmax_cross_entropy(logits, p_t)
    else:
        hard = jnp.take_along_axis(rows, (at + 1).reshape(B, -1), axis=1).reshape(at.shape)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, hard)
    w = jnp.exp(-jnp.arange(G, dtype=jnp.float32) / gamma_w)
    best = jnp.argmax(tl, axis=-1).astype(jnp.int32)  # the target's greedy tokens [B,A,G]
    match = jnp.argmax(logits, axis=-1) == best  # [B,A,G]
    if conf:  # BCE against the acceptance probability 1 - TV(p_target, q_draft)
        if net.selector() is not None:  # q_draft: the selector's, over its K candidates,
            # each predecessor the target's greedy token (the chain that is accepted so far)
            q_c, cand = selector.candidate_probs(
                *net.selector(), net.cfg.selector_top_k, net.final_hidden(out), logits,
                jnp.take_along_axis(rows, anchors, axis=1), best)
            p_c = jnp.take_along_axis(p_t, cand, axis=-1)  # q is 0 off the candidates
            tv = 0.5 * (jnp.sum(jnp.abs(p_c - q_c), -1) +
                        jnp.clip(1.0 - jnp.sum(p_c, -1), 0.0, 1.0))
        else:
            tv = 0.5 * jnp.sum(jnp.abs(jax.nn.softmax(logits.astype(jnp.float32), -1) -
                                       p_t), -1)
        accept = jax.lax.stop_gradient(jnp.clip(1.0 - tv, 0.0, 1.0))
        ce = ce + confidence_alpha * optax.sigmoid_binary_cross_entropy(
            net.confidence_logits(h, prev), accept)
    if head is not None:  # the greedy chain: each predecessor the target's argmax
        check = markov.block_logits(head, jax.lax.stop_gradient(base),
                                    jax.lax.stop_gradient(h), markov.predecessors(prev[..., 0],
                                                                                  best))
        match = jnp.argmax(check, axis=-1) == best
    if net.selector() is not None:  # DFlash2: its CE joins the block's; its picks decide
        labels = best if soft else jnp.take_along_axis(
            rows, (at + 1).reshape(B, -1), axis=1).reshape(at.shape)
        first = jnp.take_along_axis(rows, anchors, axis=1)
        sel_ce, match = selector.train_terms(*net.selector(), net.cfg.selector_top_k,
                                             net.final_hidden(out), logits,
                                             first, labels, best,
                                             p_t if selector_soft else None)
        ce = ce + sel_ce
    chain = jnp.cumprod(match.astype(jnp.float32), axis=-1)
    if mask is None:
        loss = jnp.sum(ce * w) / (jnp.sum(w) * B * anchors.shape[1])
        stats = {"accepted": jnp.sum(chain, axis=(0, 1)),
                 "chains": jnp.asarray(B * anchors.shape[1], jnp.float32),
                 "correct": jnp.sum(match.astype(jnp.float32), axis=(0, 1))}
        return loss, stats
    m = jnp.take_along_axis(mask, (at + 1).reshape(B, -1), axis=1).reshape(at.shape)
    loss = jnp.sum(ce * w * m) / jnp.maximum(jnp.sum(w * m), 1e-6)
    full = jnp.prod(m, axis=-1, keepdims=True)  # [B,A,1]: the whole block is assistant text
    stats = {"accepted": jnp.sum(chain * full, axis=(0, 1)), "chains": jnp.sum(full),
             "correct": jnp.sum(match.astype(jnp.float32) * full, axis=(0, 1))}
    return loss, stats
