"""The chain proposal of the eagle3 family (`Eagle3Drafter.propose`): G draft tokens,
the first from h_last, then G-1 one-token forwards of the drafter's layer.

Three modes share ONE carry (`ChainCarry`: the draft buffers, the last output and the
last token) and ONE step (`step`: a forward, then the draft token read out of it):
  - plain: a `lax.scan` of G-1 steps;
  - early stop (`stop_below` > 0): a `lax.while_loop` of the same steps that ends once
    every row's chain confidence falls below it;
  - reuse (medc, `reuse.py`): the step's forward takes the previous chain's entries
    where they cover the new positions, in either loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.constraints.loop import draft_logits, draft_state, row_state
from specjax.core.sampling import ranked_choice, sample_logits
from specjax.drafters.attend import attend, windowed
from specjax.drafters.eagle3 import reuse as reuse_lib
from specjax.drafters.eagle3.state import first_memory
from specjax.models import layers


class ChainCarry(NamedTuple):
    """What one draft step hands the next: dk, dv [B,K,max(n,1),H] the draft entries'
    keys and values (slot j written by forward j), h [B,D] the last layer output, tok
    i32[B] the last draft token."""

    dk: jax.Array
    dv: jax.Array
    h: jax.Array
    tok: jax.Array
    constraint: jax.Array | None = None  # i32[B] the rows' automaton state after tok


class Drafted(NamedTuple):
    """What one draft step yields: tok i32[B] the draft token, q f32[B,V] its
    distribution, h [B,D] the layer output it was read from."""

    tok: jax.Array
    q: jax.Array
    h: jax.Array


def chain_forward(drafter, net, params, state, dk, dv, h, tok, pos, anchor, committed, j):
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
                       (dk, dv, drafts)], kernel=drafter.attention)
    out, _ = net.mix_memory(net.finish(h[:, None], attn), pos, anchor,
                            first_memory(state.memory), params["inv_freq"],
                            drafter.attention, window=drafter.window)
    return dk, dv, out[:, 0], emb


def first_readout(net, h_last, params, view):
    """The features of the first draft's logits: h_last [B,D] (the entry at lengths-2)
    through the network's readout with the pending token (position lengths-1)."""
    if not net.token_readout:
        return h_last
    return net.readout(h_last, jnp.take(params["embed"], view.pending, axis=0))


def top1(logits, probs, sampling):
    """f32[B]: the top-1 probability of a draft distribution (at temperature 0, of the
    softmax of the logits, since q itself is one-hot there)."""
    if sampling.greedy:
        return jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    return jnp.max(probs, axis=-1)


