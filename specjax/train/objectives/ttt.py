"""Training-time test (EAGLE-3; docs/design.md section 6) for the autoregressive drafters that
read the target: the kinds registered with objective "ttt" (eagle3, hybrid, kv, ...).

Step k = 0..G-1 at anchor t predicts the target's distribution at position t+k+1 (the
token t+k+2). Loss: sum_k decay^k * mean over valid t of CE(label, draft logits), with
soft labels softmax(target logits) or hard labels (the data token); valid means
t+k+1 <= T-1, and with a loss mask also mask[t+k+2] = 1 (the token step k predicts is
an assistant token). With a mask, sampled anchors prefer t with mask[t+2] = 1, and a
chain counts in the statistics only when all its predicted tokens have mask 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def draft_outputs(net, tgt, rows, frozen, steps: int, anchors=None, kernel=None):
    """(outputs [steps,B,P,D], gates [steps,B,P,D] | None) of the TTT unroll at `anchors`
    i32[B,P] (None: every position, P = T): the network's `ttt`, one signature for every
    kind that trains with TTT (`registry.DrafterKind`). kernel: the drafter's attention
    kernel (`specjax.decoding.kernel_policy`; None: the jnp path)."""
    return net.ttt(tgt.hidden, tgt.kv, rows, frozen.embed, frozen.inv_freq, steps, anchors,
                   kernel=kernel)


def sample_positions(key, batch: int, seq_len: int, count: int, prefer=None):
    """i32[B,P], P = min(count, T-1): distinct anchors in 0 .. T-2 per row, sorted.
    prefer: optional f32[B, T-1], 1 where an anchor is wanted first (its first target is
    an assistant token): those are drawn before the others."""
    n = seq_len - 1
    noise = jax.random.uniform(key, (batch, n))
    if prefer is not None:
        noise = noise + (1.0 - prefer)  # preferred anchors sort first
    return jnp.sort(jnp.argsort(noise, axis=1)[:, :min(count, n)], axis=1).astype(jnp.int32)


def ttt_loss(net, tgt, rows, frozen, key=None, *, steps: int, soft: bool = True,
             decay: float = 0.8, num_positions: int | None = None, kernel=None, mask=None):
    """Weighted TTT loss and acceptance statistics.

    Args:
      net: the network of a ttt kind (Eagle3, Hybrid, KVOnly, ...); tgt: the target's cache-free ForwardOutput on
        rows[:, :T] (hidden at net.cfg.capture, kv at net.cfg.kv_layers); rows i32[B,T+1];
        frozen: objectives.Frozen; steps: G.
      key, num_positions: unroll the chains of num_positions random anchors per row
        (drawn with `key`) instead of all T positions: the LM head, which dominates the
        cost, then runs on B*P instead of B*T rows per step.
      kernel: the drafter's attention kernel (`specjax.decoding.kernel_policy`; None: jnp).
      mask: optional f32[B,T+1] loss mask (1 where the row's token is a target).
    Returns: (loss f32[], stats) with stats as in objectives/__init__.py; a chain is an
      anchor t with all `steps` predictions inside the row (t + steps <= T-1) and, with a
      mask, all of them on tokens with mask 1.
    """
    B, T = rows.shape[0], rows.shape[1] - 1
    anchors = None
    if num_positions is not None and num_positions < T:
        prefer = None if mask is None else mask[:, 2:]
        anchors = sample_positions(key, B, T, num_positions, prefer)
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if anchors is None else anchors
    outs, gates = draft_outputs(net, tgt, rows, frozen, steps, anchors, kernel)
    target_top = jnp.argmax(tgt.logits, axis=-1)  # [B,T]
    total, matches = 0.0, []
    for k in range(steps):
        logits = net.logits(outs[k], frozen.head)  # [B,P,V]
        idx = jnp.minimum(t + k + 1, T - 1)
        valid = (t + k + 1 <= T - 1).astype(jnp.float32)
        if mask is not None:
            valid = valid * jnp.take_along_axis(mask, jnp.minimum(t + k + 2, T), axis=1)
        if soft:
            tl = jnp.take_along_axis(tgt.logits, idx[:, :, None], axis=1)
            ce = optax.softmax_cross_entropy(logits, jax.nn.softmax(tl.astype(jnp.float32), -1))
        else:
            hard = jnp.take_along_axis(rows, jnp.minimum(t + k + 2, T), axis=1)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, hard)
        total = total + decay ** k * jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)
        matches.append(jnp.argmax(logits, -1) == jnp.take_along_axis(target_top, idx, axis=1))
    chain = jnp.cumprod(jnp.stack(matches).astype(jnp.float32), axis=0)  # [steps,B,P]
    full = (t + steps <= T - 1).astype(jnp.float32)
    if mask is not None:  # the whole chain predicts assistant tokens
        for k in range(steps):
            full = full * jnp.take_along_axis(mask, jnp.minimum(t + k + 2, T), axis=1)
    full = full[None]
    correct = jnp.stack(matches).astype(jnp.float32)  # each step on its own (SpecForge acc_k)
    stats = {"accepted": jnp.sum(chain * full, axis=(1, 2)), "chains": jnp.sum(full),
             "correct": jnp.sum(correct * full, axis=(1, 2))}
    if gates is not None:
        stats["gate"] = jnp.sum(jnp.mean(gates, axis=-1))
        stats["gate_count"] = jnp.asarray(gates.shape[0] * gates.shape[1] * gates.shape[2],
                                          jnp.float32)
    return total, stats
