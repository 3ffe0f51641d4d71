"""SpecPV partial verification (`--partial-verify`): LOSSY, opt-in, long contexts.

At long context the target's verify forward is dominated by attention over the whole KV
cache. SpecPV ("Improving Self-Speculative Decoding for Long-Context Generation via
Partial Verification", arXiv 2512.02337; code TanZhendong/SpecPV) verifies most steps
against a small part of the cache and refreshes it with a periodic full verification.
The partial cache of one layer, per row and KV head, is (`specpv/kv/kv_cache.py`):

- sink: the first `sink_blocks` blocks of `block` slots (2 x 16);
- retrieval: the `retrieval_blocks` blocks (of those below the window, sink excluded)
  that score highest against the queries of the last full verification;
- window: the last `window` slots that the last full verification left exact (128);
- buffer: the tokens accepted since then (at most `buffer`, 20), whose K/V were computed
  under partial attention, and the current draft's own tokens.

The block score is the paper code's `refresh_retrieval`: every block keeps the
per-channel max and min of its keys; a query scores a block by max(q . k_max, q . k_min);
the score is averaged over the pass's queries and over the query heads of a KV head's
GQA group; the top blocks are chosen per KV head and kept in position order.

How a step is verified (`choose_mode`, `verify_forward`), for the whole batch at once:

- plain: some active row is shorter than `threshold(G)`: the ordinary verify forward;
- full: the buffer would overflow (a row accepted more than `buffer` tokens since the
  last full verification), or no selection exists yet: the last `buffer` committed
  tokens are fed again with the pending token and the drafts, through full attention,
  so their K/V become exact; their logits are dropped (tokens already emitted are never
  re-judged, as in the paper's code); the same pass's queries re-select the blocks;
- partial: every other step: the target attends only to the partial cache above.

Partial and full verification give the same logits when the retrieval covers every
block (a test), so the mode is exact in that degenerate setting. Otherwise the output
can differ from the target's: the verify rule is unchanged, but it judges the drafts
against logits computed from part of the context. Where this file departs from the
paper's code: the partial cache is not a separate buffer but a gather from the full
cache by block ids (the window and buffer are one contiguous run of slots), the
selection uses every query of the full pass (re-fed tokens, pending token and drafts,
where the paper's uses the re-fed tokens and the tree), and all rows switch together.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding.loop.extension import LoopExtension
from specjax.models.layers import layer_qkv

PLAIN, FULL, PARTIAL = 0, 1, 2
_NO_SELECTION = -(2 ** 30)  # win_lo before the first full verification


@dataclasses.dataclass(frozen=True)
class PartialVerify(LoopExtension):
    """Static settings of partial verification (defaults: TanZhendong/SpecPV
    `specpv/speculate/configs.py`, except the budget), and the loop extension that runs it
    (`LoopConfig.partial`; `specjax.decoding.loop.extension`): it replaces a chain step's
    verify forward (`verify_forward`) and reports {"verified": i32[2] the steps verified
    in full and partially}. LOSSY.

    budget: tokens of partial cache per row and KV head: sink + retrieval + window.
    block: slots per retrieval block (16). sink_blocks: leading blocks always kept (2).
    window: the most recent exact slots always kept (128).
    buffer: tokens accepted under partial verification before a full one (20).
    threshold: the context (tokens) from which partial verification may run; None:
      the budget plus the buffer. Never below `min_threshold(G)`.
    Raises ValueError when the budget leaves no retrieval block or a size is < 1."""

    budget: int = 4096
    block: int = 16
    sink_blocks: int = 2
    window: int = 128
    buffer: int = 20
    threshold: int | None = None
    name = "partial"
    lossy = True  # the output may differ from the target's
    replaces_forward = True

    def __post_init__(self):
        for name in ("budget", "block", "window", "buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"partial verification: {name}={getattr(self, name)} "
                                 "must be >= 1")
        if self.sink_blocks < 0:
            raise ValueError(f"partial verification: sink_blocks={self.sink_blocks} < 0")
        if self.retrieval_blocks < 1:
            raise ValueError(
                f"partial budget {self.budget} leaves no retrieval block: it must exceed "
                f"sink {self.sink_blocks * self.block} + window {self.window} by at least "
                f"one block of {self.block}")

    def check(self, cfg, drafter, tree_mode: bool) -> None:
        if tree_mode or cfg.num_drafts > 1 or cfg.schedule is not None:
            raise ValueError("partial verification verifies one chain of a fixed draft "
                             "length: num_drafts must be 1 and schedule None")

    def init(self, model, cfg, drafter, state, inputs):
        c = model.cfg
        return init_state(self, c.num_layers, state.tokens.shape[0], c.num_kv_heads)

    def report(self, ext_state) -> dict:
        return {"verified": jnp.stack([ext_state.full, ext_state.partial])}

    def verify_forward(self, model, ext_state, s, chain, positions, capture, attention):
        return verify_forward(model, self, ext_state, s.tokens, s.lengths, s.cache, chain,
                              ~s.done, capture, attention)

    @property
    def retrieval_blocks(self) -> int:
        return (self.budget - self.sink_blocks * self.block - self.window) // self.block

    @property
    def tail(self) -> int:
        """Slots of the contiguous run read from the window's start, which is rounded down
        to a block boundary (so no slot falls between the blocks and the run): window +
        block - 1 + buffer."""
        return self.window + self.block - 1 + self.buffer

    def min_threshold(self, gamma: int) -> int:
        """The shortest context at which the layout is well formed: the re-fed tokens and
        the window lie after the sink blocks."""
        return (self.sink_blocks + 1) * self.block + self.window + self.buffer + gamma + 1

    def threshold_for(self, gamma: int) -> int:
        want = self.budget + self.buffer if self.threshold is None else self.threshold
        return max(want, self.min_threshold(gamma))


@struct.dataclass
class PartialState:
    """sel i32[L,B,K,R_b]: the retrieval block ids per layer, row and KV head, in
    position order (-1: none); verified i32[B]: the pending token's slot at the last full
    verification (the slots below it hold exact K/V); win_lo i32[B]: the window's first
    slot, verified - window rounded down to a block boundary; full, partial i32[]: steps
    verified each way (plain steps are neither)."""

    sel: jax.Array
    verified: jax.Array
    win_lo: jax.Array
    full: jax.Array
    partial: jax.Array


def init_state(cfg: PartialVerify, num_layers: int, batch: int, num_kv_heads: int):
    return PartialState(
        sel=jnp.full((num_layers, batch, num_kv_heads, cfg.retrieval_blocks), -1, jnp.int32),
        verified=jnp.full((batch,), _NO_SELECTION, jnp.int32),
        win_lo=jnp.full((batch,), _NO_SELECTION, jnp.int32),
        full=jnp.zeros((), jnp.int32), partial=jnp.zeros((), jnp.int32))


def choose_mode(cfg: PartialVerify, state: PartialState, base, active, gamma: int):
    """i32[]: PLAIN, FULL or PARTIAL for a step whose pending tokens sit at slots base
    i32[B] (rows with active bool[B] False are ignored; none active: PLAIN).

    PLAIN while an active row is shorter than `threshold_for(gamma)`; else PARTIAL when
    every active row has accepted at most `buffer` tokens since the last full
    verification (base - verified <= buffer), FULL otherwise (the buffer would
    overflow, or there is no selection yet)."""
    long_enough = jnp.all(~active | (base >= cfg.threshold_for(gamma))) & jnp.any(active)
    fits = jnp.all(~active | (base - state.verified <= cfg.buffer))
    return jnp.where(long_enough, jnp.where(fits, PARTIAL, FULL), PLAIN).astype(jnp.int32)


# ----------------------------------------------------------------------------- selection

def block_summaries(k, block: int):
    """Per-channel key max and min of every whole block: k [B,K,S,H] ->
    (k_max, k_min) [B,K,S // block,H] (a partial last block is dropped)."""
    B, K, S, H = k.shape
    n = S // block
    kb = k[:, :, :n * block].reshape(B, K, n, block, H).astype(jnp.float32)
    return kb.max(axis=3), kb.min(axis=3)


def select_blocks(cfg: PartialVerify, q, k, win_lo):
    """The retrieval blocks of one layer: q [B,Q,N,H] (this pass's queries, RoPE applied),
    k [B,K,S,H] (the layer's cache), win_lo i32[B] (the window's first slot) ->
    i32[B,K,R_b] block ids in position order, -1 where fewer candidates exist.

    Candidates: blocks j with sink_blocks <= j and (j + 1) * block <= win_lo. Score:
    max(q . k_max_j, q . k_min_j) per query and query head, averaged over the Q queries,
    then over the R query heads of each KV head (SpecPV `refresh_retrieval`)."""
    B, Q, N, H = q.shape
    K = k.shape[1]
    k_max, k_min = block_summaries(k, cfg.block)  # [B,K,n,H]
    n = k_max.shape[2]
    qg = q.astype(jnp.float32).reshape(B, Q, K, N // K, H)
    s = jnp.maximum(jnp.einsum("bqkrh,bknh->bkrqn", qg, k_max),
                    jnp.einsum("bqkrh,bknh->bkrqn", qg, k_min))
    score = s.mean(axis=3).mean(axis=2)  # [B,K,n]
    j = jnp.arange(n, dtype=jnp.int32)
    ok = (j[None, :] >= cfg.sink_blocks) & ((j[None, :] + 1) * cfg.block <= win_lo[:, None])
    score = jnp.where(ok[:, None, :], score, -jnp.inf)
    top = min(cfg.retrieval_blocks, n)
    vals, ids = jax.lax.top_k(score, top)
    ids = jnp.where(jnp.isfinite(vals), ids, n + 1)  # invalid picks sort last
    ids = jnp.sort(ids, axis=-1)
    ids = jnp.where(ids > n, -1, ids).astype(jnp.int32)
    if top < cfg.retrieval_blocks:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, cfg.retrieval_blocks - top)),
                      constant_values=-1)
    return ids


