"""DFlash-style parallel block drafter (z-lab/dflash; docs/design.md section 5): ONE forward
drafts all G tokens.

The block is [pending token, G mask tokens] at positions lengths-1 .. lengths-1+G (the
mask token's embedding is a frozen target row). Every layer attends, non-causally, to
its own block and to a context of committed positions strictly before the pending one:

  hidden: ctx = hidden_norm(fc(target features at Ld depths)); layer l projects it with
          its own k/v projections (k_norm, RoPE at the context's positions) (DFlash);
  kv:     the merged target KV memory M_l of the kv drafter (KVShot's conjecture: KV
          reuse trained block-wise);
  both:   both sources, concatenated along S.

Logits at block positions 1..G are the draft distributions (each position sampled on its
own: q_k does not depend on x_<k, which keeps the verifiers lossless), or, with DFlash2's
path selector (`selector_rank` > 0, `specjax.drafters.selector`), the chain is chosen left
to right among each position's top-K candidates with q_k conditioned on x_{k-1}; with
DSpark's Markov head (`markov_rank` > 0, `specjax.drafters.markov`) the chain is drafted
left to right from the logits corrected by x_{k-1}. DSpark's layout (`sample_from_anchor`):
the block is [pending token, G-1 mask tokens] and all G slots draft (slot k the token after
position lengths-1+k). DSpark's confidence head gives each draft's predicted acceptance
(`BlockDrafter.confidence`). Decoding state:
the context K/V of committed positions, [Ld,B,K,S,H] per source, extended per
verification for the newly committed positions only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.core.drafter import AttentionKernel
from specjax.core.sampling import ranked_choice, sample_logits
from specjax.core.tree import best_first_path_tree, best_first_tree
from specjax.drafters import conv, markov, registry, selector
from specjax.drafters.attend import Blocks, Limit, attend, windowed
from specjax.drafters.config import CONTEXTS, DrafterConfig, evenly_spaced_layers, kv_layer_set
from specjax.drafters.learned import LearnedDrafter
from specjax.drafters.memory import memory_from_target, memory_update, merge_init, scatter_positions
from specjax.drafters.weights import (
    layer_out,
    layer_params,
    layer_qkv,
    layer_weights,
    normal,
    ones,
    zeros,
)
from specjax.errors import SpecjaxError
from specjax.models import layers
from specjax.models.kv_cache import KVCache
from specjax.models.matmul import linear


class BlockNet(nnx.Module):
    """Ld layers (weights.layer_weights), final_norm [D]; context hidden/both adds fc
    [D,C*D] and hidden_norm [D]; kv/both adds merge_k/merge_v [Ld,K*H,Ls*K*H]; a path
    selector (selector_rank R > 0) adds sel_pred, sel_succ [V,R] and sel_proj [D,R];
    DFlash2's convolution (conv_kernel_size T > 0, `specjax.drafters.conv`) adds
    attn_conv_base, mlp_conv_base [Ld,2,T,D] and attn_conv_proj, mlp_conv_proj
    [Ld,2*T*D/g,D]; DSpark's Markov head (markov_rank R > 0, `specjax.drafters.markov`)
    adds markov_w1, markov_w2 [V,R] (W2 zero-initialised: a new head ranks as the block
    does), gated markov_gate [R,D+R] and markov_gate_bias [R], rnn markov_joint
    [3R,2R+D] and markov_joint_bias [3R]; its confidence head adds conf_proj [1,D(+R)]
    and conf_bias [1]."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.cfg, self.dtype = cfg, dtype
        for name, p in layer_weights(cfg, rngs, dtype, cfg.num_layers).items():
            setattr(self, name, p)
        if cfg.uses_hidden:
            self.fc = normal(rngs, (D, len(cfg.capture) * D), dtype)
            self.hidden_norm = ones((D,), dtype)
        if cfg.uses_kv:
            self.merge_k, self.merge_v = merge_init(cfg, dtype)
        self.final_norm = ones((D,), dtype)
        if cfg.selector_rank:
            R, V = cfg.selector_rank, cfg.vocab_size
            self.sel_pred = normal(rngs, (V, R), dtype)
            self.sel_succ = zeros((V, R), dtype)  # a new selector ranks as the block does
            self.sel_proj = normal(rngs, (D, R), dtype)
        if cfg.conv_kernel_size:
            for name, p in conv.conv_weights(cfg, dtype).items():
                setattr(self, name, p)
        if cfg.markov_rank:
            R, V = cfg.markov_rank, cfg.vocab_size
            self.markov_w1 = normal(rngs, (V, R), dtype)
            self.markov_w2 = zeros((V, R), dtype)
            if cfg.markov_head_type == "gated":
                self.markov_gate = normal(rngs, (R, D + R), dtype)
                self.markov_gate_bias = zeros((R,), dtype)
            elif cfg.markov_head_type == "rnn":
                self.markov_joint = normal(rngs, (3 * R, 2 * R + D), dtype)
                self.markov_joint_bias = zeros((3 * R,), dtype)
        if cfg.confidence_head:
            width = D + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.conf_proj = normal(rngs, (1, width), dtype)
            self.conf_bias = zeros((1,), dtype)

    def layout(self, gamma: int) -> tuple[int, int]:
        """(slots, first): a block drafting `gamma` tokens has `slots` positions, of which
        slots first.. draft (DFlash: G+1 and 1; DSpark's sample_from_anchor: G and 0)."""
        return (gamma, 0) if self.cfg.sample_from_anchor else (gamma + 1, 1)

    def markov(self) -> markov.Head | None:
        """DSpark's Markov head, or None without one."""
        c = self.cfg
        if not c.markov_rank:
            return None
        get = {n: getattr(self, n)[...] for n in ("markov_gate", "markov_gate_bias",
                                                   "markov_joint", "markov_joint_bias")
               if hasattr(self, n)}
        return markov.Head(c.markov_head_type, self.markov_w1[...], self.markov_w2[...],
                           get.get("markov_gate"), get.get("markov_gate_bias"),
                           get.get("markov_joint"), get.get("markov_joint_bias"))

    def confidence_logits(self, h, prev):
        """f32[...,G]: DSpark's confidence logits of draft positions with final-normed
        outputs h [...,G,D] and predecessors prev i32[...,G]."""
        c = self.cfg
        e = markov.prev_embedding(self.markov(), prev) if c.confidence_head_with_markov \
            else None
        return markov.confidence_logits(self.conf_proj[...], self.conf_bias[...], h, e)

    def selector(self):
        """(pred, succ, proj) of the path selector, or None without one."""
        if not self.cfg.selector_rank:
            return None
        return self.sel_pred[...], self.sel_succ[...], self.sel_proj[...]

    def final_hidden(self, out):
        """The final-normed outputs [...,D] the selector reads."""
        return layers.rms_norm(out, self.final_norm[...], self.cfg.rms_norm_eps)

    def logits(self, out, head):
        """f32[...,V]: head(final_norm(out)), times output_multiplier, then softcapped
        (tanh(l / c) * c) when final_logit_softcapping c > 0 (DFlash2's compute_logits)."""
        c = self.cfg
        lg = layers.logits(out, self.final_norm[...], head, c.rms_norm_eps)
        if c.output_multiplier != 1.0:
            lg = lg * jnp.float32(c.output_multiplier)
        if c.final_logit_softcapping > 0:
            cap = jnp.float32(c.final_logit_softcapping)
            lg = jnp.tanh(lg / cap) * cap
        return lg

    def hidden_context(self, hidden, positions, inv_freq):
        """Per-layer context K/V from target features hidden [C,B,T,D] at `positions`
        [B,T]: (k, v) each [Ld,B,K,T,H]."""
        C, B, T, D = hidden.shape
        flat = hidden.transpose(1, 2, 0, 3).reshape(B, T, C * D)
        ctx = layers.rms_norm(linear(flat, self.fc[...]), self.hidden_norm[...],
                              self.cfg.rms_norm_eps)
        cos, sin = layers.rope_cos_sin(inv_freq, positions, self.dtype)
        c = self.cfg
        ks, vs = [], []
        for i in range(c.num_layers):  # DFlash's context projections, cache layout
            k, v = layers.kv(layer_params(self, i), ctx, cos, sin, c.rms_norm_eps,
                             c.num_kv_heads, c.head_dim)
            ks.append(k.swapaxes(1, 2))
            vs.append(v.swapaxes(1, 2))
        return jnp.stack(ks), jnp.stack(vs)

    def memory_context(self, kv, positions, inv_freq):
        """Per-layer merged memories from target K/V kv = (k, v) [Ls,B,K,T,H] at
        `positions` [B,T]: (k, v) each [Ld,B,K,T,H]."""
        cos, sin = layers.rope_cos_sin(inv_freq, positions, self.dtype)
        return memory_from_target(self, self.cfg, kv[0], kv[1], cos, sin)

    def contexts(self, hidden, kv, positions, inv_freq):
        """The context sources this drafter reads, each (k, v) [Ld,B,K,T,H]."""
        out = []
        if self.cfg.uses_hidden:
            out.append(self.hidden_context(hidden, positions, inv_freq))
        if self.cfg.uses_kv:
            out.append(self.memory_context(kv, positions, inv_freq))
        return out

    def blocks(self, contexts, anchors, tokens, embed, inv_freq, gamma: int,
               kernel: AttentionKernel | None = None):
        """Packed training blocks (DFlash; docs/design.md section 6): block j of row b is
        [tokens[b, anchors[b,j]], G mask tokens] at positions anchor .. anchor+G (with
        sample_from_anchor, DSpark's, G-1 mask tokens: anchor .. anchor+G-1); it sees
        context positions strictly before its anchor and its own block (bidirectional).

        Args:
          contexts: context sources (k, v) [Ld,B,K,T,H] at positions 0..T-1.
          anchors: i32[B,A] anchor positions; tokens: i32[B,T].
          kernel: the attention kernel of `attend` (`specjax.decoding.kernel_policy`; None: jnp).
        Returns: outputs [B,A,S,D] (pre-norm), S = `layout(G)`'s slots; slot first + k
          (k = 0..G-1) predicts the token at anchor + k + 1.
        """
        B, A = anchors.shape
        S, _ = self.layout(gamma)
        pos = (anchors[:, :, None] + jnp.arange(S, dtype=jnp.int32)).reshape(B, -1)
        first = jnp.take_along_axis(tokens, anchors, axis=1)[:, :, None]
        blk = jnp.concatenate([first, jnp.full((B, A, S - 1), self.cfg.mask_token_id,
                                               jnp.int32)], axis=2).reshape(B, -1)
        anchor_q = jnp.repeat(anchors, S, axis=1)  # [B,Q]
        ctx_mask = Limit(anchor_q - 1)  # context strictly before the anchor
        out = self.run_block(blk, pos, [(c, ctx_mask) for c in contexts], S, embed,
                             inv_freq, kernel)
        return out.reshape(B, A, S, -1)

    def run_block(self, tokens, positions, contexts, block_size: int, embed, inv_freq,
                  kernel: AttentionKernel | None = None):
        """The block forward.

        Args:
          tokens, positions: i32[B,Q] block tokens (anchor token, then mask ids) and
            their positions (several blocks may be packed along Q).
          contexts: list of ((k, v) [Ld,B,K,S,H], mask) context sources, mask a bool[B,Q,S]
            or a `Limit`.
          block_size: G+1: Q holds Q / block_size blocks, each query sees every entry of
            its own block (`Blocks`); DFlash2's convolution runs along each block.
          embed: [V,D]; inv_freq: f32[H/2].
          kernel: the attention kernel of `attend` (None: jnp).
        Returns: outputs [B,Q,D] (pre-norm).
        """
        c = self.cfg
        if any(0 < w < block_size for w in c.sliding_windows):
            raise SpecjaxError(f"a block of {block_size} positions does not fit the drafter's "
                               f"sliding windows {list(c.sliding_windows)}; use a smaller gamma")
        x = jnp.take(embed, tokens, axis=0)
        cos, sin = layers.rope_cos_sin(inv_freq, positions, self.dtype)
        for i in range(c.num_layers):
            sources = [(kv[0][i], kv[1][i], _in_window(mask, positions, c.window(i)))
                       for kv, mask in contexts]
            if c.conv_kernel_size:
                x = self._conv_layer(i, x, cos, sin, sources, block_size, kernel)
                continue
            q, k, v = layer_qkv(self, i, x, cos, sin)
            sources.append((k, v, Blocks(block_size, c.block_causal)))
            x = layer_out(self, i, x, attend(q, sources, kernel=kernel))
        return x

    def _conv_layer(self, i, x, cos, sin, sources, block_size, kernel):
        """Layer i with DFlash2's convolution around its attention and its MLP
        (`specjax.drafters.conv`): x + c(attention(c(norm(x)))), then the same for the MLP."""
        c, w = self.cfg, layer_params(self, i)
        eps, g = c.rms_norm_eps, c.conv_group_size

        def attention(h):
            q, k, v = layers.qkv(w, h, cos, sin, eps, c.num_heads, c.num_kv_heads, c.head_dim)
            out = attend(q, [*sources, (k, v, Blocks(block_size, c.block_causal))],
                         kernel=kernel)
            return layers.attention_proj(w, out)

        (ab, ap), (mb, mp) = (tuple(getattr(self, n)[i] for n in names)
                              for names in (conv.ATTN, conv.MLP))
        x = x + conv.wrap(layers.rms_norm(x, w["input_norm"], eps), ab, ap, g, block_size,
                          attention)
        return x + conv.wrap(layers.rms_norm(x, w["post_norm"], eps), mb, mp, g, block_size,
                             lambda h: layers.swiglu(w, h))


