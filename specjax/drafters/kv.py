"""KVShot KV-only drafter (arXiv 2604.26412; docs/design.md section 5): a small causal decoder
whose input is the token embedding alone and whose every layer attends to a memory M_l
merged from the target's K/V at Ls layers (positions <= the last committed entry),
followed by its own K/V for the tokens it is drafting.

    layer l, query at position p:  attend(q, [M_l[slots <= t] ; own_l[t+1 .. p]])

where t = lengths-2 is the last position the target has cached. Decoding state: the
merged memories [Ld,B,K,S,H] for committed positions, extended per verification from
the target cache in place (`memory.memory_update`); the own K/V live only inside one
proposal (G slots). A proposal runs G one-token forwards: the pending token, then
x_1 .. x_{G-1}.

Training-time test (objectives/ttt.py): step k at anchor t feeds token t+k+1 at position
t+k+1; it sees M_l[<= t] and its own K/V of steps 0..k at t (the TTT diagonal).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.constraints.loop import draft_logits, draft_state, row_state
from specjax.core.drafter import AttentionKernel
from specjax.core.sampling import ranked_choice, sample_logits
from specjax.core.tree import candidate_depths, expand_frontier, tree_from_candidates
from specjax.drafters import registry
from specjax.drafters.attend import Limit, attend, windowed
from specjax.drafters.config import DrafterConfig, kv_layer_set
from specjax.drafters.learned import LearnedDrafter
from specjax.drafters.memory import memory_update, merge_init, ttt_memory
from specjax.drafters.weights import layer_out, layer_qkv, layer_weights, ones
from specjax.models import layers
from specjax.models.kv_cache import KVCache


class KVOnly(nnx.Module):
    """Ld layers (weights.layer_weights with input_norm), merge_k/merge_v
    [Ld,K*H,Ls*K*H], final_norm [D]."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, dtype
        for name, p in layer_weights(cfg, rngs, dtype, cfg.num_layers).items():
            setattr(self, name, p)
        self.merge_k, self.merge_v = merge_init(cfg, dtype)
        self.final_norm = ones((cfg.hidden_size,), dtype)

    def logits(self, out, head):
        return layers.logits(out, self.final_norm[...], head, self.cfg.rms_norm_eps)

    def ttt(self, hidden, kv, tokens, embed, inv_freq, steps: int, anchors=None,
            kernel: AttentionKernel | None = None):
        """Training-time-test unroll (docs/design.md section 6).

        Args:
          hidden: unused (a KV-only drafter reads no target features).
          kv: (k, v) [Ls,B,K,T,H] target K/V at `cfg.kv_layers` for positions 0..T-1,
            merged here into the Ld memories.
          tokens: i32[B,T+1] rows; step k at anchor t reads token t+k+1 (clipped past T).
          embed: [V,D] target embedding; inv_freq: f32[H/2].
          anchors: i32[B,P] anchors whose chains are unrolled (None: all T positions).
          kernel: the attention kernel of `attend` (`specjax.decoding.kernel_policy`; None: jnp).
        Returns: (outputs [steps,B,P,D] pre-norm, None); step k at t predicts token t+k+2.
        """
        mk, mv = ttt_memory(self, self.cfg, kv, inv_freq)
        B, T = tokens.shape[0], tokens.shape[1] - 1
        if anchors is None:
            anchors = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        visible = Limit(anchors)  # memory slots <= the anchor
        own = [[] for _ in range(self.cfg.num_layers)]
        outs = []
        for k in range(steps):
            idx = jnp.minimum(anchors + k + 1, tokens.shape[1] - 1)
            x = jnp.take(embed, jnp.take_along_axis(tokens, idx, axis=1), axis=0)
            cos, sin = layers.rope_cos_sin(inv_freq, anchors + k + 1, self.dtype)
            for i in range(self.cfg.num_layers):
                q, kk, vv = layer_qkv(self, i, x, cos, sin)
                own[i].append((kk, vv))
                attn = attend(q, [(mk[i], mv[i], visible)], own[i], kernel=kernel)
                x = layer_out(self, i, x, attn)
            outs.append(x)
        return jnp.stack(outs), None


