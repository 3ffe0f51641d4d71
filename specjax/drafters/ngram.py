"""N-gram prompt lookup drafter: training-free, q one-hot.

Proposes the continuation of the latest earlier occurrence of the current suffix of
prompt + output, trying the longest suffix first (n = n_max down to n_min). If the
continuation runs past the end of the known text, it repeats the matched span
(periodic extrapolation). With no match at all it proposes the last token repeated.
Source: prompt lookup decoding (A. Saxena, 2023; transformers
`PromptLookupCandidateGenerator`), vectorised over the static token buffer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """gamma: G; n_max, n_min: suffix lengths tried, longest first; vocab_size: V."""

    gamma: int
    vocab_size: int
    n_max: int = 3
    n_min: int = 1
    sampling: SamplingParams = SamplingParams()
    capture: tuple[int, ...] = ()

    def init(self, params, view, key):
        return ()

    def update(self, params, state, view, num_accepted):
        return state

    def propose(self, params, state, view, key, first_rank=None):
        """draft i32[B,G] and its one-hot q f32[B,G,V]; reads only `view.tokens`.

        first_rank (rank i32 scalar, K static) for several drafts per step (`--num-drafts`,
        at every temperature: the proposals are deterministic): the continuation of the
        rank-th latest occurrence (0 = the latest) of the longest suffix that occurs more
        than rank times; none: the last token repeated, as without a match."""
        tokens, lengths = view.tokens, view.lengths
        B, S = tokens.shape
        j = jnp.arange(S)[None, :]  # candidate end index of an earlier occurrence
        best = jnp.full((B,), -1, jnp.int32)
        for n in range(self.n_min, self.n_max + 1):  # longer n overrides shorter
            match = (j >= n - 1) & (j <= lengths[:, None] - 2) & (lengths[:, None] >= n)
            for k in range(n):
                last_k = jnp.take_along_axis(tokens, jnp.maximum(lengths - 1 - k, 0)[:, None], 1)
                shifted = jnp.roll(tokens, k, axis=1)  # shifted[b, j] = tokens[b, j-k]
                match &= shifted == last_k
            if first_rank is None:
                found = jnp.max(jnp.where(match, j, -1), axis=1).astype(jnp.int32)
            else:  # the rank-th latest occurrence, or -1
                rank, k = first_rank
                latest = jax.lax.top_k(jnp.where(match, j, -1), min(k, S))[0]
                found = jnp.take(latest, rank, axis=1).astype(jnp.int32)
            best = jnp.where(found >= 0, found, best)
        period = jnp.maximum(lengths - 1 - best, 1)
        i = jnp.arange(self.gamma)[None, :]
        idx = best[:, None] + 1 + jnp.mod(i, period[:, None])
        idx = jnp.where(best[:, None] >= 0, idx, lengths[:, None] - 1)
        draft = jnp.take_along_axis(tokens, jnp.clip(idx, 0, S - 1), axis=1).astype(jnp.int32)
        q = jax.nn.one_hot(draft, self.vocab_size, dtype=jnp.float32)
        return draft, q, state
