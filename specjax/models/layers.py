"""The decoder layer's pieces, written once for the target (`specjax.models.model`) and the
learned drafters (`specjax.drafters`).

A layer's weights are a dict w of one layer's arrays under the target's names (HF
[out, in] layout): input_norm [D], q_proj [N*H,in], k_proj / v_proj [K*H,in], optional
q_norm / k_norm [H] (Qwen3 and the drafters' default), optional q_bias / k_bias / v_bias
/ o_bias (attention_bias), o_proj [D,N*H], post_norm [D], gate_proj / up_proj [F,D],
down_proj [D,F]. A piece reads the optional weights when w holds them, so the same code
serves Qwen3, Llama and the drafters.

    h = layer_qkv(w, x, cos, sin, eps, N, K, H)      # input_norm, q/k/v, q/k norm, RoPE
    attn = <attention of q over k, v>                # the caller's: cache, sources, ...
    x = layer_out(w, x, attn, eps)                   # x + o_proj(attn), then the MLP

Sources: transformers `models/qwen3/modeling_qwen3.py` and
`models/llama/modeling_llama.py` (RMSNorm in f32, rotate-half RoPE, SwiGLU MLP, Qwen3's
per-head q/k RMSNorm before RoPE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import invariant
from specjax.models.matmul import linear


def rms_norm(x, weight, eps):
    """RMSNorm with f32 statistics, output in x's dtype (HF Qwen3RMSNorm / LlamaRMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(inv_freq, positions, dtype, scale: float = 1.0):
    """cos, sin: [B,T,H] for i32[B,T] positions (rotate-half layout), times `scale` (YaRN's
    attention temperature, `ModelConfig.attention_scaling`; applied in f32 before the
    cast, as transformers' rotary embeddings do)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last axis (HF's rotate_half)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """x: [B,T,heads,H]; cos, sin: [B,T,H]."""
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


def qkv(w, x, cos, sin, eps, num_heads: int, num_kv_heads: int, head_dim: int):
    """Projections of x [B,T,in] -> q [B,T,N,H], k, v [B,T,K,H]: q/k/v (+ bias when w has
    q_bias), q/k RMSNorm when w has q_norm / k_norm, then RoPE on q and k."""
    B, T, _ = x.shape
    q = linear(x, w["q_proj"])
    k = linear(x, w["k_proj"])
    v = linear(x, w["v_proj"])
    if "q_bias" in w:
        q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
    q = q.reshape(B, T, num_heads, head_dim)
    k = k.reshape(B, T, num_kv_heads, head_dim)
    v = v.reshape(B, T, num_kv_heads, head_dim)
    if "q_norm" in w:
        q = rms_norm(q, w["q_norm"], eps)
        k = rms_norm(k, w["k_norm"], eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def kv(w, x, cos, sin, eps, num_kv_heads: int, head_dim: int):
    """k, v [B,T,K,H] of x [B,T,in]: the key/value half of `qkv` (k_norm when w has it,
    RoPE on k)."""
    B, T, _ = x.shape
    k = linear(x, w["k_proj"]).reshape(B, T, num_kv_heads, head_dim)
    v = linear(x, w["v_proj"]).reshape(B, T, num_kv_heads, head_dim)
    if "k_norm" in w:
        k = rms_norm(k, w["k_norm"], eps)
    return apply_rope(k, cos, sin), v


def layer_qkv(w, x, cos, sin, eps, num_heads: int, num_kv_heads: int, head_dim: int,
              rows: int | None = None):
    """A layer's attention inputs: `qkv` of input_norm(x) for the residual x [B,T,D].
    rows: None, or the exact mode's tile: token rows in tiles of that many
    (`specjax.models.invariant.per_row`)."""
    if rows is not None:
        B, T, D = x.shape

        def one(tile):  # x [rows, D], cos, sin [rows, H]: rows as a batch of T = 1
            xr, c, s = (a[:, None] for a in tile)
            return tuple(a[:, 0] for a in layer_qkv(w, xr, c, s, eps, num_heads,
                                                     num_kv_heads, head_dim))

        trig = (jnp.broadcast_to(a, (B, T, a.shape[-1])).reshape(B * T, -1) for a in (cos, sin))
        q, k, v = invariant.per_row(one, (x.reshape(B * T, D), *trig), rows)
        return (q.reshape(B, T, num_heads, head_dim), k.reshape(B, T, num_kv_heads, head_dim),
                v.reshape(B, T, num_kv_heads, head_dim))
    return qkv(w, rms_norm(x, w["input_norm"], eps), cos, sin, eps, num_heads,
               num_kv_heads, head_dim)


def attention_proj(w, attn):
    """o_proj(attn) (+ o_bias when w has it) for attn [B,T,N*H] -> [B,T,D]."""
    o = linear(attn, w["o_proj"])
    if "o_bias" in w:
        o = o + w["o_bias"]
    return o


def attention_out(w, x, attn):
    """x + `attention_proj`(attn) for attn [B,T,N*H]."""
    return x + attention_proj(w, attn)


def swiglu(w, h):
    """down_proj(silu(gate_proj(h)) * up_proj(h)) for the normed h [B,T,D] -> [B,T,D]."""
    gate = linear(h, w["gate_proj"])
    up = linear(h, w["up_proj"])
    return linear(jax.nn.silu(gate) * up, w["down_proj"])


def mlp(w, x, eps):
    """x + SwiGLU(post_norm(x)) for x [B,T,D]."""
    return x + swiglu(w, rms_norm(x, w["post_norm"], eps))


def layer_out(w, x, attn, eps, rows: int | None = None):
    """The rest of a layer after attention: `attention_out`, then the `mlp` -> [B,T,D].
    rows: as in `layer_qkv`."""
    if rows is not None:
        B, T, D = x.shape
        out = invariant.per_row(lambda t: layer_out(w, t[0][:, None], t[1][:, None], eps)[:, 0],
                                (x.reshape(B * T, D), attn.reshape(B * T, -1)), rows)
        return out.reshape(B, T, D)
    return mlp(w, attention_out(w, x, attn), eps)


def logits(x, final_norm, head, eps, rows: int | None = None):
    """f32[...,V] = head(final_norm(x)) with an LM head [V,D]. rows: as in `layer_qkv`."""
    if rows is not None:
        flat = x.reshape(-1, x.shape[-1])
        out = invariant.per_row(lambda r: logits(r, final_norm, head, eps), flat, rows)
        return out.reshape(*x.shape[:-1], head.shape[0])
    return linear(rms_norm(x, final_norm, eps), head, jnp.float32)
