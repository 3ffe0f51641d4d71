"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping (optax).

    tx, schedule = make_optimizer(cfg.optim, total_steps=cfg.train.steps)

Order inside the chain: clip the gradient to global norm `clip_norm` (Pascanu et al.
2013), then AdamW (Loshchilov & Hutter 2019: Adam moments, decoupled weight decay
times the learning rate). Weight decay applies to matrices (rank >= 2: projections,
embeddings, LM head) and not to norm weights or biases, as in GPT-2/nanoGPT.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specjax.train.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate used by the update of optimizer step s (s = 0 is the first update).

    Linear warmup lr * (s + 1) / warmup_steps for s < warmup_steps (the first update
    already moves), then a half cosine from `lr` down to `lr * min_lr_ratio` at
    s = total_steps - 1, where it stays.
    """
    peak, end = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = cfg.warmup_steps
    decay = max(total_steps - 1 - warmup, 1)

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * (s + 1.0) / max(warmup, 1)
        frac = jnp.clip((s - warmup) / decay, 0.0, 1.0)
        cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(s < warmup, warm, cosine)

    return schedule


def decay_mask(params):
    """True for leaves that take weight decay: arrays of rank >= 2 (matrices; stacked
    norm weights [L, D] are excluded by name: the innermost string key of the path)."""

    def one(path, leaf):
        keys = [k.key for k in path if isinstance(getattr(k, "key", None), str)]
        name = keys[-1] if keys else ""
        return leaf.ndim >= 2 and not name.endswith(("norm", "bias"))

    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg: OptimConfig, total_steps: int):
    """Returns (optax.GradientTransformation, schedule).

    Args:
      cfg: optimizer hyper-parameters.
      total_steps: length of the run in optimizer steps (the cosine's end).
    """
    schedule = lr_schedule(cfg, total_steps)
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule
