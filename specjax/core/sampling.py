"""Filtered next-token distributions (temperature, top-k, top-p) and sampling.

Losslessness is with respect to the FILTERED target distribution (docs/design.md 4): the
loop turns target and drafter logits into probabilities with the same
`SamplingParams` before verification. Temperature 0 means greedy: the distribution
is one-hot at the argmax (first index on ties, as `jnp.argmax`).

Filter order (as transformers' logits processors): temperature, then top-k, then
top-p. top-k keeps the k largest logits (ties at the k-th value kept); top-p keeps
the smallest set of most probable tokens whose mass reaches `top_p` (a token is
kept when the mass of strictly more probable tokens is below `top_p`; ties at the
boundary kept).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature >= 0 (0 = greedy); top_k >= 0 (0 = off); top_p in (0, 1] (1 = off)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecjaxError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise SpecjaxError(f"top_k={self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            raise SpecjaxError(f"top_p={self.top_p} must be in (0, 1] (1 turns it off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """f32[..., V] logits -> f32[..., V] probabilities after temperature, top-k, top-p.

    With temperature 0: one-hot at the argmax.
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    logits = logits / sp.temperature
    if 0 < sp.top_k < V:
        kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    if sp.top_p < 1:
        desc = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(desc, axis=-1) - desc
        keep_sorted = mass_before < sp.top_p
        n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        probs = jnp.where(probs >= threshold, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return probs


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws i32[...] token ids from f32[..., V] probabilities (zeros never drawn)."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def sample_logits(key: jax.Array, logits: jax.Array, sp: SamplingParams):
    """Next token i32[...] and its filtered distribution f32[..., V] from logits."""
    probs = filtered_probs(logits, sp)
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), probs
    return sample(key, probs), probs


def ranked_choice(logits: jax.Array, probs: jax.Array, token: jax.Array, sp: SamplingParams,
                  first_rank):
    """A draft's first token when several drafts start from one state (`--num-drafts`).

    first_rank: None (keep `token` and `probs`: one draft, or independent samples at
    temperature > 0), or (rank i32 scalar, K static int): at temperature 0 the token of the
    rank-th largest logit (0 = argmax; lower index first on ties, as `jax.lax.top_k`) with
    a one-hot q, so K drafts start with the top-K first tokens (a deterministic choice:
    verification stays exact). logits f32[B,V], probs f32[B,V], token i32[B]."""
    if first_rank is None or not sp.greedy:
        return token, probs
    rank, k = first_rank
    choice = jax.lax.top_k(logits.astype(jnp.float32), k)[1]  # [B,K]
    x = jnp.take(choice, rank, axis=-1).astype(jnp.int32)
    return x, jax.nn.one_hot(x, logits.shape[-1], dtype=probs.dtype)