def reselect(model, cfg: PartialVerify, hidden, positions, cache, win_lo):
    """New selections for every layer after a full verification: hidden [L,B,Q,D], the
    input of each layer for the pass's Q tokens at positions i32[B,Q]; cache k
    [L,B,K,S,H] as the pass left it -> i32[L,B,K,R_b]."""
    c = model.cfg
    weights = model.layer_weights()
    cos, sin = model.rope(positions, hidden.dtype)
    out = []
    for i in range(c.num_layers):
        w = {name: arr[i] for name, arr in weights.items()}
        q, _, _ = layer_qkv(w, hidden[i], cos, sin, c.rms_norm_eps, c.num_heads,
                            c.num_kv_heads, c.head_dim)
        out.append(select_blocks(cfg, q, cache.k[i], win_lo))
    return jnp.stack(out)


# ----------------------------------------------------------------------------- attention

def partial_attention(cfg: PartialVerify, state: PartialState):
    """The target's `attention=` callable (`specjax.models.model.Transformer.__call__`)
    for a partial step: fn(q [B,T,N,H], k_cache, v_cache [L,B,K,S,H], layer, lengths
    i32[B], k_new, v_new [B,T,K,H]) -> [B,T,N,H], attention over the sink blocks, the
    selected blocks, the slots [win_lo, lengths) and the T new tokens (causally), under
    one f32 softmax."""
    bs = cfg.block

    def fn(q, k_cache, v_cache, layer, lengths, k_new, v_new):
        B, T, N, H = q.shape
        K, S = k_cache.shape[2], k_cache.shape[3]
        R = N // K
        kl, vl = k_cache[layer], v_cache[layer]  # [B,K,S,H]
        sel = state.sel[layer]  # [B,K,R_b]
        sink = jnp.broadcast_to(jnp.arange(cfg.sink_blocks, dtype=jnp.int32),
                                (B, K, cfg.sink_blocks))
        ids = jnp.concatenate([sink, sel], axis=-1)  # [B,K,nb]
        blk_slots = (jnp.maximum(ids, 0)[..., None] * bs
                     + jnp.arange(bs, dtype=jnp.int32)).reshape(B, K, -1)
        blk_ok = jnp.repeat(ids >= 0, bs, axis=-1)
        run = state.win_lo[:, None] + jnp.arange(cfg.tail, dtype=jnp.int32)  # [B,tail]
        run_ok = (run >= 0) & (run < lengths[:, None])
        slots = jnp.concatenate([blk_slots, jnp.broadcast_to(run[:, None], (B, K, cfg.tail))],
                                axis=-1)
        ok = jnp.concatenate([blk_ok, jnp.broadcast_to(run_ok[:, None], (B, K, cfg.tail))],
                             axis=-1)
        slots = jnp.clip(slots, 0, S - 1)[..., None]  # [B,K,M,1]
        kg = jnp.take_along_axis(kl, slots, axis=2)
        vg = jnp.take_along_axis(vl, slots, axis=2)
        f32 = jnp.float32
        qg = q.reshape(B, T, K, R, H).transpose(0, 2, 3, 1, 4)  # [B,K,R,T,H]
        kn, vn = k_new.swapaxes(1, 2), v_new.swapaxes(1, 2)  # [B,K,T,H]
        scale = np.float32(1 / np.sqrt(H))
        s_old = jnp.einsum("bkrth,bkmh->bkrtm", qg, kg, preferred_element_type=f32) * scale
        s_old = jnp.where(ok[:, :, None, None, :], s_old, -jnp.inf)
        s_new = jnp.einsum("bkrth,bksh->bkrts", qg, kn.astype(qg.dtype),
                           preferred_element_type=f32) * scale
        causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
        s_new = jnp.where(causal, s_new, -jnp.inf)
        p = jax.nn.softmax(jnp.concatenate([s_old, s_new], axis=-1), axis=-1)
        M = s_old.shape[-1]
        o = (jnp.einsum("bkrtm,bkmh->bkrth", p[..., :M], vg.astype(f32))
             + jnp.einsum("bkrts,bksh->bkrth", p[..., M:], vn.astype(f32)))
        return o.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)

    return fn


