"""Building blocks shared by the learned drafters (eagle3, kv, hybrid, block).

- `layer_weights` / `layer`: the stacked per-layer weights of Ld decoder layers (HF
  [out, in] layout, the same names as the target's, so the mesh rules shard them alike);
- `qkv` / `attend` / `mlp`: one decoder layer's pieces, where attention takes several
  key/value sources at once (a memory, a causal self block, a "diagonal" of
  training-time-test steps) under one softmax;
- `merge_kv`: KVShot's learned merge of the target's K/V at Ls layers into one memory
  (de-rotate, linear map over layers, re-rotate), and `gather_positions` to read the
  newly verified positions of the target cache in place;
- `memory_from_target` / `memory_update`: the merged memory of the committed positions,
  built at prefill and extended after each verification;
- `LearnedDrafter` and `hot_to_target`: the loop adapter the learned drafters share, and
  the map from a hot draft vocabulary back to the target's ids.

Shapes follow docs/design.md section 2; keys and values are [B,K,S,H] like one layer of the
target cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.attention import DEFAULT_CHUNK, cache_attention_stats
from specjax.drafters.config import DrafterConfig
from specjax.kv_cache import KVCache
from specjax.model import apply_rope, linear, rms_norm, rope_cos_sin
from specjax.sampling import SamplingParams

NEG = -1e30


def normal(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype))


def ones(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


def layer_weights(cfg: DrafterConfig, rngs: nnx.Rngs, dtype, num_layers: int,
                  in_dim: int | None = None, input_norm: bool = True) -> dict[str, nnx.Param]:
    """Stacked weights of `num_layers` decoder layers whose q/k/v read `in_dim` features
    (default D; eagle3 reads 2D): input_norm [Ld,D] (unless input_norm=False),
    q_proj [Ld,N*H,in], k_proj/v_proj [Ld,K*H,in], q_norm/k_norm [Ld,H] (unless
    cfg.qk_norm is False),
    o_proj [Ld,D,N*H], post_norm [Ld,D], gate_proj/up_proj [Ld,F,D], down_proj [Ld,D,F]."""
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    Ld, In = num_layers, in_dim or D
    norm = dict(input_norm=ones((Ld, D), dtype)) if input_norm else {}
    qk = dict(q_norm=ones((Ld, H), dtype), k_norm=ones((Ld, H), dtype)) if cfg.qk_norm else {}
    return dict(**norm,
        q_proj=normal(rngs, (Ld, N * H, In), dtype), k_proj=normal(rngs, (Ld, K * H, In), dtype),
        v_proj=normal(rngs, (Ld, K * H, In), dtype), **qk, o_proj=normal(rngs, (Ld, D, N * H), dtype),
        post_norm=ones((Ld, D), dtype), gate_proj=normal(rngs, (Ld, F, D), dtype),
        up_proj=normal(rngs, (Ld, F, D), dtype), down_proj=normal(rngs, (Ld, D, F), dtype))


LAYER_KEYS = ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj", "post_norm",
              "gate_proj", "up_proj", "down_proj")


def layer(module: nnx.Module, i: int) -> dict[str, jax.Array]:
    """Layer i's weights (static index) of a module holding `layer_weights` attributes."""
    return {k: getattr(module, k)[i] for k in LAYER_KEYS if hasattr(module, k)}


def rope(inv_freq, positions, dtype):
    """cos, sin [B,T,H] for i32[B,T] positions."""
    return rope_cos_sin(inv_freq, positions, dtype)


