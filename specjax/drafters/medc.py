"""medc: a hidden-state drafter after "Make Every Draft Count: Hidden State based
Speculative Decoding" (arXiv 2602.21224). Only the paper's abstract is public; this module
is specjax's reading of it, and docs/medc.md says which parts are the abstract's and which
are ours.

The abstract's idea: draft autoregressively in hidden-state space WITHOUT token inputs,
and inject token information only after the hidden states exist, so that a drafted
hidden state is never computed from a wrong token.

Our network is EAGLE-3's (eagle3.Eagle3) with the token moved from the layer's input to
its output:

    h_0 = fc(target features at 3 depths)                      as EAGLE-3
    o_k = layer(hidden_norm(h_k))   h_{k+1} = o_k              no token in the chain
    z_k = o_k + inject_w [inject_norm(o_k); embed_norm(e(x))]  the token enters here
    logits_k = lm_head(final_norm(z_k))

where x is the token that follows o_k's position (the pending token for the first draft,
then each draft token) and inject_w [D, 2D] is the light mapping the abstract names. The
entry at position t therefore pairs target features t with token t+1 and predicts token
t+2, exactly as EAGLE-3's entry does, so EAGLE-3's TTT objective, its decoding adapter
(eagle3.Eagle3Drafter, through the `readout` hook), its caches and its trees serve it
unchanged. Because o_1 .. o_{G-1} never read a drafted token, every drafted hidden state
stays valid after a rejection: only the readout of the rejected token changes.
Verification is untouched, so the output is exactly the target's.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from specjax.drafters import registry
from specjax.drafters.config import DrafterConfig
from specjax.drafters.eagle3 import Eagle3, Eagle3Drafter, Eagle3Kind
from specjax.drafters.weights import layer_params, normal, ones
from specjax.models import layers
from specjax.models.matmul import linear


class Medc(Eagle3):
    """fc [D, C*D], hidden_norm [D], one layer reading D features (weights.layer_weights),
    final_norm [D], and the token injection: inject_norm [D], embed_norm [D],
    inject_w [D, 2D]."""

    token_readout = True
    input_width = 1  # h alone
    chain_reads_token = False  # a draft tree's nodes of one depth share one chain state

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)  # fc, norms, the layer (D inputs)
        D = cfg.hidden_size
        self.inject_norm = ones((D,), dtype)
        self.inject_w = normal(rngs, (D, 2 * D), dtype)

    def project(self, emb, h, cos, sin):
        """q [B,T,N,H], k, v [B,T,K,H] from h [B,T,D] alone (emb is not read: no token
        enters the hidden-state chain)."""
        del emb
        c = self.cfg
        x = layers.rms_norm(h, self.hidden_norm[...], c.rms_norm_eps)
        return layers.qkv(layer_params(self, 0), x, cos, sin, c.rms_norm_eps, c.num_heads,
                          c.num_kv_heads, c.head_dim)

    def readout(self, out, emb):
        """z = out + inject_w [inject_norm(out); embed_norm(emb)]: out, emb [...,D] ->
        [...,D], the features the logits read (out itself stays the chain's next h)."""
        eps = self.cfg.rms_norm_eps
        x = jnp.concatenate([layers.rms_norm(out, self.inject_norm[...], eps),
                             layers.rms_norm(emb.astype(out.dtype), self.embed_norm[...],
                                             eps)], axis=-1)
        return out + linear(x, self.inject_w[...])


class MedcKind(Eagle3Kind):
    """medc: eagle3's layout with the token injected after the layer (no token in the
    hidden-state chain); TTT; decodes with the eagle3 adapter; stops early."""

    name, network, adapter, objective = "medc", Medc, Eagle3Drafter, "ttt"


registry.register(MedcKind())
