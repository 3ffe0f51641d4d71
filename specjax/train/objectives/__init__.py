"""Training objectives of drafters against a frozen target (docs/design.md section 6).

Contract between the trainer and the objectives (each a pure function, jit-able):

    tgt = target(tokens, positions, None, capture=dcfg.capture, capture_kv=dcfg.kv_layers)
    # ForwardOutput: logits f32[B,T,V], hidden [C,B,T,D] | None, kv ([Ls,B,K,T,H],)*2 | None

    loss, stats = ttt_loss(net, tgt, rows, frozen, steps=G, soft=True)        # ttt.py
    loss, stats = block_loss(net, tgt, rows, frozen, key, num_anchors=A, soft=True)  # block.py

  net:    the drafter network (nnx.Module from `specjax.drafters.build_network`), merged
          from its trainable params inside the jitted step;
  rows:   i32[B,T+1] training rows (the target runs on rows[:, :T]);
  frozen: `Frozen` (embed [V,D], head [V,D], inv_freq f32[H/2]) from the target;
  loss:   f32[] weighted mean cross-entropy (nats);
  stats:  dict of f32 arrays, summed over batches by the evaluator:
          "accepted": f32[G]  chains whose first k+1 drafts all match the target argmax
          "chains":   f32[]   chains counted (alpha_k = accepted[k] / accepted[k-1],
                              alpha_0 = accepted[0] / chains, tau = 1 + sum(accepted)/chains)
          "correct":  f32[G]  chains whose draft k matches on its own, earlier drafts
                              right or wrong (acc_k = correct[k] / chains: the per-step
                              accuracy SpecForge logs; it decays where alpha_k need not)
          "gate":     f32[]   hybrid only: sum of the gate over counted positions, with
          "gate_count": f32[] the number of gate values summed.
"""

from specjax.train.objectives.base import Frozen, summarize

__all__ = ["Frozen", "summarize"]
