"""EAGLE-3 drafter (hidden states only; Li et al. 2025, arXiv 2503.01840; layout of
SafeAILab/EAGLE and SpecForge, docs/design.md section 5).

One decoder layer over x_t = [embed_norm(embed(token_{t+1})) ; hidden_norm(h_t)] (2D
features), with h as its residual: h_0 = fc(concat of target features at 3 depths),
later steps feed back the layer's own pre-norm output. Logits come from the target's LM
head after the drafter's final norm (an imported EAGLE-3 head's own head over a hot
vocabulary: `learned.LearnedDrafter.logits`, `external.py`). Entry t (RoPE position t)
pairs feature t with token t+1 and predicts token t+2.

Decoding state (`Eagle3State`): the drafter's one-layer KV cache [1,B,K,S,H], valid for
positions 0..lengths-2 (built from TARGET features of committed tokens), and h_last
[B,D], its output at position lengths-2, which predicts the first draft token. Each
step drafts with G-1 one-token forwards (positions lengths-1 .. lengths+G-3, their
keys in a small buffer beside the read-only cache) and, after verification, writes the
entries of the newly committed positions in one (G+1)-token forward from the verify
pass's target features.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.core.drafter import AttentionKernel
from specjax.core.sampling import ranked_choice, sample_logits
from specjax.core.tree import candidate_depths, expand_frontier, tree_from_candidates
from specjax.drafters import registry
from specjax.drafters.attend import Limit, attend, windowed
from specjax.drafters.config import DrafterConfig
from specjax.drafters.learned import LearnedDrafter
from specjax.drafters.memory import memory_update, ttt_memory
from specjax.drafters.weights import layer_params, layer_weights, normal, ones
from specjax.errors import SpecjaxError
from specjax.models import layers
from specjax.models.kv_cache import KVCache
from specjax.models.matmul import linear
from specjax.models.prefill import pad_rows, padded_width, prefill_pieces, scan_prompt_pieces


class Eagle3(nnx.Module):
    """The EAGLE-3 network: fc [D, C*D], embed_norm/hidden_norm [D], one layer reading
    2D features (weights.layer_weights), final_norm [D]."""

    # True for networks whose logits read a token after the layer (`readout`, medc.py);
    # EAGLE-3 reads the token in the layer's input, so its readout is the identity.
    token_readout = False
    input_width = 2  # the layer's q/k/v read input_width * D features ([emb; h])
    # False for networks whose hidden-state chain reads no token (medc.py): then every
    # node of one draft-tree depth has the same layer output, and
    # `Eagle3Drafter.propose_tree_topk` runs one chain instead of one forward per node.
    chain_reads_token = True

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, C = cfg.hidden_size, len(cfg.capture)
        self.cfg, self.dtype = cfg, dtype
        self.fc = normal(rngs, (D, C * D), dtype)
        self.embed_norm = ones((D,), dtype)
        self.hidden_norm = ones((D,), dtype)
        for name, p in layer_weights(cfg, rngs, dtype, 1, self.input_width * D,
                                     False).items():
            setattr(self, name, p)
        self.final_norm = ones((D,), dtype)

    def features(self, hidden):
        """fc over the captured target features: hidden [C,B,T,D] -> [B,T,D]."""
        C, B, T, D = hidden.shape
        flat = hidden.transpose(1, 2, 0, 3).reshape(B, T, C * D)
        return linear(flat, self.fc[...])

    def project(self, emb, h, cos, sin):
        """q [B,T,N,H], k, v [B,T,K,H] of one step's input (emb, h [B,T,D])."""
        eps = self.cfg.rms_norm_eps
        c = self.cfg
        x = jnp.concatenate([layers.rms_norm(emb, self.embed_norm[...], eps),
                             layers.rms_norm(h, self.hidden_norm[...], eps)], axis=-1)
        return layers.qkv(layer_params(self, 0), x, cos, sin, eps, c.num_heads,
                          c.num_kv_heads, c.head_dim)

    def finish(self, h, attn):
        """The layer's output (pre-norm, fed back as the next step's h): h + o(attn),
        then the MLP. attn [B,T,N*H] -> [B,T,D]."""
        return layers.layer_out(layer_params(self, 0), h, attn, self.cfg.rms_norm_eps)

    def logits(self, out, head):
        return layers.logits(out, self.final_norm[...], head, self.cfg.rms_norm_eps)

    def readout(self, out, emb):
        """The features the logits are read from: out [...,D] (the layer's output, fed
        back as the next step's h) with the embedding emb [...,D] of the token that
        follows its position. EAGLE-3: out itself (its token entered the layer's input);
        medc.Medc injects the token here."""
        del emb
        return out

    def ttt(self, hidden, kv, tokens, embed, inv_freq, steps: int, anchors=None,
            kernel: AttentionKernel | None = None):
        """Training-time-test unroll (EAGLE-3; docs/design.md section 6).

        Step 0 runs on fc(target features) with a causal mask over all T positions; step
        k at anchor t reads the embedding of token t+k+1 and step k-1's output at t, uses
        RoPE position t+k, and attends to step-0 keys at positions <= t plus position t
        of steps 1..k.

        Args:
          hidden: [C,B,T,D] target features at `cfg.capture` depths for positions 0..T-1.
          kv: hybrid only (else unused): (k, v) [Ls,B,K,T,H] target K/V at
            `cfg.kv_layers`, merged here into the memory of positions 0..T-1.
          tokens: i32[B,T+1] rows (indices past T are clipped; those outputs are unused).
          embed: [V,D]; inv_freq: f32[H/2].
          anchors: i32[B,P] positions whose chains are unrolled (None: all T). Steps
            k >= 1 cost P instead of T positions.
          kernel: the attention kernel of `attend` (`specjax.decoding.kernel_policy`; None: jnp).
        Returns: (outputs [steps,B,P,D] pre-norm, through `readout`, gates [steps,B,P,D]
          or None); step k at anchor t predicts token t+k+2 (the target's distribution
          at t+k+1).
        """
        memory = None
        if self.cfg.uses_kv:
            mk, mv = ttt_memory(self, self.cfg, kv, inv_freq)
            memory = (mk[0], mv[0])
        B, T = tokens.shape[0], tokens.shape[1] - 1
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if anchors is None:
            anchors = pos
        visible = Limit(anchors)  # step-0 keys at positions <= the anchor
        g = self.features(hidden)
        # Step 0 over every position: its keys are the context of every later step.
        emb = jnp.take(embed, tokens[:, 1:T + 1], axis=0)
        cos, sin = layers.rope_cos_sin(inv_freq, pos, self.dtype)
        q, k0, v0 = self.project(emb, g, cos, sin)
        self_keys = (k0.swapaxes(1, 2), v0.swapaxes(1, 2), visible)
        q, g = _at_positions(q, anchors), _at_positions(g, anchors)
        out, gate = self.mix_memory(self.finish(g, attend(q, [self_keys], kernel=kernel)),
                                    anchors, anchors, memory, inv_freq, kernel)
        first = (self.readout(out, _at_positions(emb, anchors)) if self.token_readout
                 else out)
        outs, gates, diag, h = [first], [gate], [], out
        for k in range(1, steps):
            idx = jnp.minimum(anchors + k + 1, tokens.shape[1] - 1)
            emb = jnp.take(embed, jnp.take_along_axis(tokens, idx, axis=1), axis=0)
            cos, sin = layers.rope_cos_sin(inv_freq, anchors + k, self.dtype)
            q, kk, vv = self.project(emb, h, cos, sin)
            diag.append((kk, vv))
            out = self.finish(h, attend(q, [self_keys], diag, kernel=kernel))
            out, gate = self.mix_memory(out, anchors + k, anchors, memory, inv_freq, kernel)
            outs.append(self.readout(out, emb))
            gates.append(gate)
            h = out
        return jnp.stack(outs), (None if gates[0] is None else jnp.stack(gates))

    def mix_memory(self, out, q_positions, limit, memory, inv_freq, kernel=None,
                   window=None):
        """Hook for the hybrid's cross-attention path over the merged target memory
        (identity here); returns (out, gate or None). See Hybrid.mix_memory."""
        return out, None


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