@struct.dataclass
class KVState:
    memory: KVCache  # merged target K/V [Ld,B,K,S,H]; positions 0..lengths-2 valid


@dataclasses.dataclass(frozen=True)
class KVDrafter(LearnedDrafter):
    """Loop adapter for KVOnly; fields and params as learned.LearnedDrafter."""

    def init(self, params, view, key):
        net = self.net(params)
        memory = self.empty_cache(self.cfg.num_layers, view, net.dtype)
        return KVState(memory_update(net, self.cfg, memory, view.target_cache,
                                     view.positions, params["inv_freq"]))

    def propose(self, params, state, view, key, first_rank=None):
        net = self.net(params)
        c, G = self.cfg, self.gamma
        B = view.lengths.shape[0]
        limit = (view.lengths - 2)[:, None]  # memory slots <= limit are committed
        mem_mask = windowed(limit, self.window)  # read up to the longest row only
        own_shape = (c.num_layers, B, c.num_kv_heads, G, c.head_dim)
        slots = jnp.arange(G)
        pending = view.pending

        con = view.constraint  # masks each draft in the state its prefix reaches

        def step(carry, inp):
            own_k, own_v, tok, cs = carry
            j, k = inp
            pos = (view.lengths - 1 + j)[:, None]
            cos, sin = layers.rope_cos_sin(params["inv_freq"], pos, net.dtype)
            x = jnp.take(params["embed"], tok[:, None], axis=0)
            own_mask = jnp.broadcast_to(slots[None, None, :] <= j, (B, 1, G))
            for i in range(c.num_layers):
                q, kk, vv = layer_qkv(net, i, x, cos, sin)
                own_k = own_k.at[i, :, :, j].set(kk[:, 0])
                own_v = own_v.at[i, :, :, j].set(vv[:, 0])
                attn = attend(q, [(state.memory.k[i], state.memory.v[i], mem_mask),
                                  (own_k[i], own_v[i], own_mask)], kernel=self.attention)
                x = layer_out(net, i, x, attn)
            lg = draft_logits(con, self.logits(net, x[:, 0], params), cs)
            nxt, probs = sample_logits(k, lg, self.sampling)
            if first_rank is not None:  # the first draft token only (j == 0)
                first, q1 = ranked_choice(lg, probs, nxt, self.sampling, first_rank)
                nxt, probs = jnp.where(j == 0, first, nxt), jnp.where(j == 0, q1, probs)
            return (own_k, own_v, nxt, draft_state(con, cs, nxt)), (nxt, probs)

        zeros = jnp.zeros(own_shape, net.dtype)
        keys = jax.random.split(key, G)
        _, (xs, qs) = jax.lax.scan(step, (zeros, zeros, pending, row_state(con)),
                                   (slots, keys))
        return xs.T, jnp.moveaxis(qs, 0, 1), state

    def propose_tree_topk(self, params, state, view, key, topk: int, nodes: int):
        """EAGLE-2's dynamic draft tree (arXiv 2406.16858) for the KV-only drafter
        (`specjax.drafters.dynamic_tree.DynamicTree` calls it), K = topk, N = nodes.

        Forward 0 runs the pending token (one query) and gives depth 1: the top-K tokens
        of its draft distribution. Forward d = 1..G-1 runs the K frontier nodes of depth
        d together (K queries at position lengths-1+d); in every layer each attends to
        the committed memory and, through a tree mask over an own-entry buffer of
        1 + (G-1)*K slots, to the pending token's entry and its own ancestors' and its
        own; each frontier node's top-K children (score = parent's + log q) are the
        K*K candidates of depth d+1, the K best of which form the next frontier. The
        tree is the N - 1 best candidates by cumulative log q
        (`specjax.core.tree.tree_from_candidates`); scores from the draft
        distribution at temperature 1 whatever the loop's temperature. q: one-hot at
        each node's token above temperature 0 (deterministic choices), None at 0.
        `key` is unused; the state is returned as it is (`update` reads the path)."""
        del key
        net = self.net(params)
        c, G, K = self.cfg, self.gamma, topk
        B = view.lengths.shape[0]
        i32 = jnp.int32
        S = 1 + (G - 1) * K  # own entries: slot 0 the pending token, then K per depth
        anchor = jnp.broadcast_to((view.lengths - 2)[:, None], (B, K))  # last committed
        slot = jnp.arange(S, dtype=i32)

        def forward(own_k, own_v, toks, pos, first: int, mine):
            """toks i32[B,T] at pos [B,T], own entries written from slot `first`; mine
            bool[B,T,S] the own entries each query sees. -> (logp [B,T,V], own_k, own_v)."""
            T = toks.shape[1]
            cos, sin = layers.rope_cos_sin(params["inv_freq"], pos, net.dtype)
            x = jnp.take(params["embed"], toks, axis=0)
            mem = windowed(anchor[:, :T], self.window)
            for i in range(c.num_layers):
                q, kk, vv = layer_qkv(net, i, x, cos, sin)
                own_k = own_k.at[i, :, :, first:first + T].set(
                    kk.swapaxes(1, 2).astype(own_k.dtype))
                own_v = own_v.at[i, :, :, first:first + T].set(
                    vv.swapaxes(1, 2).astype(own_v.dtype))
                attn = attend(q, [(state.memory.k[i], state.memory.v[i], mem),
                                  (own_k[i], own_v[i], mine)], kernel=self.attention)
                x = layer_out(net, i, x, attn)
            logp = jax.nn.log_softmax(self.logits(net, x, params), axis=-1)
            return logp, own_k, own_v

        own_shape = (c.num_layers, B, c.num_kv_heads, S, c.head_dim)
        own_k = own_v = jnp.zeros(own_shape, net.dtype)
        pending = jnp.take_along_axis(view.tokens, (view.lengths - 1)[:, None], axis=1)
        mine0 = jnp.broadcast_to(slot[None, None, :] == 0, (B, 1, S))
        logp, own_k, own_v = forward(own_k, own_v, pending, (view.lengths - 1)[:, None], 0,
                                     mine0)
        V = logp.shape[-1]
        fs, ft = jax.lax.top_k(logp[:, 0], K)  # depth 1: the frontier
        ft = ft.astype(i32)
        scores, toks, parents = [fs], [ft], [jnp.full((B, K), -1, i32)]
        fg = jnp.broadcast_to(jnp.arange(K, dtype=i32), (B, K))
        amask = jnp.broadcast_to(mine0, (B, K, S))  # each frontier node's visible entries
        start, own = K, jnp.arange(K, dtype=i32)
        for d in range(1, G):  # static: G - 1 forwards of K queries
            first = 1 + (d - 1) * K
            mine = amask | (slot[None, None, :] == (first + own)[None, :, None])
            pos = jnp.broadcast_to((view.lengths - 1 + d)[:, None], (B, K))
            logp, own_k, own_v = forward(own_k, own_v, ft, pos, first, mine)
            cs, ct = jax.lax.top_k(logp, K)  # [B,K,K] each frontier node's children
            cand, (fs, fg, ni) = expand_frontier(fs, fg, cs, ct, start)
            for acc, x in zip((scores, toks, parents), cand, strict=True):
                acc.append(x)
            ft = jnp.take_along_axis(toks[-1], ni, axis=1)
            amask = jnp.take_along_axis(mine, (ni // K)[..., None], axis=1)
            start += K * K
        depth = candidate_depths(K, G)
        tree = tree_from_candidates(pending[:, 0], jnp.concatenate(scores, 1),
                                    jnp.concatenate(toks, 1), jnp.concatenate(parents, 1),
                                    depth, nodes, None if self.sampling.greedy else V)
        return tree, state

    def update(self, params, state, view, num_accepted):
        net = self.net(params)
        return KVState(memory_update(net, self.cfg, state.memory, view.target_cache,
                                     view.positions, params["inv_freq"]))


class KVKind(registry.DrafterKind):
    """kv (KVShot KV-only): Ld = 2 layers by default, each over its merged memory of Ls =
    num_kv_layers target layers; TTT."""

    name, network, adapter, objective = "kv", KVOnly, KVDrafter, "ttt"
    default_num_layers = 2

    def defaults(self, target, opts):
        return {"capture": (), "kv_layers": kv_layer_set(target.num_layers,
                                                          opts["num_kv_layers"])}

    def uses_kv(self, cfg):
        return True


registry.register(KVKind())
