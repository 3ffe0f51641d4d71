"""The eagle3 family's dynamic draft tree (`Eagle3Drafter.propose_tree_topk`; EAGLE-2,
Li et al. 2024, arXiv 2406.16858; `topK_genrate` of SafeAILab/EAGLE), and the shared
hidden-state chain (`hidden_chain`) that a network whose chain reads no token (medc)
runs once per tree instead of one forward per node."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.tree import candidate_depths, expand_frontier, tree_from_candidates
from specjax.drafters.attend import attend, windowed
from specjax.drafters.eagle3.propose import chain_forward, first_readout
from specjax.drafters.eagle3.state import first_memory
from specjax.models import layers


def hidden_chain(drafter, net, params, state, view, n: int):
    """Outputs [n,B,D] of the n chain forwards after h_last, for a network whose
    chain reads no token (medc): what every node of a draft tree's depth j+1 gets
    from its forward, whatever the tokens on its path."""
    B = view.lengths.shape[0]
    c = drafter.cfg
    pos0 = (view.lengths - 1)[:, None]
    anchor = pos0 - 1
    committed = windowed(anchor, drafter.window)
    empty = jnp.zeros((B, c.num_kv_heads, max(n, 1), c.head_dim), state.cache.k.dtype)
    tok = jnp.zeros((B,), jnp.int32)  # not read by the chain

    def step(carry, j):
        dk, dv, h = carry
        dk, dv, out, _ = chain_forward(drafter, net, params, state, dk, dv, h, tok,
                                       pos0 + j, anchor, committed, j)
        return (dk, dv, out.astype(h.dtype)), out

    _, outs = jax.lax.scan(step, (empty, empty, state.h_last),
                           jnp.arange(n, dtype=jnp.int32))
    return outs


def propose_tree_topk(drafter, params, state, view, topk: int, nodes: int):
    """`Eagle3Drafter.propose_tree_topk` (its docstring says which tree): (DraftTree,
    the state as it was)."""
    net = drafter.net(params)
    G, K = drafter.gamma, topk
    B = view.lengths.shape[0]
    i32 = jnp.int32
    logp0 = jax.nn.log_softmax(
        drafter.logits(net, first_readout(net, state.h_last, params, view), params), -1)
    s1, t1 = jax.lax.top_k(logp0, K)  # [B,K] depth 1 (candidates 0..K-1)
    t1 = t1.astype(i32)
    n = G - 1  # forwards
    c = drafter.cfg
    S = max(n * K, 1)  # draft-entry buffer: forward j writes slots j*K .. j*K+K-1
    empty = jnp.zeros((B, c.num_kv_heads, S, c.head_dim), state.cache.k.dtype)
    anchor = jnp.broadcast_to((view.lengths - 2)[:, None], (B, K))  # last committed
    committed = windowed(anchor, drafter.window)
    slot = jnp.arange(S, dtype=i32)
    own = jnp.arange(K, dtype=i32)
    chain = None
    if drafter.share_tree_chain and not net.chain_reads_token:  # medc: one state per depth
        chain = hidden_chain(drafter, net, params, state, view, n)  # [n,B,D]

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
                           (dk, dv, mine)], kernel=drafter.attention)
        out, _ = net.mix_memory(net.finish(h, attn), pos, anchor,
                                first_memory(state.memory), params["inv_freq"],
                                drafter.attention, window=drafter.window)
        return expand((dk, dv, mine, h, fs, ft, fg), j, out, emb)

    def expand(carry, j, out, emb):
        """The frontier's children from its outputs out [B,K,D] (the mask the
        forward used in carry[2])."""
        dk, dv, mine, _, fs, _, fg = carry
        logp = jax.nn.log_softmax(drafter.logits(net, net.readout(out, emb), params),
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
    tree = tree_from_candidates(view.pending, score, tok, par, depth, nodes,
                                None if drafter.sampling.greedy else logp0.shape[-1])
    return tree, state
