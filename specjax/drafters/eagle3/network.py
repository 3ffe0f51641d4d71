"""The EAGLE-3 network (`Eagle3`, an nnx.Module): fc over the captured target features,
one decoder layer over [embed_norm(emb); hidden_norm(h)], the final norm and the
target's LM head, and the training-time-test unroll (`ttt`). medc.Medc and
hybrid.Hybrid subclass it through its hooks (`project`, `readout`, `mix_memory`)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from specjax.core.drafter import AttentionKernel
from specjax.drafters.attend import Limit, attend
from specjax.drafters.config import DrafterConfig
from specjax.drafters.memory import ttt_memory
from specjax.drafters.weights import layer_params, layer_weights, normal, ones
from specjax.models import layers
from specjax.models.matmul import linear


class Eagle3(nnx.Module):
    """The EAGLE-3 network: fc [D, C*D], embed_norm/hidden_norm [D], one layer reading
    2D features (weights.layer_weights), final_norm [D]."""

    # True for networks whose logits read a token after the layer (`readout`, medc.py);
    # EAGLE-3 reads the token in the layer's input, so its readout is the identity.
    token_readout = False
    input_width = 2  # the layer's q/k/v read input_width * D features ([emb; h])
    # False for networks whose hidden-state chain reads no token (medc.py): then every
    # node of one draft-tree depth has the same layer output, and
    # `Eagle3Drafter.propose_tree_topk` runs one chain instead of one forward per node.
    chain_reads_token = True

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, C = cfg.hidden_size, len(cfg.capture)
        self.cfg, self.dtype = cfg, dtype
        self.fc = normal(rngs, (D, C * D), dtype)
        self.embed_norm = ones((D,), dtype)
        self.hidden_norm = ones((D,), dtype)
        for name, p in layer_weights(cfg, rngs, dtype, 1, self.input_width * D,
                                     False).items():
            setattr(self, name, p)
        self.final_norm = ones((D,), dtype)

    def features(self, hidden):
        """fc over the captured target features: hidden [C,B,T,D] -> [B,T,D]."""
        C, B, T, D = hidden.shape
        flat = hidden.transpose(1, 2, 0, 3).reshape(B, T, C * D)
        return linear(flat, self.fc[...])

    def project(self, emb, h, cos, sin):
        """q [B,T,N,H], k, v [B,T,K,H] of one step's input (emb, h [B,T,D])."""
        eps = self.cfg.rms_norm_eps
        c = self.cfg
        x = jnp.concatenate([layers.rms_norm(emb, self.embed_norm[...], eps),
                             layers.rms_norm(h, self.hidden_norm[...], eps)], axis=-1)
        return layers.qkv(layer_params(self, 0), x, cos, sin, eps, c.num_heads,
                          c.num_kv_heads, c.head_dim)

    def finish(self, h, attn):
        """The layer's output (pre-norm, fed back as the next step's h): h + o(attn),
        then the MLP. attn [B,T,N*H] -> [B,T,D]."""
        return layers.layer_out(layer_params(self, 0), h, attn, self.cfg.rms_norm_eps)

    def logits(self, out, head):
        return layers.logits(out, self.final_norm[...], head, self.cfg.rms_norm_eps)

    def readout(self, out, emb):
        """The features the logits are read from: out [...,D] (the layer's output, fed
        back as the next step's h) with the embedding emb [...,D] of the token that
        follows its position. EAGLE-3: out itself (its token entered the layer's input);
        medc.Medc injects the token here."""
        del emb
        return out

    def ttt(self, hidden, kv, tokens, embed, inv_freq, steps: int, anchors=None,
            kernel: AttentionKernel | None = None):
        """Training-time-test unroll (EAGLE-3; docs/design.md section 6).

        Step 0 runs on fc(target features) with a causal mask over all T positions; step
        k at anchor t reads the embedding of token t+k+1 and step k-1's output at t, uses
        RoPE position t+k, and attends to step-0 keys at positions <= t plus position t
        of steps 1..k.

        Args:
          hidden: [C,B,T,D] target features at `cfg.capture` depths for positions 0..T-1.
          kv: hybrid only (else unused): (k, v) [Ls,B,K,T,H] target K/V at
            `cfg.kv_layers`, merged here into the memory of positions 0..T-1.
          tokens: i32[B,T+1] rows (indices past T are clipped; those outputs are unused).
          embed: [V,D]; inv_freq: f32[H/2].
          anchors: i32[B,P] positions whose chains are unrolled (None: all T). Steps
            k >= 1 cost P instead of T positions.
          kernel: the attention kernel of `attend` (`specjax.decoding.kernel_policy`; None: jnp).
        Returns: (outputs [steps,B,P,D] pre-norm, through `readout`, gates [steps,B,P,D]
          or None); step k at anchor t predicts token t+k+2 (the target's distribution
          at t+k+1).
        """
        memory = None
        if self.cfg.uses_kv:
            mk, mv = ttt_memory(self, self.cfg, kv, inv_freq)
            memory = (mk[0], mv[0])
        B, T = tokens.shape[0], tokens.shape[1] - 1
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if anchors is None:
            anchors = pos
        visible = Limit(anchors)  # step-0 keys at positions <= the anchor
        g = self.features(hidden)
        # Step 0 over every position: its keys are the context of every later step.
        emb = jnp.take(embed, tokens[:, 1:T + 1], axis=0)
        cos, sin = layers.rope_cos_sin(inv_freq, pos, self.dtype)
        q, k0, v0 = self.project(emb, g, cos, sin)
        self_keys = (k0.swapaxes(1, 2), v0.swapaxes(1, 2), visible)
        q, g = at_positions(q, anchors), at_positions(g, anchors)
        out, gate = self.mix_memory(self.finish(g, attend(q, [self_keys], kernel=kernel)),
                                    anchors, anchors, memory, inv_freq, kernel)
        first = (self.readout(out, at_positions(emb, anchors)) if self.token_readout
                 else out)
        outs, gates, diag, h = [first], [gate], [], out
        for k in range(1, steps):
            idx = jnp.minimum(anchors + k + 1, tokens.shape[1] - 1)
            emb = jnp.take(embed, jnp.take_along_axis(tokens, idx, axis=1), axis=0)
            cos, sin = layers.rope_cos_sin(inv_freq, anchors + k, self.dtype)
            q, kk, vv = self.project(emb, h, cos, sin)
            diag.append((kk, vv))
            out = self.finish(h, attend(q, [self_keys], diag, kernel=kernel))
            out, gate = self.mix_memory(out, anchors + k, anchors, memory, inv_freq, kernel)
            outs.append(self.readout(out, emb))
            gates.append(gate)
            h = out
        return jnp.stack(outs), (None if gates[0] is None else jnp.stack(gates))

    def mix_memory(self, out, q_positions, limit, memory, inv_freq, kernel=None,
                   window=None):
        """Hook for the hybrid's cross-attention path over the merged target memory
        (identity here); returns (out, gate or None). See Hybrid.mix_memory."""
        return out, None


def at_positions(x, idx):
    """x [B,T,...] at i32[B,P] positions -> [B,P,...]."""
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)
