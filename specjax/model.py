"""Qwen3 / Llama-3 decoder in Flax NNX with stacked layer weights and a static KV cache.

One code path serves prefill, single-token decoding and multi-token verification:
`Transformer.__call__(tokens[B,T], positions[B,T], cache)`. Layers run under
`lax.scan` over weights stacked on a leading L axis; weights keep HF's `[out, in]`
layout and every projection contracts the last axis (fast on XLA:CPU, docs/design.md 9).

Sources: transformers `models/qwen3/modeling_qwen3.py` and
`models/llama/modeling_llama.py` (RMSNorm in f32, rotate-half RoPE, GQA by
`repeat_kv`, SwiGLU MLP, Qwen3's per-head q/k RMSNorm before RoPE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.attention import DEFAULT_CHUNK, cache_attention
from specjax.config import ModelConfig
from specjax.kv_cache import KVCache
from specjax.matmul import CPU_WEIGHT_MAJOR_MAX_ROWS, linear  # noqa: F401  (re-exported)
from specjax.prefill import (  # noqa: F401  (re-exported for the drafters' imports)
    default_prefill_chunk,
    default_prefill_min_chunk,
    pad_rows,
    padded_width,
    prefill_pieces,
    scan_prompt_pieces,
)

# Stacked per-layer weights: name -> shape as a function of the config (HF [out, in]).
LAYER_SHAPES = {
    "input_norm": lambda c: (c.hidden_size,),
    "q_proj": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "k_proj": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "v_proj": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "o_proj": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "post_norm": lambda c: (c.hidden_size,),
    "gate_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "up_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "down_proj": lambda c: (c.hidden_size, c.intermediate_size),
}
QWEN3_SHAPES = {"q_norm": lambda c: (c.head_dim,), "k_norm": lambda c: (c.head_dim,)}
BIAS_SHAPES = {
    "q_bias": lambda c: (c.num_heads * c.head_dim,),
    "k_bias": lambda c: (c.num_kv_heads * c.head_dim,),
    "v_bias": lambda c: (c.num_kv_heads * c.head_dim,),
    "o_bias": lambda c: (c.hidden_size,),
}


def layer_shapes(cfg: ModelConfig) -> dict:
    """Per-layer weight name -> shape (without the leading L axis) for this config."""
    shapes = dict(LAYER_SHAPES)
    if cfg.family == "qwen3":
        shapes.update(QWEN3_SHAPES)
    if cfg.attention_bias:
        shapes.update(BIAS_SHAPES)
    return {k: f(cfg) for k, f in shapes.items()}


class ForwardOutput(NamedTuple):
    """logits: f32[B,T',V] (T' = T, or the width of `logits_at`);
    hidden: [C,B,T,D] residual stream at the captured depths (None if none asked);
    cache: the updated KVCache (None for a cache-free forward);
    kv: (k, v), each [Ls,B,K,T,H] (post-norm, post-RoPE, as a cache would hold them),
      of the `capture_kv` layers of a cache-free forward (None if none asked)."""

    logits: jax.Array
    hidden: jax.Array | None
    cache: KVCache
    kv: tuple[jax.Array, jax.Array] | None = None


def unstack_layers(state):
    """`nnx.split(model)[1]` with every stacked layer weight [L, ...] replaced by a tuple of
    L separate arrays (copies); `Transformer.__call__` then unrolls the layers and reads
    each weight in place. On XLA:CPU, slicing a stacked weight (under `lax.scan` or with a
    static index) copies it every step: measured 10.1 vs 6.1 ms per token on a 28M model.
    """
    state = jax.tree.map(lambda x: x, state)  # a new State; arrays shared
    for name, var in state.items():
        if name in LAYER_SHAPES or name in QWEN3_SHAPES or name in BIAS_SHAPES:
            value = var.get_value()
            if not isinstance(value, tuple):
                var.set_value(tuple(jnp.array(value[i]) for i in range(value.shape[0])))
    return state


def decoding_params(state, layer_loop: str = "auto"):
    """Params laid out for a decoding loop.

    layer_loop: "scan" (stacked weights under `lax.scan`: one compiled layer, the layout
      that compiles one layer whatever L), "unroll" (per-layer arrays, see
      `unstack_layers`: about 1.7x faster per token on XLA:CPU, and 2.1x on an H100 at
      Qwen3-8B's shapes, where the scan's per-layer weight slices cost extra HBM
      traffic; compile time grows with L), or "auto" (scan on TPU, where it is
      unmeasured, unroll elsewhere; H100 figures in
      benchmarks/results/device/h100-2026-11-26).
    """
    if layer_loop == "auto":
        layer_loop = "scan" if jax.default_backend() == "tpu" else "unroll"
    if layer_loop == "unroll":
        return unstack_layers(state)
    if layer_loop != "scan":
        raise ValueError(f"layer_loop={layer_loop!r}; expected auto, scan or unroll")
    return state


def rms_norm(x, weight, eps):
    """RMSNorm with f32 statistics, output in x's dtype (HF Qwen3RMSNorm / LlamaRMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(inv_freq, positions, dtype):
    """cos, sin: [B,T,H] for i32[B,T] positions (rotate-half layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x, cos, sin):
    """x: [B,T,heads,H]; cos, sin: [B,T,H]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Transformer(nnx.Module):
    """Decoder-only LM for the Qwen3 and Llama-3 families.

    Args:
      cfg: the model configuration.
      dtype: parameter and activation dtype (f32 on CPU, bf16 on TPU/GPU).
      rngs: initialisation randomness (normal, std 0.02; norms at 1).
      attention_chunk: cache slots per chunk of attention into the KV cache
        (`specjax.attention.cache_attention`): decoding reads only the chunks that hold
        a visible slot, so its cost follows the context, not the cache capacity.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 attention_chunk: int = DEFAULT_CHUNK):
        self.cfg = cfg
        self.dtype = dtype
        self.attention_chunk = attention_chunk
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size

        def init(shape, is_norm=False):
            if is_norm:
                return nnx.Param(jnp.ones(shape, dtype))
            return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype))

        self.embed = init((V, D))
        for name, shape in layer_shapes(cfg).items():
            is_norm = name.endswith("norm")
            if name.endswith("bias"):
                setattr(self, name, nnx.Param(jnp.zeros((L, *shape), dtype)))
            else:
                setattr(self, name, init((L, *shape), is_norm))
        self.final_norm = init((D,), True)
        self.lm_head = None if cfg.tie_word_embeddings else init((V, D))
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.inv_freq(), jnp.float32))

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for `batch` rows of `capacity` positions."""
        c = self.cfg
        return KVCache.init(c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, self.dtype)

    def layer_weights(self) -> dict:
        """Per-layer weights: name -> stacked array [L, ...], or a tuple of L arrays once
        unstacked (see `unstack_layers`)."""
        return {name: getattr(self, name).get_value() for name in layer_shapes(self.cfg)}

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None,
        *,
        capture: tuple[int, ...] = (),
        logits_at: jax.Array | None = None,
        capture_kv: tuple[int, ...] = (),
        attention: Callable | None = None,
        self_attention: Callable | None = None,
    ) -> ForwardOutput:
        """Runs T new tokens per row through the decoder, writing their K/V into `cache`.

        Args:
          tokens: i32[B,T] token ids.
          positions: i32[B,T] absolute positions; K/V of token t of row b go to slot
            positions[b,t]. Each row's positions must be contiguous and start at or
            before its first uncached position. Positions >= S are dropped.
          cache: KVCache with k, v [L,B,K,S,H]; or None for a cache-free causal forward
            over the T tokens alone (training: no scatter, scores [T,T] instead of [T,S]).
          capture: depths d in 0..L whose residual stream (the input of layer d; d = L is
            the last layer's output before the final norm) is returned, in this order.
          logits_at: optional i32[B,T'] indices into T; logits only at those tokens.
          capture_kv: layers l in 0..L-1 whose keys and values are returned (cache-free
            forward only: with a cache, read them from the cache). Training of KV-reuse
            drafters uses them.
          attention: how the queries attend into the cache (ignored without one). None:
            `specjax.attention.cache_attention`, the chunked jnp path (any T: prefill,
            decode, verify). Or fn(q [B,T,N,H], k_cache, v_cache [L,B,K,S,H], layer,
            lengths i32[B], k_new, v_new [B,T,K,H]) -> [B,T,N,H], causal attention over
            each row's slots < lengths plus the T new tokens, with the layer read in
            place, such as `pallas_kernels.attention.decode_attention(mode="causal",
            layer=...)` (`specjax.generate.LoopConfig.target_attention` builds it). It
            gets lengths = positions[:, 0] (the slots before a row's first new token)
            and the new tokens' K/V separately; they are also written into the cache
            (for later forwards) before the call, but at slots >= lengths, which it does
            not read, so no token counts twice. Meant for few queries (decode T = 1,
            verify T = G + 1): its [T*R, H] query block and [T*R, T] new-token scores
            sit in on-chip memory, so the loops keep the prefill on the jnp path.
          self_attention: the cache-free forward's causal attention (ignored with a
            cache). None: jnp scores [B,K,R*T,T]. Or fn(q [B,T,N,H], k, v [B,K,T,H],
            limit i32[B,T]) -> (o [B,T,N,H], lse), where query t sees keys s < limit[b,t],
            such as `pallas_kernels.attention.packed_attention` (flash attention: no
            [T, T] scores in memory). It gets limit = t + 1, which is the causal mask when
            each row's positions are consecutive (as in training).

        Returns:
          ForwardOutput(logits f32[B,T',V], hidden [C,B,T,D] or None, cache with
          lengths = positions[:, -1] + 1, or None without a cache, kv or None).
        """
        c = self.cfg
        B, T = tokens.shape
        N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
        R = N // K
        embed = self.embed[...]
        x = jnp.take(embed, tokens, axis=0).astype(self.dtype)  # [B,T,D]
        cos, sin = rope_cos_sin(self.inv_freq[...], positions, self.dtype)
        if cache is None:  # keys are the T new tokens themselves: a causal mask [B,T,T]
            mask = positions[:, None, :] <= positions[:, :, None]
            k_cache = v_cache = jnp.zeros((), self.dtype)  # unused carry
        else:
            mask = None
            k_cache, v_cache = cache.k, cache.v
        # Row r*T + t of a KV head's folded queries is token t of query head k*R + r.
        mask_q = None if mask is None else jnp.tile(mask, (1, R, 1))  # [B,R*T,T]
        # the attention result comes back folded [B,K,R*T,H] (jnp paths) or [B,T,N,H]
        folded = attention is None if cache is not None else self_attention is None
        causal_limit = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
        q_pos = jnp.tile(positions, (1, R))  # [B,R*T]
        batch_idx = jnp.arange(B)[:, None]
        scale = 1.0 / np.sqrt(H)
        depths = jnp.asarray(capture, jnp.int32) if capture else None
        captured = jnp.zeros((len(capture), B, T, c.hidden_size), x.dtype) if capture else None
        if capture_kv and cache is not None:
            raise ValueError("capture_kv needs a cache-free forward (cache=None)")
        kv_layers = jnp.asarray(capture_kv, jnp.int32) if capture_kv else None
        kv_shape = (len(capture_kv), B, K, T, H)
        kv_out = (jnp.zeros(kv_shape, self.dtype),) * 2 if capture_kv else None

        def layer(carry, w):
            x, k_all, v_all, captured, l, kv_out = carry
            if capture:
                hit = (depths == l)[:, None, None, None]
                captured = jnp.where(hit, x[None], captured)
            h = rms_norm(x, w["input_norm"], c.rms_norm_eps)
            q = linear(h, w["q_proj"])
            k = linear(h, w["k_proj"])
            v = linear(h, w["v_proj"])
            if c.attention_bias:
                q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
            q = q.reshape(B, T, N, H)
            k = k.reshape(B, T, K, H)
            v = v.reshape(B, T, K, H)
            if c.family == "qwen3":
                q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            # GQA as one batched matmul per KV head: query rows (r, t) of head k*R + r.
            qg = q.reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4).reshape(B, K, R * T, H)
            ad = w["q_proj"].dtype  # attention dots in the matmul dtype too
            if cache is None:
                k_l, v_l = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B,K,T,H]
                if capture_kv:
                    hit = (kv_layers == l)[:, None, None, None, None]
                    kv_out = (jnp.where(hit, k_l[None], kv_out[0]),
                              jnp.where(hit, v_l[None], kv_out[1]))
                if self_attention is not None:
                    attn, _ = self_attention(q.astype(ad), k_l.astype(ad), v_l.astype(ad),
                                             causal_limit)
                    attn = attn.astype(v_l.dtype)
                else:
                    scores = jnp.einsum("BKQH,BKSH->BKQS", qg.astype(ad), k_l.astype(ad),
                                        preferred_element_type=jnp.float32) * scale
                    scores = jnp.where(mask_q[:, None], scores, -1e30)
                    probs = jax.nn.softmax(scores, axis=-1)
                    attn = jnp.einsum("BKQS,BKSH->BKQH", probs.astype(ad), v_l.astype(ad),
                                      preferred_element_type=jnp.float32).astype(v_l.dtype)
            else:
                k_all = k_all.at[l, batch_idx, :, positions].set(k, mode="drop")
                v_all = v_all.at[l, batch_idx, :, positions].set(v, mode="drop")
                if attention is not None:  # e.g. the Pallas kernel, in the cache's dtype
                    attn = attention(q.astype(k_all.dtype), k_all, v_all, l, positions[:, 0],
                                     k, v).astype(v_all.dtype)
                else:  # chunks up to the longest row's position: cost follows the context
                    attn = cache_attention(qg, k_all, v_all, q_pos, chunk=self.attention_chunk,
                                           dot_dtype=ad, layer=l).astype(v_all.dtype)
            if folded:  # [B,K,R*T,H] -> [B,T,N*H]
                attn = attn.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)
            attn = attn.reshape(B, T, N * H)
            o = linear(attn, w["o_proj"])
            if c.attention_bias:
                o = o + w["o_bias"]
            x = x + o
            h = rms_norm(x, w["post_norm"], c.rms_norm_eps)
            gate = linear(h, w["gate_proj"])
            up = linear(h, w["up_proj"])
            x = x + linear(jax.nn.silu(gate) * up, w["down_proj"])
            return (x, k_all, v_all, captured, l + 1, kv_out), None

        weights = self.layer_weights()
        carry = (x, k_cache, v_cache, captured, jnp.int32(0), kv_out)
        if isinstance(weights["q_proj"], tuple):
            # Separate per-layer buffers: a Python loop reads each weight in place. (Slicing a
            # stacked weight, under scan or statically, copies it on XLA:CPU: ~2x per token.)
            for i in range(c.num_layers):
                carry = (*carry[:4], i, carry[5])  # a static layer index
                carry, _ = layer(carry, {n: w[i] for n, w in weights.items()})
            x, k_all, v_all, captured, _, kv_out = carry
        else:
            (x, k_all, v_all, captured, _, kv_out), _ = jax.lax.scan(layer, carry, weights)
        if capture:
            captured = jnp.where((depths == c.num_layers)[:, None, None, None], x[None], captured)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        head = embed if self.lm_head is None else self.lm_head[...]
        logits = linear(x, head, jnp.float32)
        new_cache = None if cache is None else KVCache(
            k=k_all, v=v_all, lengths=(positions[:, -1] + 1).astype(jnp.int32))
        return ForwardOutput(logits, captured, new_cache, kv_out)