@struct.dataclass
class Eagle3State:
    cache: KVCache  # k, v [1,B,K,S,H]; positions 0..lengths-2 valid after update
    h_last: jax.Array  # [B,D] output at position lengths-2
    memory: KVCache | None  # hybrid: merged target K/V [1,B,K,S,H]; None for eagle3
    chain: DraftChain | None = None  # medc with reuse; None otherwise


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(LearnedDrafter):
    """Loop adapter (specjax.core.drafter.Drafter) for Eagle3, Medc and Hybrid networks;
    fields and params as learned.LearnedDrafter, plus `reuse` (medc only,
    `--draft-reuse`): the next step starts its chain from this step's drafted hidden
    states where they cover the new positions (`propose`)."""

    reuse: bool = False
    # A dynamic tree of a network whose chain reads no token (medc) runs one chain and
    # reads every node out of its depth's state; False: one forward per frontier node,
    # as for eagle3 (the same tree; for A/B measurements, benchmarks/medc.py tree).
    share_tree_chain: bool = True

    # ------------------------------------------------------------------ pieces

    def _entries(self, net, params, cache, memory, feats, positions, next_tokens):
        """Writes drafter entries for `positions` [B,T] from target feats [C,B,T,D] and the
        tokens that follow them; returns (outputs [B,T,D], cache)."""
        g = net.features(feats)
        emb = jnp.take(params["embed"], next_tokens, axis=0)
        cos, sin = layers.rope_cos_sin(params["inv_freq"], positions, net.dtype)
        q, k, v = net.project(emb, g, cos, sin)
        cache = _write(cache, k, v, positions)
        attn = attend(q, [(cache.k[0], cache.v[0], windowed(positions, self.window))],
                      kernel=self.attention)
        out, _ = net.mix_memory(net.finish(g, attn), positions, positions,
                                _first_memory(memory), params["inv_freq"], self.attention,
                                window=self.window)
        return out, cache

    def _memory(self, net, params, memory, view, positions):
        """Extends the hybrid's merged memory with the target K/V at `positions`."""
        if memory is None:
            return None
        return memory_update(net, self.cfg, memory, view.target_cache, positions,
                             params["inv_freq"])

    # ------------------------------------------------------------------ protocol

    def init(self, params, view, key):
        """The drafter's entries for the prompt (positions 0..lengths-2) and h_last.

        A prompt width T above sizes[0], sizes = `view.prefill_sizes` (the loop's
        `LoopConfig.prefill_sizes()`; if empty, the backend's default
        `specjax.models.prefill.prefill_pieces()`), is processed in the pieces of
        `specjax.models.prefill.scan_prompt_pieces`, as the target's prefill is: whole chunks in a
        `lax.scan`, each writing its entries before the next attends to them, then the
        rest as one piece of the smallest size that covers it; pieces past every row's
        last entry are skipped, so a short prompt padded to a wide T pays for its own
        pieces only. The skipped slots stay empty; nothing reads a slot before update()
        writes it."""
        net = self.net(params)
        T = view.positions.shape[1]
        cache = self.empty_cache(1, view, net.dtype)
        memory = None
        if self.cfg.uses_kv:
            memory = self.empty_cache(self.cfg.num_memories, view, net.dtype)
            memory = self._memory(net, params, memory, view, view.positions)
        nxt = jax.lax.dynamic_slice_in_dim(view.tokens, 1, T, axis=1)
        sizes = view.prefill_sizes or prefill_pieces()
        if T <= sizes[0]:
            out, cache = self._entries(net, params, cache, memory, view.hidden,
                                       view.positions, nxt)
            return Eagle3State(cache, _entry_at_clipped(out, view.lengths - 2), memory,
                               self._empty_chain(view, net.dtype))
        state = self._chunked_init(net, params, cache, memory, view, nxt, sizes)
        return state.replace(chain=self._empty_chain(view, net.dtype))

    def report(self, state: Eagle3State) -> dict:
        """{"reused": i32[4]} with draft reuse (`DraftChain.counts`), {} without: what
        the loop's result carries (`specjax.core.drafter.drafter_report`)."""
        return {} if state.chain is None else {"reused": state.chain.counts}

    def _empty_chain(self, view, dtype) -> DraftChain | None:
        """No chain yet (valid 0): nothing to reuse at the first step."""
        if not self.reuse:
            return None
        c, B, n = self.cfg, view.lengths.shape[0], max(self.gamma - 1, 1)
        kv = jnp.zeros((B, c.num_kv_heads, n, c.head_dim), dtype)
        return DraftChain(jnp.zeros((B, n, c.hidden_size), dtype), kv, kv,
                          jnp.zeros((B,), jnp.int32), jnp.int32(0), jnp.zeros((4,), jnp.int32))

    def _chunked_init(self, net, params, cache, memory, view, nxt, sizes):
        _, B, T, D = view.hidden.shape
        width = padded_width(T, sizes)
        hidden, nxt = pad_rows(view.hidden, 2, width), pad_rows(nxt, 1, width)
        last = jnp.clip(view.lengths - 2, 0, T - 1)  # [B] the entry whose output is h_last

        def forward(carry, start, size):
            cache, h = carry
            positions = start + jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, size))
            out, cache = self._entries(
                net, params, cache, memory, jax.lax.dynamic_slice_in_dim(hidden, start, size, 2),
                positions, jax.lax.dynamic_slice_in_dim(nxt, start, size, 1))
            mine = (last >= start) & (last < start + size)
            return cache, jnp.where(mine[:, None], _entry_at_clipped(out, last - start), h)

        cache, h_last = scan_prompt_pieces(
            forward, (cache, jnp.zeros((B, D), net.dtype)), T, sizes, last)
        return Eagle3State(cache, h_last, memory)

    def _chain_forward(self, net, params, state, dk, dv, h, tok, pos, anchor, committed, j):
        """One chain forward at positions pos i32[B,1] (draft entry j): h [B,D] and the
        token tok i32[B] in, its keys and values written to slot j of the draft buffer
        dk, dv [B,K,n,H] (the query sees slots <= j and the committed slots); returns
        (dk, dv, out [B,D], the token's embedding [B,1,D])."""
        B = h.shape[0]
        emb = jnp.take(params["embed"], tok[:, None], axis=0)
        cos, sin = layers.rope_cos_sin(params["inv_freq"], pos, net.dtype)
        qh, kh, vh = net.project(emb, h[:, None], cos, sin)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, kh.swapaxes(1, 2).astype(dk.dtype), j,
                                                 axis=2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, vh.swapaxes(1, 2).astype(dv.dtype), j,
                                                 axis=2)
        drafts = jnp.broadcast_to(jnp.arange(dk.shape[2]) <= j, (B, 1, dk.shape[2]))
        attn = attend(qh, [(state.cache.k[0], state.cache.v[0], committed),
                           (dk, dv, drafts)], kernel=self.attention)
        out, _ = net.mix_memory(net.finish(h[:, None], attn), pos, anchor,
                                _first_memory(state.memory), params["inv_freq"],
                                self.attention, window=self.window)
        return dk, dv, out[:, 0], emb

    def _hidden_chain(self, net, params, state, view, n: int):
        """Outputs [n,B,D] of the n chain forwards after h_last, for a network whose
        chain reads no token (medc): what every node of a draft tree's depth j+1 gets
        from its forward, whatever the tokens on its path."""
        B = view.lengths.shape[0]
        c = self.cfg
        pos0 = (view.lengths - 1)[:, None]
        anchor = pos0 - 1
        committed = windowed(anchor, self.window)
        empty = jnp.zeros((B, c.num_kv_heads, max(n, 1), c.head_dim), state.cache.k.dtype)
        tok = jnp.zeros((B,), jnp.int32)  # not read by the chain

        def step(carry, j):
            dk, dv, h = carry
            dk, dv, out, _ = self._chain_forward(net, params, state, dk, dv, h, tok,
                                                 pos0 + j, anchor, committed, j)
            return (dk, dv, out.astype(h.dtype)), out

        _, outs = jax.lax.scan(step, (empty, empty, state.h_last),
                               jnp.arange(n, dtype=jnp.int32))
        return outs

    def propose(self, params, state, view, key, first_rank=None):
        """G draft tokens: the first from h_last (or the first_rank-th choice, see
        `specjax.core.sampling.ranked_choice`), then G-1 one-token forwards. The draft
        entries' keys and values go to a small [B,K,G-1,H] buffer beside the cache (the
        cache itself is read only: copying its S slots in and out of the loop cost more
        than the draft steps' attention on XLA:CPU); update() writes the committed
        entries.

        With `stop_below` > 0 the forwards run in a `lax.while_loop` that ends once every
        row's chain confidence (the product of its drafts' top-1 probabilities under the
        draft distribution; at temperature 0 the softmax of the draft logits) is below
        it, or after G-1 forwards. The positions left over get the first draft token as a
        filler with q one-hot at it: a deterministic proposal, so token and block
        verification stay exact (the filler is simply rejected unless the target agrees).

        With `reuse` (medc, whose chain reads no token; docs/medc.md): forward j computes
        the entry at position lengths-1+j. The previous step's forward at the same
        position (slot j + shift, shift = lengths-1 - its base) computed that entry from
        no token either, so the first r forwards are taken from the previous chain
        instead of run, r = min over rows of (previous valid - shift), clipped to
        0..G-1 (the batch skips a forward only if every row has it): their outputs get
        this step's tokens through the readout, and their keys and values fill the draft
        buffer's first r slots. The first draft, from h_last (the target's features),
        is never reused. The proposal is still a distribution the rule verifies, so the
        output stays the target's.
        """
        net = self.net(params)
        keys = jax.random.split(key, self.gamma)
        lg0 = self.logits(net, _first_readout(net, state.h_last, params, view), params)
        x, q = sample_logits(keys[0], lg0, self.sampling)
        x, q = ranked_choice(lg0, q, x, self.sampling, first_rank)
        B, n = x.shape[0], self.gamma - 1
        pos0 = (view.lengths - 1)[:, None]  # the first draft entry's position
        anchor = pos0 - 1  # the last committed entry: cache and memory slots <= it
        committed = windowed(anchor, self.window)
        c = self.cfg
        empty = jnp.zeros((B, c.num_kv_heads, max(n, 1), c.head_dim), state.cache.k.dtype)
        buffers = (empty, empty)  # the draft entries' keys and values, [B,K,max(n,1),H]
        chain = state.chain if self.reuse else None
        if chain is not None:
            shift = pos0[:, 0] - chain.base  # [B] 0 for a finished row (no new tokens)
            active = shift > 0
            mine = jnp.clip(chain.valid - shift, 0, n)  # [B] previous entries per row
            r = jnp.min(jnp.where(active, mine, n))  # forwards the whole batch skips
            slots = jnp.clip(shift[:, None] + jnp.arange(max(n, 1))[None, :], 0,
                             chain.out.shape[1] - 1)  # [B,max(n,1)] previous slots
            old_out = _at_positions(chain.out, slots)  # [B,max(n,1),D]
            buffers = tuple(jnp.take_along_axis(a, slots[:, None, :, None], axis=2)
                            .astype(empty.dtype) for a in (chain.k, chain.v))

        def layer(dk, dv, h, tok, j):
            """Draft forward j: (dk, dv with slot j written, out [B,D], emb [B,1,D])."""
            return self._chain_forward(net, params, state, dk, dv, h, tok, pos0 + j, anchor,
                                       committed, j)

        def read(out, emb, k):
            """The draft token after out [B,D]: (token i32[B], q f32[B,V], logits)."""
            lg = self.logits(net, net.readout(out[:, None], emb)[:, 0], params)
            nxt, probs = sample_logits(k, lg, self.sampling)
            return nxt, probs, lg

        def forward(dk, dv, h, tok, k, j):
            dk, dv, out, emb = layer(dk, dv, h, tok, j)
            return dk, dv, out, *read(out, emb, k)

        if chain is not None:
            def forward(dk, dv, h, tok, k, j):  # noqa: F811 (reuse or run forward j)
                """Row b takes the previous chain's entry while j < mine[b]; the layer
                runs (once or never: a conditional would copy its operands every
                forward) only if some row needs it, j >= r."""
                old = jax.lax.dynamic_index_in_dim(old_out, j, axis=1, keepdims=False)
                emb = jnp.take(params["embed"], tok[:, None], axis=0)
                def run(cr):
                    dk_new, dv_new, out, _ = layer(dk, dv, h, tok, j)
                    return False, dk_new, dv_new, out.astype(old.dtype)

                _, dk_new, dv_new, new = jax.lax.while_loop(lambda cr: cr[0], run,
                                                            (j >= r, dk, dv, old))
                take = j < mine  # [B]
                out = jnp.where(take[:, None], old, new)
                dk = jnp.where(take[:, None, None, None], dk, dk_new)  # slot j differs
                dv = jnp.where(take[:, None, None, None], dv, dv_new)
                return dk, dv, out, *read(out, emb, k)

        def kept(outs, valid, dk, dv):
            """The state with this step's chain (reuse) or as it was (no reuse, or no
            draft forward in this step: the previous chain stays usable)."""
            if chain is None or n == 0:
                return state
            pad = chain.out.shape[1] - outs.shape[1]
            out = jnp.pad(outs, ((0, 0), (0, pad), (0, 0))).astype(chain.out.dtype)
            kk, vv = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))).astype(chain.k.dtype)
                      for a in (dk[..., :outs.shape[1], :], dv[..., :outs.shape[1], :]))
            rows = jnp.sum(active)
            counts = chain.counts + jnp.stack([
                jnp.sum(jnp.where(active, jnp.minimum(mine, valid), 0)), rows * valid,
                jnp.minimum(r, valid), valid]).astype(jnp.int32)
            return state.replace(chain=DraftChain(out, kk, vv, pos0[:, 0], valid, counts))

        if self.stop_below <= 0 or n == 0:
            def step(carry, xs):
                dk, dv, h, nxt, probs, _ = forward(*carry, *xs)
                return (dk, dv, h, nxt), (nxt, probs, h)

            (dk, dv, _, _), (xs, qs, hs) = jax.lax.scan(
                step, (*buffers, state.h_last, x),
                (keys[1:], jnp.arange(n, dtype=jnp.int32)))
            draft = jnp.concatenate([x[:, None], xs.T], axis=1)  # [B,G]
            q_all = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)  # [B,G,V]
            return draft, q_all, kept(jnp.moveaxis(hs, 0, 1), jnp.int32(n), dk, dv)

        def cond(carry):
            j, conf = carry[0], carry[5]
            return (j < n) & jnp.any(conf >= self.stop_below)

        def body(carry):
            j, dk, dv, h, tok, conf, toks, qs, hs = carry
            dk, dv, h, nxt, probs, lg = forward(dk, dv, h, tok, keys[1:][j], j)
            toks = jax.lax.dynamic_update_slice_in_dim(toks, nxt[:, None], j, axis=1)
            qs = jax.lax.dynamic_update_slice_in_dim(qs, probs[:, None], j, axis=1)
            if hs is not None:
                hs = jax.lax.dynamic_update_slice_in_dim(hs, h[:, None].astype(hs.dtype), j,
                                                         axis=1)
            return (j + 1, dk, dv, h, nxt, conf * _top1(lg, probs, self.sampling), toks, qs,
                    hs)

        V = q.shape[-1]
        dk0, dv0 = buffers
        hs0 = None if chain is None else jnp.zeros((B, n, state.h_last.shape[-1]),
                                                   state.h_last.dtype)
        init = (jnp.int32(0), dk0, dv0, state.h_last, x, _top1(lg0, q, self.sampling),
                jnp.broadcast_to(x[:, None], (B, n)),
                jnp.broadcast_to(jax.nn.one_hot(x, V, dtype=q.dtype)[:, None], (B, n, V)),
                hs0)
        j, dk, dv, *_, toks, qs, hs = jax.lax.while_loop(cond, body, init)
        draft = jnp.concatenate([x[:, None], toks], axis=1)  # [B,G]
        q_all = jnp.concatenate([q[:, None], qs], axis=1)  # [B,G,V]
        return draft, q_all, kept(hs, j, dk, dv)

    def propose_tree_topk(self, params, state, view, key, topk: int, nodes: int):
        """EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858; `topK_genrate`
        of SafeAILab/EAGLE) as a `specjax.core.tree.DraftTree` of N = `nodes` nodes;
        `specjax.drafters.dynamic_tree.DynamicTree` is the loop's TreeDrafter around it.

        Scores: the cumulative log-probability of a node's path under the drafter's
        distribution at temperature 1 (log_softmax of the draft logits, -inf outside a hot
        draft vocabulary), whatever the loop's temperature; the same tree at T = 0 and
        T > 0. Expansion, K = topk, G = gamma:
          depth 1: the top-K tokens of the first draft distribution (from h_last) form
            the frontier (no forward, as in `propose`);
          depth d = 2..G: ONE drafter forward over the K frontier nodes of depth d-1 (K
            queries per row at RoPE position lengths-2+d; each attends to the committed
            cache slots and, through a tree mask over a draft-entry buffer of
            (G-1)*K slots, to the entries of its own ancestors and itself); every
            frontier node's top-K children are the K*K candidates of depth d (child
            score = parent score + log q(child)); the K best candidates by score are the
            next frontier.
        The tree (`specjax.core.tree.tree_from_candidates`): the N-1 best of all
        K + (G-1)*K*K candidates by score (`lax.top_k`, lower index first on ties;
        candidates are indexed depth by depth, so a parent, whose score is >= its
        child's, is always taken before it: the set is closed under ancestors), laid out
        in candidate order (depth-major, so parents come first) after node 0 = the
        pending token. Candidates of score -inf (ids outside a hot draft vocabulary) are
        unused nodes (valid False). With K = 1 and N = G + 1 it is `propose`'s greedy
        chain.

        q: None at temperature 0; above it one-hot at each node's token (the children
        are deterministic top-K choices, distinct per parent: exact under
        `specjax.decoding.tree_verify.verify_tree_token`). `key` is unused, `stop_below`
        is ignored (every tree has G levels) and the drafter state is returned as it is
        (`update` writes the accepted path's entries). Requires
        2 <= N <= 1 + K + (G-1)*K*K (checked by DynamicTree)."""
        del key
        net = self.net(params)
        G, K = self.gamma, topk
        B = view.lengths.shape[0]
        i32 = jnp.int32
        logp0 = jax.nn.log_softmax(
            self.logits(net, _first_readout(net, state.h_last, params, view), params), -1)
        s1, t1 = jax.lax.top_k(logp0, K)  # [B,K] depth 1 (candidates 0..K-1)
        t1 = t1.astype(i32)
        n = G - 1  # forwards
        c = self.cfg
        S = max(n * K, 1)  # draft-entry buffer: forward j writes slots j*K .. j*K+K-1
        empty = jnp.zeros((B, c.num_kv_heads, S, c.head_dim), state.cache.k.dtype)
        anchor = jnp.broadcast_to((view.lengths - 2)[:, None], (B, K))  # last committed
        committed = windowed(anchor, self.window)
        slot = jnp.arange(S, dtype=i32)
        own = jnp.arange(K, dtype=i32)
        chain = None
        if self.share_tree_chain and not net.chain_reads_token:  # medc: one state per depth
            chain = self._hidden_chain(net, params, state, view, n)  # [n,B,D]

        def forward(carry, j):
            dk, dv, amask, h, fs, ft, fg = carry  # frontier: scores, tokens, cand. index
            pos = anchor + 1 + j  # the frontier's position (depth j+1)
            emb = jnp.take(params["embed"], ft, axis=0)  # [B,K,D]
            if chain is not None:  # one forward per depth, shared; per-node readouts
                out = jnp.broadcast_to(chain[j][:, None], h.shape).astype(h.dtype)
                return expand(carry, j, out, emb)
            cos, sin = layers.rope_cos_sin(params["inv_freq"], pos, net.dtype)
            qh, kh, vh = net.project(emb, h, cos, sin)
            dk = jax.lax.dynamic_update_slice_in_dim(dk, kh.swapaxes(1, 2).astype(dk.dtype),
                                                     j * K, axis=2)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, vh.swapaxes(1, 2).astype(dv.dtype),
                                                     j * K, axis=2)
            mine = amask | (slot[None, None, :] == (j * K + own)[None, :, None])  # [B,K,S]
            attn = attend(qh, [(state.cache.k[0], state.cache.v[0], committed),
                               (dk, dv, mine)], kernel=self.attention)
            out, _ = net.mix_memory(net.finish(h, attn), pos, anchor,
                                    _first_memory(state.memory), params["inv_freq"],
                                    self.attention, window=self.window)
            return expand((dk, dv, mine, h, fs, ft, fg), j, out, emb)

        def expand(carry, j, out, emb):
            """The frontier's children from its outputs out [B,K,D] (the mask the
            forward used in carry[2])."""
            dk, dv, mine, _, fs, _, fg = carry
            logp = jax.nn.log_softmax(self.logits(net, net.readout(out, emb), params),
                                      axis=-1)  # [B,K,V]
            cs, ct = jax.lax.top_k(logp, K)  # [B,K,K] each frontier node's children
            (cand_s, cand_t, cand_p), (ns, ng, ni) = expand_frontier(fs, fg, cs, ct,
                                                                     K + j * K * K)
            par = ni // K
            nxt = (dk, dv, jnp.take_along_axis(mine, par[..., None], axis=1),
                   jnp.take_along_axis(out, par[..., None], axis=1), ns,
                   jnp.take_along_axis(cand_t, ni, axis=1), ng)
            return nxt, (cand_s, cand_t, cand_p)

        init = (empty, empty, jnp.zeros((B, K, S), bool),
                jnp.broadcast_to(state.h_last[:, None], (B, K, state.h_last.shape[-1])),
                s1, t1, jnp.broadcast_to(own, (B, K)))
        _, (cs, ct, cp) = jax.lax.scan(forward, init, jnp.arange(n, dtype=i32))

        def flat(first, later):  # [B,K] + [n,B,K*K] -> [B,M] in candidate order
            return jnp.concatenate([first, jnp.moveaxis(later, 0, 1).reshape(B, -1)], 1)

        score = flat(s1, cs)
        tok = flat(t1, ct)
        par = flat(jnp.full((B, K), -1, i32), cp)
        depth = candidate_depths(K, G)
        pending = view.pending
        tree = tree_from_candidates(pending, score, tok, par, depth, nodes,
                                    None if self.sampling.greedy else logp0.shape[-1])
        return tree, state

    def update(self, params, state, view, num_accepted):
        net = self.net(params)
        pos = view.positions  # [B,G+1]: old lengths-1 .. old lengths-1+G
        memory = self._memory(net, params, state.memory, view, pos)
        nxt = jnp.take_along_axis(view.tokens, jnp.minimum(pos + 1, view.tokens.shape[1] - 1),
                                  axis=1)
        out, cache = self._entries(net, params, state.cache, memory, view.hidden, pos, nxt)
        last = jnp.clip(view.lengths - 2 - pos[:, 0], 0, pos.shape[1] - 1)
        return state.replace(cache=cache, h_last=_entry_at(out, last), memory=memory)


