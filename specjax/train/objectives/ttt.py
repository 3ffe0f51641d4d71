"""Training-time test (EAGLE-3; DESIGN.md section 6) for the autoregressive drafters that
read the target: eagle3, hybrid and kv.

Step k = 0..G-1 at anchor t predicts the target's distribution at position t+k+1 (the
token t+k+2). Loss: sum_k decay^k * mean over valid t of CE(label, draft logits), with
soft labels softmax(target logits) or hard labels (the data token); valid means
t+k+1 <= T-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specjax.drafters import common


def draft_outputs(net, tgt, rows, frozen, steps: int):
    """(outputs [steps,B,T,D], gates [steps,B,T,D] | None) of the TTT unroll."""
    cfg = net.cfg
    B, T = rows.shape[0], rows.shape[1] - 1
    memory = None
    if cfg.uses_kv:
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cos, sin = common.rope(frozen.inv_freq, pos, net.dtype)
        memory = common.memory_from_target(net, cfg, tgt.kv[0], tgt.kv[1], cos, sin)
    if cfg.kind == "kv":
        return net.ttt(memory, rows, frozen.embed, frozen.inv_freq, steps), None
    if memory is not None:
        memory = (memory[0][0], memory[1][0])
    return net.ttt(tgt.hidden, rows, frozen.embed, frozen.inv_freq, steps, memory)


def ttt_loss(net, tgt, rows, frozen, *, steps: int, soft: bool = True, decay: float = 0.8):
    """Weighted TTT loss and acceptance statistics.

    Args:
      net: Eagle3, Hybrid or KVOnly network; tgt: the target's cache-free ForwardOutput on
        rows[:, :T] (hidden at net.cfg.capture, kv at net.cfg.kv_layers); rows i32[B,T+1];
        frozen: objectives.Frozen; steps: G.
    Returns: (loss f32[], stats) with stats as in objectives/__init__.py; a chain is an
      anchor t with all `steps` predictions inside the row (t + steps <= T-1).
    """
    B, T = rows.shape[0], rows.shape[1] - 1
    outs, gates = draft_outputs(net, tgt, rows, frozen, steps)
    t = jnp.arange(T)
    target_top = jnp.argmax(tgt.logits, axis=-1)  # [B,T]
    total, matches = 0.0, []
    for k in range(steps):
        logits = net.logits(outs[k], frozen.head)  # [B,T,V]
        idx = jnp.minimum(t + k + 1, T - 1)
        valid = (t + k + 1 <= T - 1).astype(jnp.float32)[None, :]
        if soft:
            labels = jax.nn.softmax(tgt.logits[:, idx].astype(jnp.float32), axis=-1)
            ce = optax.softmax_cross_entropy(logits, labels)
        else:
            hard = rows[:, jnp.minimum(t + k + 2, T)]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, hard)
        total = total + decay ** k * jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid) * B, 1)
        matches.append(jnp.argmax(logits, axis=-1) == target_top[:, idx])
    chain = jnp.cumprod(jnp.stack(matches).astype(jnp.float32), axis=0)  # [steps,B,T]
    full = (t + steps <= T - 1).astype(jnp.float32)[None, None, :]
    stats = {"accepted": jnp.sum(chain * full, axis=(1, 2)),
             "chains": jnp.sum(jnp.broadcast_to(full[0], (B, T)))}
    if gates is not None:
        stats["gate"] = jnp.sum(jnp.mean(gates, axis=-1))
        stats["gate_count"] = jnp.asarray(gates.shape[0] * B * T, jnp.float32)
    return total, stats

