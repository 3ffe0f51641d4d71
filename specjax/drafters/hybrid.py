"""KVShot hybrid drafter (arXiv 2604.26412; docs/design.md section 5): the EAGLE-3 path n plus
a cross-attention path o over a merged memory M of the target's K/V, mixed by a gate:

    o = n + cross_o(attend(rope(q_norm(cross_q(cross_norm(n)))), M[positions <= t]))
    g = sigmoid(gate_w [n; o; o - n] + gate_b)          g in (0, 1)^D, 0.5 at init
    h = n + g * gate_d (o - n)                            gate_d starts as the identity

With gate_d = 0 (or g -> 0) h = n: the hybrid is exactly EAGLE-3. The memory M of entry t
(and of every draft step anchored at t) holds target positions <= t: everything the
target has cached. Decoding keeps M in the drafter state, extended per verification
(see eagle3.Eagle3Drafter); training reports the gate's mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import registry
from specjax.drafters.attend import attend, windowed
from specjax.drafters.config import DrafterConfig, kv_layer_set
from specjax.drafters.eagle3 import Eagle3, Eagle3Drafter, Eagle3Kind, eagle3_capture
from specjax.drafters.memory import merge_init
from specjax.drafters.weights import normal, ones
from specjax.models import layers
from specjax.models.matmul import linear


class Hybrid(Eagle3):
    """Eagle3's weights plus merge_k/merge_v [1,K*H,Ls*K*H], cross_norm [D], cross_q
    [N*H,D], cross_q_norm [H], cross_o [D,N*H], gate_w [D,3D], gate_b [D], gate_d [D,D]."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.merge_k, self.merge_v = merge_init(cfg, dtype)
        self.cross_norm = ones((D,), dtype)
        self.cross_q = normal(rngs, (N * H, D), dtype)
        self.cross_q_norm = ones((H,), dtype)
        self.cross_o = normal(rngs, (D, N * H), dtype)
        self.gate_w = normal(rngs, (D, 3 * D), dtype)
        self.gate_b = nnx.Param(jnp.zeros((D,), dtype))
        self.gate_d = nnx.Param(jnp.asarray(np.eye(D), dtype))

    def mix_memory(self, n, q_positions, limit, memory, inv_freq, kernel=None,
                   window=None):
        """n [B,T,D] (the EAGLE-3 output) -> (h [B,T,D], gate [B,T,D]).

        q_positions i32[B,T]: RoPE positions of the queries; limit i32[B,T]: memory slots
        <= limit are visible (with a draft window of `window` slots, only the last
        `window` of them); memory: (k, v) [B,K,S,H] with slot s = position s;
        kernel: the attention kernel of `attend` (None: jnp).
        """
        c = self.cfg
        B, T, D = n.shape
        mk, mv = memory
        eps = c.rms_norm_eps
        x = layers.rms_norm(n, self.cross_norm[...], eps)
        q = linear(x, self.cross_q[...]).reshape(B, T, c.num_heads, c.head_dim)
        cos, sin = layers.rope_cos_sin(inv_freq, q_positions, n.dtype)
        q = layers.apply_rope(layers.rms_norm(q, self.cross_q_norm[...], eps), cos, sin)
        o = n + linear(attend(q, [(mk, mv, windowed(limit, window))], kernel=kernel),
                       self.cross_o[...])
        g = jax.nn.sigmoid(linear(jnp.concatenate([n, o, o - n], -1), self.gate_w[...])
                           + self.gate_b[...])
        return n + g * linear(o - n, self.gate_d[...]), g


class HybridKind(Eagle3Kind):
    """hybrid: eagle3 plus one merged target-KV memory (Ls = num_kv_layers layers) behind
    a gate; decodes with the eagle3 adapter; TTT; stops early."""

    name, network, adapter, objective = "hybrid", Hybrid, Eagle3Drafter, "ttt"
    reads_target_kv_shapes = True

    def defaults(self, target, opts):
        return {"capture": eagle3_capture(target.num_layers),
                "kv_layers": kv_layer_set(target.num_layers, opts["num_kv_layers"])}

    def uses_kv(self, cfg):
        return True

    def num_memories(self, cfg):
        return 1


registry.register(HybridKind())