# ----------------------------------------------------------------------------- the step

def verify_forward(model, cfg: PartialVerify, state: PartialState, tokens, lengths, cache,
                   chain, active, capture: tuple[int, ...], attention):
    """The verify forward of one chain step under partial verification.

    tokens i32[B,S'] (committed tokens; lengths i32[B], the pending token at lengths - 1),
    chain i32[B,G+1] (pending token and G drafts), active bool[B], cache the target's
    KVCache, capture the drafter's capture depths, attention the target's attention
    callable for plain and full steps (None: jnp). -> (logits f32[B,G+1,V], hidden
    [C,B,G+1,D] or None, cache, state): the same shapes in every mode (`choose_mode`)."""
    B, T = chain.shape
    G = T - 1
    base = lengths - 1
    pos = base[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    mode = choose_mode(cfg, state, base, active, G)
    L = model.cfg.num_layers
    F = cfg.buffer  # committed tokens fed again by a full step
    layers = tuple(range(L))

    def plain(c):
        out = model(chain, pos, c[2], capture=capture, attention=attention)
        return out.logits, out.hidden, out.cache, c[3]

    def partial(c):
        st = c[3]
        out = model(chain, pos, c[2], capture=capture, attention=partial_attention(cfg, st))
        return out.logits, out.hidden, out.cache, st.replace(partial=st.partial + 1)

    def full(c):
        cache, state = c[2], c[3]
        back = base[:, None] - F + jnp.arange(F, dtype=jnp.int32)[None, :]  # >= 0 here
        refed = jnp.take_along_axis(tokens, jnp.maximum(back, 0), axis=1)
        all_pos = jnp.concatenate([back, pos], axis=1)  # [B,F+T]
        at = F + jnp.arange(T, dtype=jnp.int32)
        out = model(jnp.concatenate([refed, chain], axis=1), all_pos, cache,
                    capture=layers + tuple(capture), attention=attention,
                    logits_at=jnp.broadcast_to(at, (B, T)))
        hidden = None
        if capture:
            hidden = out.hidden[L:, :, F:]
        win_lo = (base - cfg.window) // cfg.block * cfg.block
        sel = reselect(model, cfg, out.hidden[:L], all_pos, out.cache, win_lo)
        new = state.replace(sel=sel, verified=base, win_lo=win_lo, full=state.full + 1)
        return out.logits, hidden, out.cache, new

    # Not `lax.switch`: XLA copies the KV cache in and out of a conditional's branches on
    # every step; a while loop that runs once or not at all updates its carry in place
    # (as the adaptive schedule's branches do, specjax.decoding.adaptive.loop).
    shapes = jax.eval_shape(plain, (None, None, cache, state))
    carry = (jnp.zeros(shapes[0].shape, shapes[0].dtype),
             None if shapes[1] is None else jnp.zeros(shapes[1].shape, shapes[1].dtype),
             cache, state)
    for i, branch in ((PLAIN, plain), (FULL, full), (PARTIAL, partial)):
        carry, mode = jax.lax.while_loop(lambda c, i=i: c[1] == i,
                                         lambda c, b=branch: (b(c[0]), jnp.int32(-1)),
                                         (carry, mode))
    return carry