def _first_readout(net, h_last, params, view):
    """The features of the first draft's logits: h_last [B,D] (the entry at lengths-2)
    through the network's readout with the pending token (position lengths-1)."""
    if not net.token_readout:
        return h_last
    pending = view.pending
    return net.readout(h_last, jnp.take(params["embed"], pending, axis=0))


def _top1(logits, probs, sampling):
    """f32[B]: the top-1 probability of a draft distribution (at temperature 0, of the
    softmax of the logits, since q itself is one-hot there)."""
    if sampling.greedy:
        return jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    return jnp.max(probs, axis=-1)


def _at_positions(x, idx):
    """x [B,T,...] at i32[B,P] positions -> [B,P,...]."""
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)


def _first_memory(memory: KVCache | None):
    """(k, v) [B,K,S,H] of the hybrid's one merged memory, or None (eagle3)."""
    return None if memory is None else (memory.k[0], memory.v[0])


def _write(cache: KVCache, k, v, positions) -> KVCache:
    """Writes k, v [B,T,K,H] of layer 0 at `positions` [B,T] (past S: dropped)."""
    b = jnp.arange(k.shape[0])[:, None]
    return cache.replace(k=cache.k.at[0, b, :, positions].set(k, mode="drop"),
                         v=cache.v.at[0, b, :, positions].set(v, mode="drop"))


