"""What the learned drafters' loop adapters share (`LearnedDrafter`), and the map from a
hot draft vocabulary back to the target's ids (`hot_to_target`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from specjax.core.drafter import AttentionKernel
from specjax.core.sampling import SamplingParams
from specjax.drafters.config import DrafterConfig
from specjax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class LearnedDrafter:
    """What the loop adapters of the learned drafters share (eagle3/hybrid, kv, block):
    graphdef = `nnx.split(net)[0]` (static); params = {"net": its state, "embed": [V,D],
    "head": [V,D], "inv_freq": f32[H/2]} (the target's arrays, not copied)."""

    graphdef: nnx.GraphDef
    cfg: DrafterConfig
    gamma: int
    sampling: SamplingParams = SamplingParams()
    # Early stop of sequential drafting (eagle3/hybrid): once every row's chain
    # confidence (the product of its drafts' top-1 draft probabilities) is below this,
    # the remaining draft positions get a filler token with a one-hot q (0: draft all G).
    stop_below: float = 0.0
    # The attention kernel of every `attend` over a `Limit` source (None: the jnp path),
    # fixed by the loop's or trainer's static configuration (`specjax.decoding.kernel_policy`).
    attention: AttentionKernel | None = None
    # Draft window (`--draft-window`, docs/long_context.md): at decoding, the drafter reads
    # only the last `window` context positions of its context (its own cache of the
    # target's features, the target's K/V memory, the block drafter's context); None:
    # all of them. Output stays exact: the target verifies every draft.
    window: int | None = None

    @property
    def capture(self) -> tuple[int, ...]:
        """Target depths whose hidden states the drafter reads (none for KV-only)."""
        return self.cfg.capture if self.cfg.uses_hidden else ()

    def net(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params["net"])

    def logits(self, net, out, params):
        """f32[...,V] draft logits of outputs out [...,D]: params["head"] after the net's
        final norm. With params["draft_ids"] (i32[Vd], an own LM head [Vd,D] over a hot
        draft vocabulary, EAGLE-3's d2t) the Vd logits land at those target ids and
        every other id gets -inf, so q is zero outside the hot set (as vLLM's
        `Eagle3LlamaForCausalLM.compute_logits`)."""
        lg = net.logits(out, params["head"])
        if "draft_ids" not in params:
            return lg
        return hot_to_target(lg, params["draft_ids"], self.cfg.vocab_size)

    def empty_cache(self, num_layers: int, view, dtype) -> KVCache:
        """A drafter-side cache [num_layers,B,K,S,H] as wide as the target's."""
        c = self.cfg
        return KVCache.init(num_layers, view.lengths.shape[0], view.target_cache.capacity,
                            c.num_kv_heads, c.head_dim, dtype)


def hot_to_target(logits, draft_ids, vocab_size: int):
    """f32[...,Vd] logits over a hot draft vocabulary -> f32[...,V]: entry j goes to
    target id draft_ids[j] (i32[Vd], distinct), -inf elsewhere."""
    full = jnp.full((*logits.shape[:-1], vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., draft_ids].set(logits.astype(jnp.float32))
