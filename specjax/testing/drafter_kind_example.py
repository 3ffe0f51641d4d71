"""An example drafter kind, "toy", defined in this one file (docs/design.md section 11).

Importing this module registers it; nothing else in specjax names it. Training
(`train.py` / `specjax.train`, objective ttt), decoding (`make_drafter`, the speculative
loop, `Engine`), export and loading (`specjax.drafters.io`) and the memory planner then
work for it as for the built-in kinds.

The toy drafter reads the target's residual stream at ONE depth (the input of layer L/2)
and drafts step by step like EAGLE-3, without attention:

    h_0 = fc(target feature at position t)              [B,D]
    out_k = mlp(embed(token t+k+1) + h_k)               one SwiGLU layer (layers.mlp)
    h_{k+1} = out_k;  logits_k = head(final_norm(out_k))   predicts token t+k+2

Decoding state: the target feature at the last position the target has verified
(lengths-2), from the prefill (init) or the verify forward (update).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.core.sampling import sample_logits
from specjax.drafters import registry
from specjax.drafters.config import DrafterConfig
from specjax.drafters.learned import LearnedDrafter
from specjax.drafters.weights import normal, ones
from specjax.errors import SpecjaxError
from specjax.models import layers
from specjax.models.matmul import linear


class ToyNet(nnx.Module):
    """fc [D,D], one SwiGLU layer (post_norm [1,D], gate_proj/up_proj [1,F,D], down_proj
    [1,D,F]: `weights.layer_weights`' names and layout), final_norm [D]."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.cfg, self.dtype = cfg, dtype
        self.fc = normal(rngs, (D, D), dtype)
        self.post_norm = ones((1, D), dtype)
        self.gate_proj = normal(rngs, (1, F, D), dtype)
        self.up_proj = normal(rngs, (1, F, D), dtype)
        self.down_proj = normal(rngs, (1, D, F), dtype)
        self.final_norm = ones((D,), dtype)

    def features(self, feature):
        """fc over the target feature [...,D]."""
        return linear(feature, self.fc[...])

    def step(self, h, emb):
        """One draft step: h, emb [...,D] -> out [...,D] (pre-norm, the next step's h)."""
        w = {k: getattr(self, k)[0] for k in ("post_norm", "gate_proj", "up_proj",
                                               "down_proj")}
        return layers.mlp(w, emb + h, self.cfg.rms_norm_eps)

    def logits(self, out, head):
        return layers.logits(out, self.final_norm[...], head, self.cfg.rms_norm_eps)

    def ttt(self, hidden, kv, tokens, embed, inv_freq, steps: int, anchors=None,
            kernel=None):
        """The TTT unroll (the one signature of `registry.DrafterKind`): hidden [1,B,T,D],
        kv unused, tokens i32[B,T+1] -> (outputs [steps,B,P,D], None); step k at anchor t
        predicts token t+k+2. kernel (the attention kernel) is unused: no attention."""
        B, T = tokens.shape[0], tokens.shape[1] - 1
        if anchors is None:
            anchors = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h = jnp.take_along_axis(self.features(hidden[0]), anchors[:, :, None], axis=1)
        outs = []
        for k in range(steps):
            idx = jnp.minimum(anchors + k + 1, tokens.shape[1] - 1)
            emb = jnp.take(embed, jnp.take_along_axis(tokens, idx, axis=1), axis=0)
            h = self.step(h, emb)
            outs.append(h)
        return jnp.stack(outs), None


@struct.dataclass
class ToyState:
    feature: jax.Array  # [B,D] target feature at position lengths-2


@dataclasses.dataclass(frozen=True)
class ToyDrafter(LearnedDrafter):
    """Loop adapter for ToyNet; fields and params as learned.LearnedDrafter."""

    def _last(self, view):
        """The target feature at position lengths-2 of each row, from view.hidden."""
        T = view.hidden.shape[2]
        idx = jnp.clip(view.lengths - 2 - view.positions[:, 0], 0, T - 1)
        return jnp.take_along_axis(view.hidden[0], idx[:, None, None], axis=1)[:, 0]

    def init(self, params, view, key):
        return ToyState(self._last(view))

    def propose(self, params, state, view, key):
        net = self.net(params)
        tok = jnp.take_along_axis(view.tokens, (view.lengths - 1)[:, None], axis=1)[:, 0]
        h = net.features(state.feature)
        drafts, qs = [], []
        for k in jax.random.split(key, self.gamma):
            h = net.step(h, jnp.take(params["embed"], tok, axis=0))
            tok, q = sample_logits(k, self.logits(net, h, params), self.sampling)
            drafts.append(tok)
            qs.append(q)
        return jnp.stack(drafts, 1), jnp.stack(qs, 1), state

    def update(self, params, state, view, num_accepted):
        return ToyState(self._last(view))


class ToyKind(registry.DrafterKind):
    """toy: one layer, one capture depth (the input of layer L/2), trained with TTT."""

    name, network, adapter, objective = "toy", ToyNet, ToyDrafter, "ttt"
    reads_target_kv_shapes = False  # its N, K, H are unused
    default_num_layers = 1

    def defaults(self, target, opts):
        return {"capture": (target.num_layers // 2,), "kv_layers": ()}

    def validate(self, cfg):
        if cfg.num_layers != 1 or len(cfg.capture) != 1:
            raise SpecjaxError(f"toy drafters have one layer and one capture depth, got "
                               f"num_layers={cfg.num_layers}, capture={list(cfg.capture)}")

    def uses_hidden(self, cfg):
        return True

    def state_layers(self, cfg):
        return 0  # one [B,D] feature, no key/value cache


registry.register(ToyKind())