def _in_window(mask, positions, window: int):
    """A context mask (bool[B,Q,S] or `Limit`) narrowed to a layer's sliding window: the
    query at position p sees slot s only if p - s < window (0: unchanged)."""
    if not window:
        return mask
    lo = jnp.maximum(positions - (window - 1), 0).astype(jnp.int32)  # [B,Q]
    if isinstance(mask, Limit):
        return Limit(mask.pos, lo if mask.lo is None else jnp.maximum(mask.lo, lo))
    return mask & (jnp.arange(mask.shape[-1])[None, None, :] >= lo[:, :, None])


@struct.dataclass
class BlockState:
    hidden: KVCache | None  # context K/V from target features [Ld,B,K,S,H]
    memory: KVCache | None  # merged target K/V [Ld,B,K,S,H]


@dataclasses.dataclass(frozen=True)
class BlockDrafter(LearnedDrafter):
    """Loop adapter for BlockNet; fields and params as learned.LearnedDrafter."""

    def _extend(self, net, params, state: BlockState, view) -> BlockState:
        hidden, memory = state.hidden, state.memory
        pos = view.positions
        if hidden is not None:
            k, v = net.hidden_context(view.hidden, pos, params["inv_freq"])
            hidden = hidden.replace(k=scatter_positions(hidden.k, k, pos[:, 0]),
                                    v=scatter_positions(hidden.v, v, pos[:, 0]))
        if memory is not None:
            memory = memory_update(net, self.cfg, memory, view.target_cache, pos,
                                   params["inv_freq"])
        return BlockState(hidden, memory)

    def init(self, params, view, key):
        net = self.net(params)
        c = self.cfg
        empty = self.empty_cache(c.num_layers, view, net.dtype)
        state = BlockState(empty if c.uses_hidden else None, empty if c.uses_kv else None)
        return self._extend(net, params, state, view)

    def block_logits(self, params, state, view):
        """f32[B,G,V]: the draft logits of block positions 1..G (one forward)."""
        return self.block_outputs(params, state, view)[1]

    def block_outputs(self, params, state, view):
        """(outputs [B,G,D] pre-norm, logits f32[B,G,V]) of the G draft slots: block
        positions 1..G, or 0..G-1 with DSpark's sample_from_anchor (`BlockNet.layout`)."""
        net = self.net(params)
        G, B = self.gamma, view.lengths.shape[0]
        S, first = net.layout(G)
        offsets = jnp.arange(S, dtype=jnp.int32)
        pos = (view.lengths - 1)[:, None] + offsets[None, :]  # [B,S]
        pending = jnp.take_along_axis(view.tokens, pos[:, :1], axis=1)
        tokens = jnp.concatenate(
            [pending, jnp.full((B, S - 1), self.cfg.mask_token_id, jnp.int32)], axis=1)
        contexts = []
        for cache in (state.hidden, state.memory):
            if cache is not None:
                # context strictly before the anchor, read up to the longest row only
                visible = windowed(jnp.broadcast_to(pos[:, :1] - 1, (B, S)), self.window)
                contexts.append(((cache.k, cache.v), visible))
        out = net.run_block(tokens, pos, contexts, S, params["embed"],
                            params["inv_freq"], self.attention)[:, first:]
        return out, self.logits(net, out, params)  # [B,G,D], [B,G,V]

    @property
    def has_confidence(self) -> bool:
        """The drafter has DSpark's confidence head (`confidence`; the protocol flag a
        confidence schedule checks, `specjax.decoding.adaptive`)."""
        return self.cfg.confidence_head

    def confidence(self, params, state, view, draft):
        """f32[B,G]: DSpark's predicted acceptance of each draft position, sigmoid of the
        confidence head at that position's output, given the drafts before it (draft
        i32[B,G], this step's `propose`; the pending token before the first). Reads the
        drafter's own params and state and view.tokens/lengths; runs the block forward
        again (the same computation as `propose`'s, which XLA may share inside one
        program). Raises ValueError for a drafter without a confidence head."""
        if not self.cfg.confidence_head:
            raise ValueError("this block drafter has no confidence head (DSpark's "
                             "confidence_head)")
        out, _ = self.block_outputs(params, state, view)
        net = self.net(params)
        prev = markov.predecessors(view.pending, draft)
        return jax.nn.sigmoid(net.confidence_logits(net.final_hidden(out), prev))

    def propose(self, params, state, view, key, first_rank=None):
        out, logits = self.block_outputs(params, state, view)
        net = self.net(params)
        if net.selector() is not None:  # DFlash2: the chain left to right, q_k | x_{k-1}
            if first_rank is not None:
                raise ValueError("a block drafter with a path selector drafts one chain: "
                                 "--num-drafts must be 1")
            draft, q = selector.draft_chain(*net.selector(), self.cfg.selector_top_k,
                                            net.final_hidden(out), logits, view.pending,
                                            key, self.sampling, view.constraint)
            return draft, q, state
        if net.markov() is not None:  # DSpark: the chain left to right, q_k | x_{k-1}
            if first_rank is not None:
                raise ValueError("a block drafter with a Markov head drafts one chain: "
                                 "--num-drafts must be 1")
            draft, q = markov.draft_chain(net.markov(), net.final_hidden(out), logits,
                                          view.pending, key, self.sampling, view.constraint)
            return draft, q, state
        keys = jax.random.split(key, self.gamma)
        if view.constraint is not None:  # left to right: each position masked in the
            return (*constrained_block(view.constraint, logits, keys, self.sampling,  # state
                                       first_rank), state)  # the drafts before it reach
        draft, q = jax.vmap(lambda k, lg: sample_logits(k, lg, self.sampling),
                            in_axes=(0, 1), out_axes=(1, 1))(keys, logits)
        if first_rank is not None:  # only the first position's token changes
            x, q1 = ranked_choice(logits[:, 0], q[:, 0], draft[:, 0], self.sampling, first_rank)
            draft, q = draft.at[:, 0].set(x), q.at[:, 0].set(q1)
        return draft, q, state

    def propose_tree_topk(self, params, state, view, key, topk: int, nodes: int):
        """A draft tree from one block forward (`specjax.drafters.dynamic_tree.DynamicTree`
        calls it), DDTree's (`specjax.core.tree.best_first_tree`): of all prefixes
        x_1..x_d (d <= G) whose tokens are each among the top-K of their position, the
        N - 1 of highest sum_k log q_k(x_k), with the block's per-position distributions
        at temperature 1 (log_softmax of the draft logits; position k's does not depend
        on the tokens before it, the block was drafted from mask tokens), found by a
        best-first search of N - 1 pops. q: one-hot at each node's token above
        temperature 0 (deterministic choices), None at 0. `key` is unused.

        With DFlash2's path selector a child's distribution depends on its parent's token:
        the same search over the selector's distributions (log_softmax of its K scores
        given the parent, `selector.children`; `specjax.core.tree.best_first_path_tree`).
        Raises ValueError for a Markov head (DSpark: one chain)."""
        del key
        if self.cfg.markov_rank:
            raise ValueError("a block drafter with a Markov head drafts one chain: "
                             "--tree-topk is not supported")
        if self.cfg.selector_rank:
            out, logits = self.block_outputs(params, state, view)
            net = self.net(params)
            children = selector.children(*net.selector(), topk, net.final_hidden(out), logits)
            tree = best_first_path_tree(view.pending, children, self.gamma, topk, nodes,
                                        None if self.sampling.greedy else logits.shape[-1])
            return tree, state
        logp = jax.nn.log_softmax(self.block_logits(params, state, view), axis=-1)
        # [B,G,K] per position, best first (behind a barrier: `selector.top_candidates`)
        ls, lt = jax.lax.optimization_barrier(jax.lax.top_k(logp, topk))
        tree = best_first_tree(view.pending, ls, lt, nodes,
                               None if self.sampling.greedy else logp.shape[-1])
        return tree, state

    def update(self, params, state, view, num_accepted):
        net = self.net(params)
        return self._extend(net, params, state, view)


