"""The eagle3 family's loop adapter (`Eagle3Drafter`, a `specjax.core.drafter.Drafter`
for Eagle3, Medc and Hybrid networks): init, the proposals (chains: `propose.py`;
trees: `trees.py`), update and report."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.attend import attend, windowed
from specjax.drafters.eagle3 import propose as propose_lib
from specjax.drafters.eagle3 import reuse as reuse_lib
from specjax.drafters.eagle3 import trees
from specjax.drafters.eagle3.state import Eagle3State, first_memory
from specjax.drafters.learned import LearnedDrafter
from specjax.drafters.memory import memory_update
from specjax.models import layers
from specjax.models.kv_cache import KVCache
from specjax.models.prefill import pad_rows, padded_width, prefill_pieces, scan_prompt_pieces


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
                                first_memory(memory), params["inv_freq"], self.attention,
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
        chain = reuse_lib.empty_chain(self, view, net.dtype)
        if T <= sizes[0]:
            out, cache = self._entries(net, params, cache, memory, view.hidden,
                                       view.positions, nxt)
            return Eagle3State(cache, _entry_at_clipped(out, view.lengths - 2), memory,
                               chain)
        state = self._chunked_init(net, params, cache, memory, view, nxt, sizes)
        return state.replace(chain=chain)

    def report(self, state: Eagle3State) -> dict:
        """{"reused": i32[4]} with draft reuse (`DraftChain.counts`), {} without: what
        the loop's result carries (`specjax.core.drafter.drafter_report`)."""
        return {} if state.chain is None else {"reused": state.chain.counts}

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

    def propose(self, params, state, view, key, first_rank=None):
        """G draft tokens (`propose.py`): the first from h_last (or the first_rank-th
        choice, see `specjax.core.sampling.ranked_choice`), then G-1 one-token forwards.
        The draft entries' keys and values go to a small [B,K,G-1,H] buffer beside the
        cache (the cache itself is read only: copying its S slots in and out of the loop
        cost more than the draft steps' attention on XLA:CPU); update() writes the
        committed entries.

        With `stop_below` > 0 the forwards run in a `lax.while_loop` that ends once every
        row's chain confidence (the product of its drafts' top-1 probabilities under the
        draft distribution; at temperature 0 the softmax of the draft logits) is below
        it, or after G-1 forwards. The positions left over get the first draft token as a
        filler with q one-hot at it: a deterministic proposal, so token and block
        verification stay exact (the filler is simply rejected unless the target agrees).

        With `reuse` (medc, whose chain reads no token; docs/medc.md; `reuse.py`):
        forward j computes the entry at position lengths-1+j. The previous step's forward
        at the same position (slot j + shift, shift = lengths-1 - its base) computed that
        entry from no token either, so the first r forwards are taken from the previous
        chain instead of run, r = min over rows of (previous valid - shift), clipped to
        0..G-1 (the batch skips a forward only if every row has it): their outputs get
        this step's tokens through the readout, and their keys and values fill the draft
        buffer's first r slots. The first draft, from h_last (the target's features),
        is never reused. The proposal is still a distribution the rule verifies, so the
        output stays the target's.
        """
        return propose_lib.propose(self, params, state, view, key, first_rank)

    def propose_tree_topk(self, params, state, view, key, topk: int, nodes: int):
        """EAGLE-2's dynamic draft tree (`trees.py`) as a `specjax.core.tree.DraftTree`
        of N = `nodes` nodes; `specjax.drafters.dynamic_tree.DynamicTree` is the loop's
        TreeDrafter around it.

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
            next frontier. A network whose chain reads no token (medc) with
            `share_tree_chain` runs one chain instead (`trees.hidden_chain`): every node
            of a depth has the same layer output, read out with its own token.
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
        return trees.propose_tree_topk(self, params, state, view, topk, nodes)

    def update(self, params, state, view, num_accepted):
        net = self.net(params)
        pos = view.positions  # [B,G+1]: old lengths-1 .. old lengths-1+G
        memory = self._memory(net, params, state.memory, view, pos)
        nxt = jnp.take_along_axis(view.tokens, jnp.minimum(pos + 1, view.tokens.shape[1] - 1),
                                  axis=1)
        out, cache = self._entries(net, params, state.cache, memory, view.hidden, pos, nxt)
        last = jnp.clip(view.lengths - 2 - pos[:, 0], 0, pos.shape[1] - 1)
        return state.replace(cache=cache, h_last=_entry_at(out, last), memory=memory)


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