def propose(drafter, params, state, view, key, first_rank=None):
    """`Eagle3Drafter.propose` (its docstring says what it drafts): (draft i32[B,G],
    q f32[B,G,V], the state, with this step's chain under reuse)."""
    net = drafter.net(params)
    sampling = drafter.sampling
    keys = jax.random.split(key, drafter.gamma)
    con = view.constraint  # masks each draft in the state its prefix reaches
    lg0 = drafter.logits(net, first_readout(net, state.h_last, params, view), params)
    lg0 = draft_logits(con, lg0, row_state(con))
    x, q = sample_logits(keys[0], lg0, sampling)
    x, q = ranked_choice(lg0, q, x, sampling, first_rank)
    B, n = x.shape[0], drafter.gamma - 1
    pos0 = (view.lengths - 1)[:, None]  # the first draft entry's position
    anchor = pos0 - 1  # the last committed entry: cache and memory slots <= it
    committed = windowed(anchor, drafter.window)
    c = drafter.cfg
    empty = jnp.zeros((B, c.num_kv_heads, max(n, 1), c.head_dim), state.cache.k.dtype)
    buffers = (empty, empty)  # the draft entries' keys and values, [B,K,max(n,1),H]
    chain = state.chain if drafter.reuse else None
    reuse = None
    if chain is not None:
        reuse, buffers = reuse_lib.start(chain, pos0, n, empty)

    def layer(dk, dv, h, tok, j):
        """Draft forward j: (dk, dv with slot j written, out [B,D], emb [B,1,D])."""
        return chain_forward(drafter, net, params, state, dk, dv, h, tok, pos0 + j, anchor,
                             committed, j)

    def step(carry: ChainCarry, k, j):
        """Draft forward j (run, or taken from the previous chain under reuse), then the
        draft token after its output: (the next carry, Drafted, the draft logits)."""
        if reuse is None:
            dk, dv, out, emb = layer(*carry[:4], j)
        else:
            dk, dv, out, emb = reuse_lib.forward(reuse, layer, params["embed"], *carry[:4], j)
        lg = drafter.logits(net, net.readout(out[:, None], emb)[:, 0], params)
        lg = draft_logits(con, lg, carry.constraint)
        nxt, probs = sample_logits(k, lg, sampling)
        return (ChainCarry(dk, dv, out, nxt, draft_state(con, carry.constraint, nxt)),
                Drafted(nxt, probs, out), lg)

    def kept(outs, valid, carry: ChainCarry):
        """The state with this step's chain (reuse) or as it was (no reuse, or no
        draft forward in this step: the previous chain stays usable)."""
        if chain is None or n == 0:
            return state
        return state.replace(chain=reuse_lib.kept(chain, reuse, pos0, outs, valid,
                                                  carry.dk, carry.dv))

    start = ChainCarry(*buffers, state.h_last, x, draft_state(con, row_state(con), x))
    if drafter.stop_below <= 0 or n == 0:
        def scanned(carry, xs):
            carry, drafted, _ = step(carry, *xs)
            return carry, drafted

        carry, ys = jax.lax.scan(scanned, start,
                                 (keys[1:], jnp.arange(n, dtype=jnp.int32)))
        draft = jnp.concatenate([x[:, None], ys.tok.T], axis=1)  # [B,G]
        q_all = jnp.concatenate([q[:, None], jnp.moveaxis(ys.q, 0, 1)], axis=1)  # [B,G,V]
        return draft, q_all, kept(jnp.moveaxis(ys.h, 0, 1), jnp.int32(n), carry)

    # Early stop: the same steps until every row's confidence is below stop_below; the
    # positions left over keep the first draft token as a filler with q one-hot at it.
    def cond(loop):
        j, conf = loop[0], loop[2]
        return (j < n) & jnp.any(conf >= drafter.stop_below)

    def body(loop):
        j, carry, conf, buf = loop
        carry, d, lg = step(carry, keys[1:][j], j)
        toks = jax.lax.dynamic_update_slice_in_dim(buf.tok, d.tok[:, None], j, axis=1)
        qs = jax.lax.dynamic_update_slice_in_dim(buf.q, d.q[:, None], j, axis=1)
        hs = buf.h
        if hs is not None:
            hs = jax.lax.dynamic_update_slice_in_dim(hs, d.h[:, None].astype(hs.dtype), j,
                                                     axis=1)
        return j + 1, carry, conf * top1(lg, d.q, sampling), Drafted(toks, qs, hs)

    V = q.shape[-1]
    hs0 = None if chain is None else jnp.zeros((B, n, state.h_last.shape[-1]),
                                               state.h_last.dtype)
    conf0 = top1(lg0, q, sampling)
    buf0 = Drafted(jnp.broadcast_to(x[:, None], (B, n)),
                   jnp.broadcast_to(jax.nn.one_hot(x, V, dtype=q.dtype)[:, None], (B, n, V)),
                   hs0)
    j, carry, _, buf = jax.lax.while_loop(cond, body, (jnp.int32(0), start, conf0, buf0))
    draft = jnp.concatenate([x[:, None], buf.tok], axis=1)  # [B,G]
    q_all = jnp.concatenate([q[:, None], buf.q], axis=1)  # [B,G,V]
    return draft, q_all, kept(buf.h, j, carry)
