"""The eagle3 family's decoding state (`Eagle3State`) and the view of its hybrid memory
that the forwards read (`first_memory`)."""

from __future__ import annotations

import jax
from flax import struct

from specjax.drafters.eagle3.reuse import DraftChain
from specjax.models.kv_cache import KVCache


@struct.dataclass
class Eagle3State:
    cache: KVCache  # k, v [1,B,K,S,H]; positions 0..lengths-2 valid after update
    h_last: jax.Array  # [B,D] output at position lengths-2
    memory: KVCache | None  # hybrid: merged target K/V [1,B,K,S,H]; None for eagle3
    chain: DraftChain | None = None  # medc with reuse; None otherwise


def first_memory(memory: KVCache | None):
    """(k, v) [B,K,S,H] of the hybrid's one merged memory, or None (eagle3)."""
    return None if memory is None else (memory.k[0], memory.v[0])