def _entry_at(x, idx):
    """x [B,T,D] at i32[B] indices -> [B,D]."""
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def _entry_at_clipped(x, idx):
    """`_entry_at` with the indices clipped into 0..T-1."""
    return _entry_at(x, jnp.clip(idx, 0, x.shape[1] - 1))


# ----------------------------------------------------------------------------- the kind

def eagle3_capture(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's capture depths: the inputs of layers {2, L/2, L-3} (any three depths of a
    shallow target)."""
    L = num_layers
    capture = tuple(sorted({min(2, L), L // 2, max(L - 3, 0)}))
    if len(capture) < 3:  # shallow targets: any three depths
        capture = tuple(sorted({0, L // 2, L}))
    return capture


class Eagle3Kind(registry.DrafterKind):
    """eagle3: one layer over target features at three depths; TTT; stops early. Its
    attention reads no target K/V, so an imported head's N, K, H may differ from the
    target's."""

    name, network, adapter, objective = "eagle3", Eagle3, Eagle3Drafter, "ttt"
    early_stop = True
    reads_target_kv_shapes = False
    default_num_layers = 1

    def defaults(self, target, opts):
        return {"capture": eagle3_capture(target.num_layers), "kv_layers": ()}

    def validate(self, cfg):
        if cfg.num_layers != 1:
            raise SpecjaxError(f"{cfg.kind} drafters have one layer, got num_layers="
                               f"{cfg.num_layers}")

    def uses_hidden(self, cfg):
        return True

    def state_layers(self, cfg):
        return 1 + cfg.num_memories  # its own one-layer cache (+ the hybrid's memory)


registry.register(Eagle3Kind())
