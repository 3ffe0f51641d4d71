"""Qwen3 / Llama-3 decoder in Flax NNX with stacked layer weights and a static KV cache.

One code path serves prefill, single-token decoding and multi-token verification:
`Transformer.__call__(tokens[B,T], positions[B,T], cache)`. Layers run under
`lax.scan` over weights stacked on a leading L axis; weights keep HF's `[out, in]`
layout and every projection contracts the last axis (fast on XLA:CPU, docs/design.md 9).

The layer's pieces (RMSNorm, RoPE, q/k/v with Qwen3's q/k norms, SwiGLU MLP) live in
`specjax.models.layers`, shared with the drafters; this module adds the attention (GQA by one
batched matmul per KV head, into the cache or cache-free) and the layer loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.attention import DEFAULT_CHUNK, cache_attention, cache_attention_stats
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.layers import layer_out, layer_qkv, logits, rope_cos_sin

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
      `unstack_layers`: faster per token on XLA:CPU and on GPU, where slicing stacked
      weights inside the loop copies them; compile time grows with L), or "auto" (the
      backend's entry in `specjax.backend_choices`: measured on GPU, unroll; a stated
      reason on TPU, scan; unroll on CPU). `benchmarks/decode_speed.py` and
      `scripts/big_round.sh` (step ar) measure both.
    """
    if layer_loop == "auto":
        from specjax.backend_choices import choice

        layer_loop = choice(jax.default_backend())["layer_loop"]
    if layer_loop == "unroll":
        return unstack_layers(state)
    if layer_loop != "scan":
        raise ValueError(f"layer_loop={layer_loop!r}; expected auto, scan or unroll")
    return state


class LayerCarry(NamedTuple):
    """What one decoder layer hands the next (`Transformer._layer`).

    x: [B,T,D] residual stream (the input of layer `layer`).
    k_cache, v_cache: the KV cache [L,B,K,S,H], updated layer by layer (an unused scalar
      in a cache-free forward).
    captured: [C,B,T,D] residual streams at the `capture` depths so far (None if none).
    layer: the index of the next layer (i32 under `lax.scan`, a Python int unrolled).
    kv_out: (k, v) [Ls,B,K,T,H] of the `capture_kv` layers so far (None if none)."""

    x: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    captured: jax.Array | None
    layer: jax.Array | int
    kv_out: tuple[jax.Array, jax.Array] | None


class _Forward(NamedTuple):
    """The per-call constants every layer of one forward reads: RoPE cos, sin [B,T,H];
    positions i32[B,T]; mask_q bool[B,R*T,T] (the folded causal mask; None with a cache);
    q_pos i32[B,R*T]; causal_limit i32[B,T]; depths / kv_layers (the capture and
    capture_kv layers as i32 arrays, or None); the attention callables; and for a draft
    tree's verify forward tree_mask bool[B,T,T] (None otherwise) and slots i32[B,T], the
    cache slots the new tokens' K/V go to (= positions without a tree); rows: the exact
    mode's tile (`__call__`'s invariant_rows) or None."""

    cos: jax.Array
    sin: jax.Array
    positions: jax.Array
    mask_q: jax.Array | None
    q_pos: jax.Array
    causal_limit: jax.Array
    depths: jax.Array | None
    kv_layers: jax.Array | None
    attention: Callable | None
    self_attention: Callable | None
    tree_mask: jax.Array | None = None
    slots: jax.Array | None = None
    rows: int | None = None


