"""Static-shape, layer-major KV cache shared by the target, draft LMs and (later) KV-reuse
drafters and the attention kernel.

Layout (documented once, read in place by later drafters):
  k, v: [L, B, K, S, H]   slot s of row b, KV head k: key/value of position s
  lengths: i32[B]         positions 0..lengths-1 of each row are valid

Heads before positions: per (row, KV head) the keys are one contiguous [S, H] block,
so attention is a plain batched matmul with no per-step transpose of the cache (the
[L,B,S,K,H] order made XLA:CPU transpose every layer's slice on every step), and an
attention kernel tiles S directly.

Writes go straight into the full buffers (a scatter at the given positions), so
inside a jitted loop they happen in place. Rewinding a row is moving its length
back: rejected entries stay and are overwritten by the next write. Attention masks
slots by position (slot <= query position), so stale slots past a row's length are
never read as long as writes are contiguous from the first uncached position,
which every caller in specjax guarantees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """k, v: [L, B, K, S, H] (model dtype); lengths: i32[B]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, num_layers, batch, capacity, num_kv_heads, head_dim, dtype=jnp.float32):
        """An empty cache of capacity S = `capacity` positions per row."""
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        """S, in positions."""
        return self.k.shape[3]

    def rewind(self, lengths: jax.Array) -> KVCache:
        """Sets each row's valid length to `lengths` (i32[B]); entries past it become stale."""
        return self.replace(lengths=lengths.astype(jnp.int32))
