"""Draft LM drafter: an independent small causal LM with the target's vocabulary
(classic speculative decoding, Leviathan et al. 2023), with its own KV cache rewound
like the target's.

Cache bookkeeping: the draft cache holds valid K/V for positions 0..lengths-3 at the
start of a step (one position behind the target, because after a fully accepted
block the last draft token x_G was never fed to the drafter). Each proposal therefore
starts with a 2-token forward of the last two committed tokens at positions
lengths-2 and lengths-1 (re-writing the first, which is harmless), then G-1
single-token steps. No conditional forward is needed, and shapes stay static.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.constraints.loop import draft_logits, draft_state, row_state
from specjax.core.sampling import SamplingParams, ranked_choice, sample_logits
from specjax.core.tree import (
    DraftTree,
    ancestor_mask,
    candidate_depths,
    expand_frontier,
    tree_from_candidates,
)
from specjax.errors import SpecjaxError
from specjax.models.model import decoding_params


@dataclasses.dataclass(frozen=True)
class DraftLMDrafter:
    """graphdef: `nnx.split(draft_model)[0]` (static); params: its state (jit argument).

    Use `DraftLMDrafter.create(draft_model, gamma, sampling, target_vocab)` to get
    (drafter, params).
    """

    graphdef: nnx.GraphDef
    gamma: int
    vocab_size: int
    sampling: SamplingParams = SamplingParams()
    capture: tuple[int, ...] = ()

    @classmethod
    def create(cls, draft_model, gamma: int, sampling: SamplingParams, target_vocab: int,
               layer_loop: str = "auto"):
        """Splits `draft_model` (params laid out by `decoding_params(.., layer_loop)`);
        raises SpecjaxError if its vocabulary differs from the target's V."""
        V = draft_model.cfg.vocab_size
        if V != target_vocab:
            raise SpecjaxError(
                f"drafter vocabulary size {V} != target vocabulary size {target_vocab}; "
                "the draft LM must share the target's tokenizer"
            )
        graphdef, params = nnx.split(draft_model)
        return cls(graphdef, gamma, V, sampling), decoding_params(params, layer_loop)

    def init(self, params, view, key):
        """Prefills the draft cache with the prompts (the same padded tokens the target saw)."""
        model = nnx.merge(self.graphdef, params)
        B, T = view.positions.shape
        capacity = view.target_cache.capacity
        cache = model.init_cache(B, capacity)
        prompt = jnp.take_along_axis(view.tokens, view.positions, axis=1)
        out = model(prompt, view.positions, cache, logits_at=jnp.zeros((B, 1), jnp.int32))
        return out.cache

    def propose(self, params, state, view, key, first_rank=None):
        model = nnx.merge(self.graphdef, params)
        lengths = view.lengths
        pos0 = jnp.stack([lengths - 2, lengths - 1], axis=1)
        tok0 = jnp.take_along_axis(view.tokens, pos0, axis=1)
        out = model(tok0, pos0, state, logits_at=jnp.ones((tok0.shape[0], 1), jnp.int32))
        keys = jax.random.split(key, self.gamma)
        c = view.constraint  # masks each draft in the state its prefix reaches
        lg0 = draft_logits(c, out.logits[:, 0], row_state(c))
        x, q = sample_logits(keys[0], lg0, self.sampling)
        x, q = ranked_choice(lg0, q, x, self.sampling, first_rank)

        def step(carry, k):
            cache, tok, pos, cs = carry
            o = model(tok[:, None], pos[:, None], cache)
            nxt, probs = sample_logits(k, draft_logits(c, o.logits[:, 0], cs), self.sampling)
            return (o.cache, nxt, pos + 1, draft_state(c, cs, nxt)), (nxt, probs)

        start = (out.cache, x, lengths, draft_state(c, row_state(c), x))
        (cache, _, _, _), (xs, qs) = jax.lax.scan(step, start, keys[1:])
        draft = jnp.concatenate([x[:, None], xs.T], axis=1)  # [B,G]
        q_all = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)  # [B,G,V]
        return draft, q_all, cache

    def propose_tree_topk(self, params, state, view, key, topk: int, nodes: int):
        """EAGLE-2's dynamic draft tree (arXiv 2406.16858) from the draft LM
        (`specjax.drafters.dynamic_tree.DynamicTree` calls it), K = topk, N = nodes.

        Forward 0 is `propose`'s (the last two committed tokens) and gives depth 1: the
        top-K tokens after the pending one. The draft LM's own cache attends by slot, so
        instead of keeping draft entries beside it, forward d = 1..G-1 feeds the whole
        kept tree so far (the K frontier nodes of each depth 1..d, d*K tokens) in the
        model's tree mode (`Transformer.__call__(tree_mask=)`: each node sees the
        committed cache and its own ancestors), and reads the logits of the depth-d
        frontier: K*G*(G-1)/2 tokens over the step instead of G - 1. Each frontier node's
        top-K children (score = parent's + log q, the draft LM's distribution at
        temperature 1) are the K*K candidates of the next depth, the K best of which are
        kept. The tree is the N - 1 best candidates (`tree_from_candidates`). q: one-hot
        at each node's token above temperature 0, None at 0. `key` is unused; the state
        is returned as it was (the loop calls `update_after_tree`)."""
        del key
        model = nnx.merge(self.graphdef, params)
        G, K, lengths = self.gamma, topk, view.lengths
        B, i32 = lengths.shape[0], jnp.int32
        pos0 = jnp.stack([lengths - 2, lengths - 1], axis=1)
        tok0 = jnp.take_along_axis(view.tokens, pos0, axis=1)
        out = model(tok0, pos0, state, logits_at=jnp.ones((B, 1), i32))
        cache = out.cache
        fs, ft = jax.lax.top_k(jax.nn.log_softmax(out.logits[:, 0], axis=-1), K)
        ft = ft.astype(i32)
        V = out.logits.shape[-1]
        scores, toks, parents = [fs], [ft], [jnp.full((B, K), -1, i32)]
        fg = jnp.broadcast_to(jnp.arange(K, dtype=i32), (B, K))  # frontier's candidates
        kept_tok, kept_par = ft, jnp.full((B, K), -1, i32)  # kept nodes, depth by depth
        kept_dep = jnp.ones((K,), i32)
        start = K
        for d in range(1, G):  # static: G - 1 forwards over the kept tree
            kept = DraftTree(tokens=kept_tok, parents=kept_par,
                             depths=jnp.broadcast_to(kept_dep, kept_tok.shape),
                             valid=jnp.ones(kept_tok.shape, bool))
            frontier = jnp.broadcast_to(jnp.arange((d - 1) * K, d * K, dtype=i32), (B, K))
            o = model(kept_tok, (lengths - 1)[:, None] + kept_dep[None, :], cache,
                      tree_mask=ancestor_mask(kept, d), logits_at=frontier)
            cs, ct = jax.lax.top_k(jax.nn.log_softmax(o.logits, axis=-1), K)  # [B,K,K]
            cand, (fs, fg, ni) = expand_frontier(fs, fg, cs, ct, start)
            for acc, x in zip((scores, toks, parents), cand, strict=True):
                acc.append(x)
            ft = jnp.take_along_axis(toks[-1], ni, axis=1)
            kept_tok = jnp.concatenate([kept_tok, ft], axis=1)
            kept_par = jnp.concatenate([kept_par, (d - 1) * K + ni // K], 1)
            kept_dep = jnp.concatenate([kept_dep, jnp.full((K,), d + 1, i32)])
            start += K * K
        depth = candidate_depths(K, G)
        pending = jnp.take_along_axis(view.tokens, (lengths - 1)[:, None], axis=1)[:, 0]
        tree = tree_from_candidates(pending, jnp.concatenate(scores, 1),
                                    jnp.concatenate(toks, 1), jnp.concatenate(parents, 1),
                                    depth, nodes, None if self.sampling.greedy else V)
        return tree, state

    def update(self, params, state, view, num_accepted):
        return state.rewind(view.lengths - 2)

    def update_after_tree(self, params, state, view, num_accepted):
        """The state after a draft-tree step (`specjax.decoding.loop`): `state` is the
        one from before the step's proposals (their cache entries belong to branches the
        target may have rejected), so the accepted path is fed again: the draft model
        writes its entries for positions view.positions[:, 0] - 1 .. view.positions[:, -1]
        (one forward of G + 2 tokens), then rewinds as `update`."""
        model = nnx.merge(self.graphdef, params)
        pos = jnp.concatenate([view.positions[:, :1] - 1, view.positions], axis=1)
        toks = jnp.take_along_axis(view.tokens, jnp.minimum(pos, view.tokens.shape[1] - 1), 1)
        out = model(toks, pos, state, logits_at=jnp.zeros((toks.shape[0], 1), jnp.int32))
        return out.cache.rewind(view.lengths - 2)
