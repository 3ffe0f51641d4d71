"""Random models with peaked (non-uniform) next-token distributions, for tests.

Default initialisation (std 0.02) gives nearly uniform distributions, where every
verifier looks right; scaling the embedding makes the logits large and the models
opinionated, and a noisy copy of the target makes a drafter that agrees often but
not always.
"""

from __future__ import annotations

import jax
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.model import Transformer


def peaked_model(cfg: ModelConfig, seed: int = 0, scale: float = 30.0) -> Transformer:
    """A Transformer whose embedding (and LM head) are scaled by `scale`."""
    m = Transformer(cfg, rngs=nnx.Rngs(seed))
    m.embed.set_value(m.embed[...] * scale)
    if m.lm_head is not None:
        m.lm_head.set_value(m.lm_head[...] * scale)
    return m


def noisy_copy(model: Transformer, noise: float, seed: int = 1) -> Transformer:
    """A copy of `model` with every parameter p replaced by p + noise * std(p) * N(0, 1)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [x + noise * x.std() * jax.random.normal(k, x.shape, x.dtype)
           if x.ndim >= 2 else x for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, new))