class Transformer(nnx.Module):
    """Decoder-only LM for the Qwen3 and Llama-3 families.

    Args:
      cfg: the model configuration.
      dtype: parameter and activation dtype (f32 on CPU, bf16 on TPU/GPU).
      rngs: initialisation randomness (normal, std 0.02; norms at 1).
      attention_chunk: cache slots per chunk of attention into the KV cache
        (`specjax.models.attention.cache_attention`): decoding reads only the chunks that hold
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

    def rope(self, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B,T,H] of the target's RoPE at i32[B,T] positions, with its scaling's
        attention factor (`ModelConfig.attention_scaling`: YaRN's temperature, else 1)."""
        return rope_cos_sin(self.inv_freq[...], positions, dtype, self.cfg.attention_scaling)

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
        tree_mask: jax.Array | None = None,
        invariant_rows: int | None = None,
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
            `specjax.models.attention.cache_attention`, the chunked jnp path (any T: prefill,
            decode, verify). Or fn(q [B,T,N,H], k_cache, v_cache [L,B,K,S,H], layer,
            lengths i32[B], k_new, v_new [B,T,K,H]) -> [B,T,N,H], causal attention over
            each row's slots < lengths plus the T new tokens, with the layer read in
            place, such as `pallas_kernels.attention.decode_attention(mode="causal",
            layer=...)` (`specjax.decoding.loop.LoopConfig.target_attention` builds it). It
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
            each row's positions increase along the row (as in training, PoSE's
            skip-wise positions included).
          invariant_rows: None, or the exact mode's tile (`specjax.models.invariant`): the
            token rows go through each layer's blocks, the jnp attention and the LM head
            in tiles of this many rows, so that each token's result is the same in a
            one-token and a T-token forward (needs the jnp attention: ValueError with
            `attention` or `tree_mask`; the cache capacity a multiple of
            `invariant.CHUNK`).

        Returns:
          ForwardOutput(logits f32[B,T',V], hidden [C,B,T,D] or None, cache with
          lengths = positions[:, -1] + 1, or None without a cache, kv or None).
        """
        c = self.cfg
        B, T = tokens.shape
        R = c.num_heads // c.num_kv_heads
        if capture_kv and cache is not None:
            raise ValueError("capture_kv needs a cache-free forward (cache=None)")
        if tree_mask is not None and cache is None:
            raise ValueError("tree_mask needs a cache (a draft tree's verify forward)")
        if invariant_rows is not None and (attention is not None or tree_mask is not None):
            raise ValueError("invariant_rows takes the jnp attention of a chain (no "
                             "attention kernel, no tree_mask)")
        embed = self.embed[...]
        x = jnp.take(embed, tokens, axis=0).astype(self.dtype)  # [B,T,D]
        cos, sin = self.rope(positions, self.dtype)
        slots = positions
        if tree_mask is not None:
            slots = positions[:, :1] + jnp.arange(T, dtype=jnp.int32)[None, :]
        if cache is None:  # keys are the T new tokens themselves: a causal mask [B,T,T]
            mask = positions[:, None, :] <= positions[:, :, None]
            k_cache = v_cache = jnp.zeros((), self.dtype)  # unused carry
        else:
            mask = None
            k_cache, v_cache = cache.k, cache.v
        kv_shape = (len(capture_kv), B, c.num_kv_heads, T, c.head_dim)
        f = _Forward(
            cos=cos, sin=sin, positions=positions,
            # Row r*T + t of a KV head's folded queries is token t of query head k*R + r.
            mask_q=None if mask is None else jnp.tile(mask, (1, R, 1)),  # [B,R*T,T]
            q_pos=jnp.tile(positions, (1, R)),  # [B,R*T]
            causal_limit=jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T)),
            depths=jnp.asarray(capture, jnp.int32) if capture else None,
            kv_layers=jnp.asarray(capture_kv, jnp.int32) if capture_kv else None,
            attention=attention, self_attention=self_attention, tree_mask=tree_mask,
            slots=slots, rows=invariant_rows)
        carry = LayerCarry(
            x=x, k_cache=k_cache, v_cache=v_cache,
            captured=(jnp.zeros((len(capture), B, T, c.hidden_size), x.dtype)
                      if capture else None),
            layer=jnp.int32(0),
            kv_out=(jnp.zeros(kv_shape, self.dtype),) * 2 if capture_kv else None)
        carry = self._layers(f, carry)
        x, captured = carry.x, carry.captured
        if capture:
            captured = jnp.where((f.depths == c.num_layers)[:, None, None, None], x[None],
                                 captured)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        head = embed if self.lm_head is None else self.lm_head[...]
        out = logits(x, self.final_norm[...], head, c.rms_norm_eps, rows=invariant_rows)
        new_cache = None if cache is None else KVCache(
            k=carry.k_cache, v=carry.v_cache, lengths=(slots[:, -1] + 1).astype(jnp.int32))
        return ForwardOutput(out, captured, new_cache, carry.kv_out)

    def _layers(self, f: _Forward, carry: LayerCarry) -> LayerCarry:
        """Every decoder layer in turn: a Python loop over per-layer arrays (unstacked
        weights) or a `lax.scan` over the stacked ones."""
        weights = self.layer_weights()
        if isinstance(weights["q_proj"], tuple):
            # Separate per-layer buffers: a Python loop reads each weight in place. (Slicing a
            # stacked weight, under scan or statically, copies it on XLA:CPU: ~2x per token.)
            for i in range(self.cfg.num_layers):
                carry = carry._replace(layer=i)  # a static layer index
                carry = self._layer(f, carry, {n: w[i] for n, w in weights.items()})
            return carry
        carry, _ = jax.lax.scan(lambda cr, w: (self._layer(f, cr, w), None), carry, weights)
        return carry

    def _layer(self, f: _Forward, carry: LayerCarry, w: dict) -> LayerCarry:
        """One decoder layer (weights w, see `specjax.models.layers`) on carry.x [B,T,D]: writes
        its K/V into the cache (or captures them, cache-free) and records carry.x as the
        input of depth carry.layer when captured."""
        c = self.cfg
        B, T, _ = carry.x.shape
        N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
        R = N // K
        captured = carry.captured
        if f.depths is not None:
            hit = (f.depths == carry.layer)[:, None, None, None]
            captured = jnp.where(hit, carry.x[None], captured)
        q, k, v = layer_qkv(w, carry.x, f.cos, f.sin, c.rms_norm_eps, N, K, H, rows=f.rows)
        # GQA as one batched matmul per KV head: query rows (r, t) of head k*R + r.
        qg = q.reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4).reshape(B, K, R * T, H)
        ad = w["q_proj"].dtype  # attention dots in the matmul dtype too
        k_all, v_all, kv_out = carry.k_cache, carry.v_cache, carry.kv_out
        if f.mask_q is not None:
            attn, kv_out = self._self_attention(f, carry, q, qg, k, v, ad)
            folded = f.self_attention is None
        else:
            attn, k_all, v_all = self._cache_attention(f, carry, q, qg, k, v, ad)
            folded = f.attention is None
        # the attention result comes back folded [B,K,R*T,H] (jnp paths) or [B,T,N,H]
        if folded:  # [B,K,R*T,H] -> [B,T,N*H]
            attn = attn.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)
        attn = attn.reshape(B, T, N * H)
        x = layer_out(w, carry.x, attn, c.rms_norm_eps, rows=f.rows)
        return LayerCarry(x, k_all, v_all, captured, carry.layer + 1, kv_out)

    @staticmethod
    def _self_attention(f: _Forward, carry: LayerCarry, q, qg, k, v, ad):
        """Cache-free causal attention over the T new tokens: (attn, kv_out), attn folded
        [B,K,R*T,H] on the jnp path or [B,T,N,H] from `f.self_attention`."""
        H = q.shape[-1]
        k_l, v_l = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B,K,T,H]
        kv_out = carry.kv_out
        if f.kv_layers is not None:
            hit = (f.kv_layers == carry.layer)[:, None, None, None, None]
            kv_out = (jnp.where(hit, k_l[None], kv_out[0]),
                      jnp.where(hit, v_l[None], kv_out[1]))
        if f.self_attention is not None:
            attn, _ = f.self_attention(q.astype(ad), k_l.astype(ad), v_l.astype(ad),
                                       f.causal_limit)
            return attn.astype(v_l.dtype), kv_out
        scale = 1.0 / np.sqrt(H)
        scores = jnp.einsum("BKQH,BKSH->BKQS", qg.astype(ad), k_l.astype(ad),
                            preferred_element_type=jnp.float32) * scale
        scores = jnp.where(f.mask_q[:, None], scores, -1e30)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("BKQS,BKSH->BKQH", probs.astype(ad), v_l.astype(ad),
                          preferred_element_type=jnp.float32).astype(v_l.dtype)
        return attn, kv_out

    def _cache_attention(self, f: _Forward, carry: LayerCarry, q, qg, k, v, ad):
        """Writes layer carry.layer's new K/V into the cache, then attends into it:
        (attn, k_cache, v_cache), attn folded [B,K,R*T,H] on the jnp path or [B,T,N,H]
        from `f.attention`."""
        l, slots = carry.layer, f.slots
        batch_idx = jnp.arange(slots.shape[0])[:, None]
        k_all = carry.k_cache.at[l, batch_idx, :, slots].set(k, mode="drop")
        v_all = carry.v_cache.at[l, batch_idx, :, slots].set(v, mode="drop")
        if f.tree_mask is not None:
            return self._tree_attention(f, l, q, qg, k, v, k_all, v_all, ad)
        if f.attention is not None:  # e.g. the Pallas kernel, in the cache's dtype
            attn = f.attention(q.astype(k_all.dtype), k_all, v_all, l, slots[:, 0],
                               k, v).astype(v_all.dtype)
        else:  # chunks up to the longest row's position: cost follows the context
            attn = cache_attention(qg, k_all, v_all, f.q_pos, chunk=self.attention_chunk,
                                   dot_dtype=ad, layer=l, rows=f.rows).astype(v_all.dtype)
        return attn, k_all, v_all

    def _tree_attention(self, f: _Forward, l, q, qg, k, v, k_all, v_all, ad):
        """A draft tree's attention (see `__call__`'s tree_mask): the committed prefix
        (slots < positions[:, 0]) and the node's ancestors among the T new tokens, under one
        softmax. -> (attn, k_cache, v_cache) as `_cache_attention`."""
        base = f.slots[:, 0]
        if f.attention is not None:
            attn = f.attention(q.astype(k_all.dtype), k_all, v_all, l, base, k, v,
                               tree_mask=f.tree_mask).astype(v_all.dtype)
            return attn, k_all, v_all
        B, K, RT, H = qg.shape
        R = RT // f.tree_mask.shape[1]
        # prefix statistics: every query sees slots <= base - 1 (base >= 1 in the loop)
        prefix_pos = jnp.broadcast_to((base - 1)[:, None], (B, RT))
        m, s, acc = cache_attention_stats(qg, k_all, v_all, prefix_pos,
                                          chunk=self.attention_chunk, dot_dtype=ad, layer=l)
        k_new, v_new = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B,K,T,H]
        scores = jnp.einsum("BKQH,BKSH->BKQS", qg.astype(ad), k_new.astype(ad),
                            preferred_element_type=jnp.float32) * np.float32(1 / np.sqrt(H))
        mask = jnp.tile(f.tree_mask, (1, R, 1))[:, None]  # [B,1,R*T,T]
        scores = jnp.where(mask, scores, -jnp.inf)
        m_all = jnp.maximum(m, jnp.max(scores, axis=-1))
        e = jnp.exp(scores - m_all[..., None])
        scale = jnp.exp(m - m_all)
        denom = s * scale + jnp.sum(e, axis=-1)
        num = acc * scale[..., None] + jnp.einsum(
            "BKQS,BKSH->BKQH", e.astype(ad), v_new.astype(ad),
            preferred_element_type=jnp.float32)
        return (num / denom[..., None]).astype(v_all.dtype), k_all, v_all