class BlockKind(registry.DrafterKind):
    """block (DFlash-style): Ld = 2 layers by default; context "hidden" (Ld evenly spaced
    layer outputs), "kv" (merged target K/V of Ls layers) or "both"; a mask token (the
    target's pad id by default); block-wise training."""

    name, network, adapter, objective = "block", BlockNet, BlockDrafter, "block"
    settings = {"context": CONTEXTS, "mask_token_id": None}
    default_num_layers = 2

    def defaults(self, target, opts):
        L, context = target.num_layers, opts["context"] or "hidden"
        capture, kv_layers = (), ()
        if context in ("hidden", "both"):
            capture = tuple(i + 1 for i in evenly_spaced_layers(L, opts["num_layers"]))
        if context in ("kv", "both"):
            kv_layers = kv_layer_set(L, opts["num_kv_layers"])
        mask = opts["mask_token_id"]
        if mask is None:
            mask = target.pad_token_id if target.pad_token_id is not None else 0
        return {"capture": capture, "kv_layers": kv_layers, "context": context,
                "mask_token_id": mask}

    def validate(self, cfg):
        if cfg.context not in CONTEXTS:
            raise SpecjaxError(f"block drafter context {cfg.context!r}; use one of "
                               f"{CONTEXTS}")
        if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise SpecjaxError(f"block drafter mask_token_id={cfg.mask_token_id} must be "
                               f"a token id in [0, {cfg.vocab_size})")

    def uses_hidden(self, cfg):
        return cfg.context in ("hidden", "both")

    def uses_kv(self, cfg):
        return cfg.context in ("kv", "both")

    def state_layers(self, cfg):
        return cfg.num_layers * (2 if cfg.context == "both" else 1)


registry.register(BlockKind())


def constrained_block(constraint, logits, keys, sampling, first_rank=None):
    """A block's chain under a constraint (`specjax.constraints.loop`): position k drawn
    from its logits masked in the state x_1..x_{k-1} reach, so q_k depends on the drafts
    before it through that state only and the chain is an autoregressive proposal.
    logits f32[B,G,V]; keys [G]. -> (draft i32[B,G], q f32[B,G,V])."""
    cs, draft, qs = constraint.state, [], []
    for k in range(logits.shape[1]):  # static G
        lg = constraint.mask(logits[:, k], cs)
        x, q = sample_logits(keys[k], lg, sampling)
        if k == 0:
            x, q = ranked_choice(lg, q, x, sampling, first_rank)
        draft.append(x)
        qs.append(q)
        cs = constraint.step(cs, x)
    return jnp.stack(draft, 1), jnp.stack(qs, 1)
