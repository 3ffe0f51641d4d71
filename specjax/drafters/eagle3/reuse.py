"""medc's reuse of drafted hidden states (`Eagle3Drafter.reuse`, `--draft-reuse`,
docs/medc.md): the chain a draft step keeps (`DraftChain`), the next step's start from
it (`start`), the forward that takes a previous entry or runs the layer (`forward`) and
the chain this step leaves (`kept`). Only for networks whose chain reads no token, so a
drafted hidden state stays valid whatever tokens the verification accepted."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.eagle3.network import at_positions


@struct.dataclass
class DraftChain:
    """The last draft step's hidden-state chain, kept for reuse (`Eagle3Drafter.reuse`,
    medc only): out [B,n,D] the outputs of its forwards (slot j at RoPE position
    base + j), k, v [B,K,n,H] their draft-buffer keys and values, base i32[B], valid
    i32[] (slots 0..valid-1 were computed), counts i32[4] summed over the steps: drafted
    hidden states reused and drafted in all (over the rows that drafted), draft forwards
    the batch skipped and draft forwards in all (n = the drafter's G - 1, at least 1)."""

    out: jax.Array
    k: jax.Array
    v: jax.Array
    base: jax.Array
    valid: jax.Array
    counts: jax.Array


def empty_chain(drafter, view, dtype) -> DraftChain | None:
    """No chain yet (valid 0): nothing to reuse at the first step; None without reuse."""
    if not drafter.reuse:
        return None
    c, B, n = drafter.cfg, view.lengths.shape[0], max(drafter.gamma - 1, 1)
    kv = jnp.zeros((B, c.num_kv_heads, n, c.head_dim), dtype)
    return DraftChain(jnp.zeros((B, n, c.hidden_size), dtype), kv, kv,
                      jnp.zeros((B,), jnp.int32), jnp.int32(0), jnp.zeros((4,), jnp.int32))


class Reuse(NamedTuple):
    """What a draft step takes from the previous chain: old_out [B,max(n,1),D] the
    previous outputs at this step's draft positions, mine i32[B] how many of them each
    row has, r i32[] the forwards the whole batch skips (min of mine over the rows that
    drafted), active bool[B] the rows with new tokens (shift > 0)."""

    old_out: jax.Array
    mine: jax.Array
    r: jax.Array
    active: jax.Array


def start(chain: DraftChain, pos0, n: int, empty):
    """(Reuse, (dk, dv)) for a step whose first draft entry is at pos0 i32[B,1]: forward
    j computes the entry at position pos0+j, which the previous step's forward j + shift
    (shift = pos0 - its base) computed from no token either; the draft buffers
    [B,K,max(n,1),H] (dtype of `empty`) start with those slots' keys and values."""
    shift = pos0[:, 0] - chain.base  # [B] 0 for a finished row (no new tokens)
    active = shift > 0
    mine = jnp.clip(chain.valid - shift, 0, n)  # [B] previous entries per row
    r = jnp.min(jnp.where(active, mine, n))  # forwards the whole batch skips
    slots = jnp.clip(shift[:, None] + jnp.arange(max(n, 1))[None, :], 0,
                     chain.out.shape[1] - 1)  # [B,max(n,1)] previous slots
    old_out = at_positions(chain.out, slots)  # [B,max(n,1),D]
    buffers = tuple(jnp.take_along_axis(a, slots[:, None, :, None], axis=2)
                    .astype(empty.dtype) for a in (chain.k, chain.v))
    return Reuse(old_out, mine, r, active), buffers


def forward(reuse: Reuse, layer, embed, dk, dv, h, tok, j):
    """Draft forward j with reuse: row b takes the previous chain's entry while
    j < mine[b]; the layer (`layer(dk, dv, h, tok, j)` -> (dk, dv, out [B,D], emb))
    runs (once or never: a conditional would copy its operands every forward) only if
    some row needs it, j >= r. Returns (dk, dv, out [B,D], emb [B,1,D]) as the layer."""
    old = jax.lax.dynamic_index_in_dim(reuse.old_out, j, axis=1, keepdims=False)
    emb = jnp.take(embed, tok[:, None], axis=0)

    def run(cr):
        dk_new, dv_new, out, _ = layer(dk, dv, h, tok, j)
        return False, dk_new, dv_new, out.astype(old.dtype)

    _, dk_new, dv_new, new = jax.lax.while_loop(lambda cr: cr[0], run,
                                                (j >= reuse.r, dk, dv, old))
    take = j < reuse.mine  # [B]
    out = jnp.where(take[:, None], old, new)
    dk = jnp.where(take[:, None, None, None], dk, dk_new)  # slot j differs
    dv = jnp.where(take[:, None, None, None], dv, dv_new)
    return dk, dv, out, emb


def kept(chain: DraftChain, reuse: Reuse, pos0, outs, valid, dk, dv) -> DraftChain:
    """The chain this step leaves: its outputs outs [B,m,D] (m <= n; slots 0..valid-1
    computed) and draft buffers dk, dv, padded to the chain's width, based at pos0
    i32[B,1]; the counts grow by this step's reused and drafted states."""
    pad = chain.out.shape[1] - outs.shape[1]
    out = jnp.pad(outs, ((0, 0), (0, pad), (0, 0))).astype(chain.out.dtype)
    kk, vv = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))).astype(chain.k.dtype)
              for a in (dk[..., :outs.shape[1], :], dv[..., :outs.shape[1], :]))
    rows = jnp.sum(reuse.active)
    counts = chain.counts + jnp.stack([
        jnp.sum(jnp.where(reuse.active, jnp.minimum(reuse.mine, valid), 0)), rows * valid,
        jnp.minimum(reuse.r, valid), valid]).astype(jnp.int32)
    return DraftChain(out, kk, vv, pos0[:, 0], valid, counts)