def qkv(w, x, cos, sin, eps, cfg: DrafterConfig):
    """Projections of x [B,T,in] -> q [B,T,N,H], k, v [B,T,K,H] (q/k RMSNorm when the
    layer has q_norm/k_norm, then RoPE)."""
    B, T, _ = x.shape
    q = linear(x, w["q_proj"]).reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = linear(x, w["k_proj"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, w["v_proj"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if "q_norm" in w:
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def kv_only(w, x, cos, sin, eps, cfg: DrafterConfig):
    """k, v [B,K,T,H] of x [B,T,in] (cache layout): the context projections of DFlash."""
    B, T, _ = x.shape
    k = linear(x, w["k_proj"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, w["v_proj"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if "k_norm" in w:
        k = rms_norm(k, w["k_norm"], eps)
    k = apply_rope(k, cos, sin)
    return k.swapaxes(1, 2), v.swapaxes(1, 2)


class Limit(NamedTuple):
    """A source mask given by position: slot s is visible to query t of row b iff
    s <= pos[b, t] (pos i32[B,T]). Long sources given this way are read in chunks up to
    the largest visible slot (`specjax.attention`), so their cost follows the context;
    inside `attention_kernel` they go through the kernel instead."""

    pos: jax.Array


class Blocks(NamedTuple):
    """A source of the queries' own keys (k, v [B,T,K,H], like a `diag` entry) packed in
    aligned blocks of `size` entries: query t sees entry u iff t // size == u // size
    (bidirectional inside a block, nothing across blocks; T a multiple of size). The
    block-wise objective's packed blocks: it costs T * size scores, not T * T."""

    size: int


ATTEND_CHUNK = DEFAULT_CHUNK  # sources with S > this and a Limit mask are chunked

_KERNEL: contextvars.ContextVar = contextvars.ContextVar("specjax_attend_kernel",
                                                         default=None)


@contextlib.contextmanager
def attention_kernel(fn):
    """While tracing inside this context, `attend` computes every `Limit` source with
    fn(q [B,T,N,H], k [B,K,S,H], v [B,K,S,H], limit i32[B,T]) -> (o [B,T,N,H], lse
    f32[B,T,N]), where query t sees slots s < limit[b, t] and lse is the log-sum-exp of
    its scores (-inf when it sees nothing), such as
    `pallas_kernels.attention.packed_attention`; the other sources are merged with it by
    log-sum-exp. fn = None: the jnp path. The choice is made at trace time, so enter the
    context inside the function that jax traces, with fn fixed by that function's own
    static configuration (`specjax.generate.LoopConfig.drafter_attention`, the trainers'
    `kernels`): a jit cache entry then never mixes the two paths."""
    token = _KERNEL.set(fn)
    try:
        yield
    finally:
        _KERNEL.reset(token)


def attend(q, sources: Sequence[tuple], diag: Sequence[tuple] = ()):
    """Attention of q [B,T,N,H] over several key/value sources under ONE softmax.

    Args:
      sources: (k, v, mask) each. k, v [B,K,S,H] (any S per source) with mask a
        bool[B,T,S] or a `Limit` (slots <= pos[b, t] visible; a Limit source longer than
        ATTEND_CHUNK slots is read in chunks up to its largest visible slot, and inside
        `attention_kernel` every Limit source goes through the kernel); or the queries'
        own k, v [B,T,K,H] with mask a `Blocks` (aligned bidirectional blocks).
      diag: (k [B,T,K,H], v [B,T,K,H]) each: query t sees only entry t of each (the
        training-time-test diagonal: later steps at the same position).
    Returns: [B,T,N*H] in q's dtype. Scores and softmax in f32. A query with no visible
      key at all returns zeros (or, on the one-softmax path, the mean of the values it
      masked); callers never use it.
    """
    B, T, N, H = q.shape
    K = (sources[0][0].shape[1] if sources else diag[0][0].shape[2])
    if sources and isinstance(sources[0][2], Blocks):
        K = sources[0][0].shape[2]
    R = N // K
    scale = 1.0 / np.sqrt(H)
    qg = q.reshape(B, T, K, R, H)
    kernel = _KERNEL.get()
    scores, values, parts, kernel_parts = [], [], [], 0
    for k, v, mask in sources:
        if isinstance(mask, Blocks):
            parts.append(_blocks_part(qg, k, v, mask.size, scale))
            continue
        if isinstance(mask, Limit):
            if kernel is not None:
                o, lse = kernel(q, k, v, jnp.maximum(mask.pos + 1, 0).astype(jnp.int32))
                lse = lse.reshape(B, T, K, R).transpose(0, 2, 3, 1)  # [B,K,R,T]
                parts.append((lse, jnp.where(jnp.isfinite(lse), 1.0, 0.0),
                              o.astype(jnp.float32).reshape(B, T, K, R, H)))
                kernel_parts += 1
                continue
            if k.shape[2] > ATTEND_CHUNK:
                qf = qg.transpose(0, 2, 3, 1, 4).reshape(B, K, R * T, H)  # row r*T + t
                m, l, acc = cache_attention_stats(qf, k, v, jnp.tile(mask.pos, (1, R)),
                                                  chunk=ATTEND_CHUNK, dot_dtype=q.dtype)
                parts.append((m.reshape(B, K, R, T), l.reshape(B, K, R, T),
                              acc.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)))
                continue
            mask = jnp.arange(k.shape[2])[None, None, :] <= mask.pos[:, :, None]
        s = jnp.einsum("BTKRH,BKSH->BKRTS", qg, k, preferred_element_type=jnp.float32) * scale
        scores.append(jnp.where(mask[:, None, None], s, NEG))
        values.append(("full", v))
    for k, v in diag:
        s = jnp.einsum("BTKRH,BTKH->BKRT", qg, k, preferred_element_type=jnp.float32) * scale
        scores.append(s[..., None])
        values.append(("diag", v))
    if not parts:
        probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
        return _weighted(probs, scores, values, q.dtype).reshape(B, T, N * H)
    if len(parts) == 1 and not scores and kernel_parts == 1:
        return parts[0][2].astype(q.dtype).reshape(B, T, N * H)  # normalised already
    # Merge the parts and the short sources under one softmax: each contributes
    # (max m, sum exp(s - m), sum exp(s - m) v); rescale all to the joint max.
    if scores:
        cat = jnp.concatenate(scores, axis=-1)
        m = jnp.max(cat, axis=-1)
        p = jnp.exp(cat - m[..., None])
        parts.append((m, jnp.sum(p, axis=-1),
                      _weighted(p, scores, values, jnp.float32)))
    top = parts[0][0]
    for m, _, _ in parts[1:]:
        top = jnp.maximum(top, m)
    # only for range: the result does not depend on it (nor, then, does its gradient)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    num, den = 0.0, 0.0
    for m, l, acc in parts:
        w = jnp.exp(m - top)  # [B,K,R,T]; m = -inf (nothing seen): 0
        num = num + acc * w.transpose(0, 3, 1, 2)[..., None]
        den = den + l * w
    den = jnp.where(den > 0, den, 1.0)  # nothing visible at all: zeros, not NaN
    out = num / den.transpose(0, 3, 1, 2)[..., None]
    return out.astype(q.dtype).reshape(B, T, N * H)


def _blocks_part(qg, k, v, size: int, scale):
    """(m, l, acc) of queries qg [B,T,K,R,H] over their own k, v [B,T,K,H] in aligned
    blocks of `size` (see `Blocks`): m, l f32[B,K,R,T], acc f32[B,T,K,R,H]."""
    B, T, K, R, H = qg.shape
    if T % size:
        raise ValueError(f"Blocks({size}): T={T} must be a multiple of the block size")
    A = T // size
    qb = qg.reshape(B, A, size, K, R, H)
    s = jnp.einsum("BATKRH,BAUKH->BKRATU", qb, k.reshape(B, A, size, K, H),
                   preferred_element_type=jnp.float32) * scale
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    acc = jnp.einsum("BKRATU,BAUKH->BATKRH", p, v.reshape(B, A, size, K, H).astype(jnp.float32))
    return (m.reshape(B, K, R, T), jnp.sum(p, axis=-1).reshape(B, K, R, T),
            acc.reshape(B, T, K, R, H))


def _weighted(probs, scores, values, dtype):
    """sum over sources of probs [B,K,R,T,S_total] (split by each source's width) times
    its values -> [B,T,K,R,H]."""
    out, start = 0.0, 0
    for (how, v), s in zip(values, scores, strict=True):
        width = s.shape[-1]
        p = probs[..., start:start + width].astype(dtype)
        start += width
        if how == "full":
            out = out + jnp.einsum("BKRTS,BKSH->BTKRH", p, v)
        else:
            out = out + p[..., 0].transpose(0, 3, 1, 2)[..., None] * v[:, :, :, None, :]
    return out


def mlp(w, x, eps):
    """x + SwiGLU(post_norm(x)) for x [B,T,D]."""
    h = rms_norm(x, w["post_norm"], eps)
    gate, up = linear(h, w["gate_proj"]), linear(h, w["up_proj"])
    return x + linear(jax.nn.silu(gate) * up, w["down_proj"])


def logits(x, final_norm, head, eps):
    """f32[...,V] = head(final_norm(x)) with the target's LM head [V,D]."""
    x = rms_norm(x, final_norm, eps)
    return linear(x, head, jnp.float32)


# ----------------------------------------------------------------------------- KV merge

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
    half = H // 2

    def rot(x, s):
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cs + rotated * s

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


# ----------------------------------------------------------------------------- adapters

@dataclasses.dataclass(frozen=True)
class LearnedDrafter:
    """What the loop adapters of the learned drafters share (eagle3/hybrid, kv, block):
    graphdef = `nnx.split(net)[0]` (static); params = {"net": its state, "embed": [V,D],
    "head": [V,D], "inv_freq": f32[H/2]} (the target's arrays, not copied)."""

    graphdef: nnx.GraphDef
    cfg: DrafterConfig
    gamma: int
    sampling: SamplingParams = SamplingParams()
    # Early stop of sequential drafting (eagle3/hybrid): once every row's chain
    # confidence (the product of its drafts' top-1 draft probabilities) is below this,
    # the remaining draft positions get a filler token with a one-hot q (0: draft all G).
    stop_below: float = 0.0

    @property
    def capture(self) -> tuple[int, ...]:
        """Target depths whose hidden states the drafter reads (none for KV-only)."""
        return self.cfg.capture if self.cfg.uses_hidden else ()

    def net(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params["net"])

    def logits(self, net, out, params):
        """f32[...,V] draft logits of outputs out [...,D]: params["head"] after the net's
        final norm. With params["draft_ids"] (i32[Vd], an own LM head [Vd,D] over a hot
        draft vocabulary, EAGLE-3's d2t) the Vd logits land at those target ids and
        every other id gets -inf, so q is zero outside the hot set (as vLLM's
        `Eagle3LlamaForCausalLM.compute_logits`)."""
        lg = net.logits(out, params["head"])
        if "draft_ids" not in params:
            return lg
        return hot_to_target(lg, params["draft_ids"], self.cfg.vocab_size)

    def empty_cache(self, num_layers: int, view, dtype) -> KVCache:
        """A drafter-side cache [num_layers,B,K,S,H] as wide as the target's."""
        c = self.cfg
        return KVCache.init(num_layers, view.lengths.shape[0], view.target_cache.capacity,
                            c.num_kv_heads, c.head_dim, dtype)


def hot_to_target(logits, draft_ids, vocab_size: int):
    """f32[...,Vd] logits over a hot draft vocabulary -> f32[...,V]: entry j goes to
    target id draft_ids[j] (i32[Vd], distinct), -inf elsewhere."""
    full = jnp.full((*logits.shape[:-1], vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., draft_ids].set(logits.astype(jnp.float32))


# ----------------------------------------------------------------------------- layers

def layer_qkv(module, i: int, x, cos, sin):
    """Layer i of a module with `layer_weights` (input_norm included): q [B,T,N,H],
    k, v [B,T,K,H] of x [B,T,D]."""
    w = layer(module, i)
    eps = module.cfg.rms_norm_eps
    return qkv(w, rms_norm(x, w["input_norm"], eps), cos, sin, eps, module.cfg)


def layer_out(module, i: int, x, attn):
    """Layer i's output: x + o_proj(attn [B,T,N*H]), then the MLP -> [B,T,D]."""
    w = layer(module, i)
    x = x + linear(attn, w["o_proj"])
    return mlp(w, x, module.cfg.rms_norm_eps)


def memory_update(module, cfg: DrafterConfig, memory, target_cache, positions, inv_freq):
    """Merged memories extended at `positions` [B,T] (contiguous per row) with the target
    cache's K/V there, read in place: memory KVCache [Lm,B,K,S,H] -> the same."""
    T = positions.shape[1]
    k_new = gather_positions(target_cache.k, positions[:, 0], T)
    v_new = gather_positions(target_cache.v, positions[:, 0], T)
    idx = jnp.asarray(cfg.kv_layers)
    cos, sin = rope(inv_freq, positions, module.dtype)
    mk, mv = memory_from_target(module, cfg, k_new[idx], v_new[idx], cos, sin)
    return memory.replace(k=scatter_positions(memory.k, mk, positions[:, 0]),
                          v=scatter_positions(memory.v, mv, positions[:, 0]))


def ttt_memory(module, cfg: DrafterConfig, kv, inv_freq):
    """Training (TTT): the merged memories of every position 0..T-1 from the target K/V
    kv = (k, v) [Ls,B,K,T,H] at `cfg.kv_layers`: (k, v) each [Lm,B,K,T,H]."""
    B, T = kv[0].shape[1], kv[0].shape[3]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = rope(inv_freq, pos, module.dtype)
    return memory_from_target(module, cfg, kv[0], kv[1], cos, sin)
