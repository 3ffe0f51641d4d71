"""The target's K/V as a drafter's memory (KVShot; docs/design.md section 5).

- `merge_init` / `merge_kv`: the learned merge of the target's K/V at Ls layers into one
  memory (de-rotate, linear map over layers, re-rotate);
- `gather_positions` / `scatter_positions`: read the newly verified positions of the
  target cache in place, write a window of new K/V into a buffer;
- `memory_from_target` / `memory_update` / `ttt_memory`: the merged memories of the
  committed positions, built at prefill, extended after each verification, and over
  every position in training.

Keys and values are [B,K,S,H] like one layer of the target cache (docs/design.md section 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.config import DrafterConfig
from specjax.models.layers import rope_cos_sin, rotate_half
from specjax.models.matmul import linear


def merge_init(cfg: DrafterConfig, dtype) -> tuple[nnx.Param, nnx.Param]:
    """merge_k, merge_v [Lm, K*H, Ls*K*H]: memory m starts as an identity on target layer
    kv_layers[merge_sources()[m]] (it then reproduces that layer's attention)."""
    KH, Ls = cfg.num_kv_heads * cfg.head_dim, len(cfg.kv_layers)
    w = np.zeros((cfg.num_memories, KH, Ls * KH), np.float32)
    for m, src in enumerate(cfg.merge_sources()):
        w[m, :, src * KH:(src + 1) * KH] = np.eye(KH)
    return nnx.Param(jnp.asarray(w, dtype)), nnx.Param(jnp.asarray(w, dtype))


def merge_kv(wk, wv, k_src, v_src, cos, sin):
    """One merged memory from target K/V at Ls layers (KVShot; docs/design.md section 5).

    Args:
      wk, wv: [K*H, Ls*K*H] merge maps.
      k_src, v_src: [Ls,B,K,T,H] target keys (post-RoPE) and values at T positions.
      cos, sin: [B,T,H] RoPE of those positions.
    Returns: k, v [B,K,T,H]: keys de-rotated, merged, re-rotated at the same positions.
    """
    Ls, B, K, T, H = k_src.shape
    cs, sn = cos[:, None], sin[:, None]  # [B,1,T,H]: broadcast over Ls and K

    def rot(x, s):
        return x * cs + rotate_half(x) * s

    k_plain = rot(k_src, -sn)  # inverse RoPE
    flat_k = k_plain.transpose(1, 3, 0, 2, 4).reshape(B, T, Ls * K * H)
    flat_v = v_src.transpose(1, 3, 0, 2, 4).reshape(B, T, Ls * K * H)
    mk = linear(flat_k, wk).reshape(B, T, K, H).transpose(0, 2, 1, 3)
    mv = linear(flat_v, wv).reshape(B, T, K, H).transpose(0, 2, 1, 3)
    return rot(mk, sn), mv


def gather_positions(x, start, width: int):
    """x [L,B,K,S,H] -> [L,B,K,width,H]: slots start[b] .. start[b]+width-1 of each row
    (read in place by dynamic slices; start i32[B], clamped to the buffer)."""
    def row(xb, s):  # xb [L,K,S,H]
        return jax.lax.dynamic_slice_in_dim(xb, s, width, axis=2)

    return jax.vmap(row, in_axes=(1, 0), out_axes=1)(x, start)


def scatter_positions(buf, new, start):
    """Writes new [L,B,K,W,H] into buf [L,B,K,S,H] at slots start[b].. of row b, in place
    (one scatter; no copy of the buffer); positions past S are dropped."""
    L, B, K, W, H = new.shape
    pos = start[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]  # [B,W]
    b = jnp.arange(B)[:, None]
    # buf[:, b, :, pos] has shape [B,W,L,K,H]: the advanced indices broadcast to the front.
    return buf.at[:, b, :, pos].set(new.transpose(1, 3, 0, 2, 4), mode="drop")


def memory_from_target(module, cfg: DrafterConfig, k_all, v_all, cos, sin):
    """Every merged memory for T positions: target k_all, v_all [Ls,B,K,T,H] ->
    (k, v) each [Lm,B,K,T,H]."""
    ks, vs = [], []
    for m in range(cfg.num_memories):
        k, v = merge_kv(module.merge_k[m], module.merge_v[m], k_all, v_all, cos, sin)
        ks.append(k)
        vs.append(v)
    return jnp.stack(ks), jnp.stack(vs)


def memory_update(module, cfg: DrafterConfig, memory, target_cache, positions, inv_freq):
    """Merged memories extended at `positions` [B,T] (contiguous per row) with the target
    cache's K/V there, read in place: memory KVCache [Lm,B,K,S,H] -> the same."""
    T = positions.shape[1]
    k_new = gather_positions(target_cache.k, positions[:, 0], T)
    v_new = gather_positions(target_cache.v, positions[:, 0], T)
    idx = jnp.asarray(cfg.kv_layers)
    cos, sin = rope_cos_sin(inv_freq, positions, module.dtype)
    mk, mv = memory_from_target(module, cfg, k_new[idx], v_new[idx], cos, sin)
    return memory.replace(k=scatter_positions(memory.k, mk, positions[:, 0]),
                          v=scatter_positions(memory.v, mv, positions[:, 0]))


def ttt_memory(module, cfg: DrafterConfig, kv, inv_freq):
    """Training (TTT): the merged memories of every position 0..T-1 from the target K/V
    kv = (k, v) [Ls,B,K,T,H] at `cfg.kv_layers`: (k, v) each [Lm,B,K,T,H]."""
    B, T = kv[0].shape[1], kv[0].shape[3]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = rope_cos_sin(inv_freq, pos, module.dtype)
    return memory_from_target(module, cfg, kv[0], kv[1], cos, sin)
