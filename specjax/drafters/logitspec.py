"""LogitSpec: a retrieval draft tree whose depth-1 guesses come from the target's logits.

LogitSpec (Liu et al., arXiv 2507.01449; code at smart-lty/LogitSpec) observes that the
logits that produced the next token also rank the token after it well: the top tokens
of the last logit, the argmax (the next token itself) left out, are guesses for the
*next-next* token. Each guess c, appended to the context, gives a sharper retrieval key
than the context alone, and the continuation of that key's latest earlier occurrence
in prompt + output becomes a draft branch. A training-free TreeDrafter
(`specjax.core.drafter.TreeDrafter`): no parameters, no target hidden states, only
the token buffer and `LoopView.logits`.

The tree (N = tree_nodes nodes per row, static; depths at most G = gamma)
-------------------------------------------------------------------------
node 0: the root, the row's pending token p.

branch 0 (nodes 1..G): the retrieval continuation of the context ending in p, G tokens:
  exactly `NgramDrafter.propose`'s draft (p repeated when nothing matches).

branch r = 1..C (in rank order): a child c_r of the root, the r-th candidate, then the
  retrieval continuation of the context ending in [p, c_r], for a branch of
  `branch_length(r)` tokens in all (c_r included): 4 if r <= 8, 3 if r <= 32, else 1
  (the authors' `get_draft_length_via_rank`), at most G. With no match the continuation
  is c_r repeated (NgramDrafter's rule on the context extended by c_r).

Nodes are laid out branch after branch (branch 0, then 1, 2, ...), each branch a chain,
so parents[i] < i. Nodes past N are dropped statically (the last branch that fits is
cut); the static layout is `LogitSpecDrafter.layout()`. Every node of the layout is
valid: a retrieval without a match is filled as NgramDrafter fills it (the last token
repeated), so branch 0 is always NgramDrafter's chain and, at temperature 0, the tree
accepts at least what prompt lookup accepts from the same state (the root's children
are distinct, so greedy verification follows the one branch whose first token is the
target's). A budget N larger than the layout is padded with invalid nodes
(`specjax.core.tree`'s convention: valid False, parent -1, depth 0, token p), never
accepted.

Candidates (init and update)
----------------------------
c_1..c_C are the top tokens of `view.logits` (the target logits the pending token was
drawn from) with the pending token p itself left out. At temperature 0, p is the argmax,
so this is the authors' "top-k excluding the argmax". Above 0, p was sampled and may be
any token; it is p (the root's own token) that is left out, and the argmax, when it was
not drawn, stays a candidate. The state keeps the top C + 1 such tokens (i32[B, C+1]);
propose_tree drops the one equal to branch 0's first token, so the root's children are
distinct, and otherwise uses the first C (branch 0's fallback p is never among them).
Ranks r count the kept candidates from 1, as the authors' index into their top-k list
does at temperature 0.

Retrieval (the "pool")
----------------------
The authors keep a dict from every n-gram (n <= 3) of prompt + output to its following
20 tokens, updated with the accepted tokens each step. Here the pool is the loop's
token buffer itself (view.tokens up to view.lengths, the pending token included), and a
lookup scans it as `specjax.drafters.ngram.NgramDrafter` does: for n = n_max down to
n_min (longest first) the latest earlier occurrence of the key's last n tokens; its
continuation is read from the buffer, repeating the matched span when it runs past the
end of the known text (periodic extrapolation). For a candidate the key is the context
extended by c_r (virtually: position lengths holds c_r). Differences from the authors'
pool, all near the end of the text: (a) their pool keeps, per n-gram, the latest
occurrence whose continuation is complete (20 tokens), an occurrence closer to the end
only when no complete one exists, and continuations stop at the end of the text; ours
takes the latest occurrence and extrapolates; (b) their pool holds only the committed
tokens before the pending one, so an occurrence ending right before p (whose
continuation would start with p) is not in it; ours includes it. Everything else (n-gram
sizes, longest first, prompt + output, kept up to date every step) is the same.

Other differences from the authors' code: their tree budget is dynamic (a candidate
with no match is a single node, so more candidates fit in their 64 tokens; the root's
branch is up to 20 tokens, and absent without a match) while ours is static: unmatched
positions still take nodes and verify compute (filled with the n-gram fallback rather
than left empty), and the root's branch is G tokens. Their candidates may repeat branch
0's first token; ours do not. They verify greedily only; here the tree is verified by
`specjax.decoding.tree_verify` at any temperature.

q: the tree is a deterministic function of the committed tokens (and of the previous
target logits, themselves a function of those tokens), so at temperature > 0 each node's
q is one-hot at its token (EAGLE's rule for deterministic children), which
`tree_verify.verify_tree_token` verifies exactly (sampling without replacement over the
root's distinct children). At temperature 0, q is None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.sampling import SamplingParams
from specjax.core.tree import DraftTree
from specjax.errors import SpecjaxError

# (largest rank, branch length) of the authors' rule; ranks past the last entry: 1.
RANK_LENGTHS = ((8, 4), (32, 3))


def branch_length(rank: int, gamma: int) -> int:
    """Tokens in candidate branch `rank` (1-based), the candidate included: 4 if rank <= 8,
    3 if rank <= 32, else 1 (LogitSpec's `get_draft_length_via_rank`), at most gamma."""
    for last, n in RANK_LENGTHS:
        if rank <= last:
            return min(n, gamma)
    return min(1, gamma)


def full_tree_nodes(gamma: int, num_candidates: int) -> int:
    """The node count that holds branch 0 and every candidate branch whole."""
    return 1 + gamma + sum(branch_length(r, gamma) for r in range(1, num_candidates + 1))


@dataclasses.dataclass(frozen=True)
class LogitSpecDrafter:
    """gamma: G, the deepest node; vocab_size: V; num_candidates: C, the logit guesses of
    the token after the pending one (the root's children besides branch 0); tree_nodes:
    N, the static node budget (root included; nodes past it are dropped); n_max, n_min:
    the retrieval n-gram sizes, longest first. See the module docstring."""

    gamma: int
    vocab_size: int
    num_candidates: int = 1
    tree_nodes: int = 8
    n_max: int = 3
    n_min: int = 1
    sampling: SamplingParams = SamplingParams()
    capture: tuple[int, ...] = ()

    reads_logits = True  # the loop passes view.logits to init and update

    def __post_init__(self):
        if self.gamma < 1:
            raise SpecjaxError(f"gamma={self.gamma} must be >= 1")
        if not 1 <= self.num_candidates <= self.vocab_size - 2:
            raise SpecjaxError(f"num_candidates={self.num_candidates} must be in 1.."
                               f"{self.vocab_size - 2} (V - 2: the pending token and "
                               "branch 0's first token are left out)")
        if self.tree_nodes < 2:
            raise SpecjaxError(f"tree_nodes={self.tree_nodes} must be >= 2")
        if not 1 <= self.n_min <= self.n_max:
            raise SpecjaxError(f"n-gram sizes n_min={self.n_min}, n_max={self.n_max}: "
                               "need 1 <= n_min <= n_max")

    @classmethod
    def create(cls, vocab_size: int, gamma: int = 4, num_candidates: int | None = None,
               tree_nodes: int = 8, sampling: SamplingParams = SamplingParams(),
               **kw) -> LogitSpecDrafter:
        """A drafter for a target of vocabulary `vocab_size`. num_candidates None: candidate
        branches until tree_nodes is filled, the last one cut if it does not fit whole
        (at G = 4 and N = 8: branch 0 and the best candidate with 2 retrieved tokens).
        The defaults (G = 4, N = 8) suit the CPU demo, where every verified node costs
        target compute: on it a 40-node tree accepts 10% more tokens per step than prompt
        lookup but runs at half its speed (docs/trees.md, "LogitSpec"). The authors'
        GPU setting is N = 64 (with a root branch of up to 20 tokens)."""
        if num_candidates is None:  # add branches until N is filled (the last may be cut)
            num_candidates = 1
            while (num_candidates + 1 <= vocab_size - 2
                   and full_tree_nodes(gamma, num_candidates) < tree_nodes):
                num_candidates += 1
        return cls(gamma, vocab_size, num_candidates=num_candidates, tree_nodes=tree_nodes,
                   sampling=sampling, **kw)

    @property
    def max_children(self) -> int:
        """The root's children: branch 0's first node and the C candidates."""
        return 1 + self.num_candidates

    def layout(self) -> tuple[tuple[int, int], ...]:
        """Static (branch, offset) of nodes 1..N-1 in node order; branch 0 is the root's
        retrieval (offset k at depth k + 1), branch r >= 1 the r-th candidate (offset 0
        the candidate, depth offset + 1). Shorter than N - 1 when the branches do not fill
        the budget (the rest are invalid nodes)."""
        nodes = [(0, k) for k in range(self.gamma)]
        for r in range(1, self.num_candidates + 1):
            nodes += [(r, k) for k in range(branch_length(r, self.gamma))]
        return tuple(nodes[:self.tree_nodes - 1])

    def _branches(self) -> int:
        """Candidate branches that have at least one node in the layout."""
        return max((b for b, _ in self.layout()), default=0)

    # ------------------------------------------------------------------ loop interface

    def init(self, params, view, key):
        return self._candidates(view)

    def update(self, params, state, view, num_accepted):
        return self._candidates(view)

    def propose(self, params, state, view, key):
        raise SpecjaxError("LogitSpecDrafter is a tree drafter: the loop calls propose_tree")

    def _candidates(self, view):
        """i32[B, C'+1] (C' the candidate branches that fit): the top tokens of view.logits
        with the pending token left out, best first."""
        if view.logits is None:
            raise SpecjaxError("LogitSpecDrafter needs view.logits (reads_logits)")
        logits = view.logits.astype(jnp.float32)
        pending = jnp.take_along_axis(view.tokens, (view.lengths - 1)[:, None], axis=1)
        V = logits.shape[-1]
        masked = jnp.where(jnp.arange(V)[None, :] == pending, -jnp.inf, logits)
        k = min(self._branches() + 1, V - 1)
        return jax.lax.top_k(masked, k)[1].astype(jnp.int32)

    def propose_tree(self, params, state, view, key):
        """-> (DraftTree of N = tree_nodes nodes, state). Reads view.tokens, view.lengths
        and the candidates in `state`; q one-hot at temperature > 0, else None."""
        tokens, lengths = view.tokens.astype(jnp.int32), view.lengths
        B, S = tokens.shape
        G, C = self.gamma, self._branches()
        pending = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
        root_cont, cand, cand_cont = self._retrieve(tokens, lengths, state, C)
        # every node's token from [root | branch 0 | branch r: c, its continuation]
        L1 = cand_cont.shape[-1] + 1  # the longest candidate branch
        src_tok = jnp.concatenate(
            [pending[:, None], root_cont,
             jnp.concatenate([cand[..., None], cand_cont], -1).reshape(B, C * L1)], 1)
        lay = self.layout()
        src = [0] + [1 + k if b == 0 else 1 + G + (b - 1) * L1 + k for b, k in lay]
        parent = [-1] + [0 if k == 0 else i for i, (b, k) in enumerate(lay)]  # node i+1 -> i
        depth = [0] + [k + 1 for _, k in lay]
        N = self.tree_nodes
        pad = N - len(src)  # budget the branches do not fill: invalid nodes
        node_tok = jnp.take(src_tok, jnp.asarray(src + [0] * pad, jnp.int32), axis=1)
        valid = jnp.broadcast_to(jnp.asarray([True] * len(src) + [False] * pad), (B, N))
        parents = jnp.broadcast_to(jnp.asarray(parent + [-1] * pad, jnp.int32), (B, N))
        depths = jnp.broadcast_to(jnp.asarray(depth + [0] * pad, jnp.int32), (B, N))
        q = None
        if not self.sampling.greedy:
            q = jax.nn.one_hot(node_tok, self.vocab_size, dtype=jnp.float32)
        return DraftTree(tokens=node_tok, parents=parents, depths=depths, valid=valid,
                         q=q), state

    # ------------------------------------------------------------------ retrieval

    def _retrieve(self, tokens, lengths, cand_all, C):
        """Branch 0's continuation and the C candidates with theirs.

        -> root_cont i32[B,G], cand i32[B,C], cand_cont i32[B,C,L1-1] (L1 the longest
        candidate branch); a retrieval without a match gives its key's last token
        repeated, as NgramDrafter."""
        B, S = tokens.shape
        G = self.gamma
        j = jnp.arange(S, dtype=jnp.int32)[None, :]
        L = lengths[:, None]
        # suf[m][b, j]: the context's last m tokens end at position j (suf[0] all True)
        suf = [jnp.ones((B, S), bool)]
        for m in range(1, self.n_max + 1):
            last = jnp.take_along_axis(tokens, jnp.maximum(lengths - m, 0)[:, None], 1)
            suf.append(suf[-1] & (jnp.roll(tokens, m - 1, axis=1) == last))
        # branch 0: NgramDrafter's rule on the context
        best = jnp.full((B,), -1, jnp.int32)
        for n in range(self.n_min, self.n_max + 1):  # longer n overrides shorter
            match = suf[n] & (j >= n - 1) & (j <= L - 2) & (L >= n)
            found = jnp.max(jnp.where(match, j, -1), axis=1).astype(jnp.int32)
            best = jnp.where(found >= 0, found, best)
        i = jnp.arange(G, dtype=jnp.int32)[None, :]
        period = jnp.maximum(lengths - 1 - best, 1)[:, None]
        idx = best[:, None] + 1 + jnp.mod(i, period)
        idx = jnp.where(best[:, None] >= 0, idx, lengths[:, None] - 1)
        root_cont = jnp.take_along_axis(tokens, jnp.clip(idx, 0, S - 1), axis=1)
        # the candidates: the first C of the state's C+1 that differ from branch 0's first
        dup = cand_all == root_cont[:, :1]
        d = jnp.where(jnp.any(dup, axis=1), jnp.argmax(dup, axis=1), cand_all.shape[1])
        r = jnp.arange(C, dtype=jnp.int32)[None, :]
        cand = jnp.take_along_axis(cand_all, r + (r >= d[:, None]), axis=1)  # [B,C]
        # a candidate's key: the context's last n-1 tokens, then c (virtually at `lengths`)
        L1 = max((branch_length(b, G) for b in range(1, C + 1)), default=1)
        if C == 0 or L1 == 1:
            return root_cont, cand, jnp.zeros((B, C, 0), jnp.int32)
        hit = tokens[:, None, :] == cand[:, :, None]  # [B,C,S]: tokens[j] == c
        best_c = jnp.full((B, C), -1, jnp.int32)
        for n in range(self.n_min, self.n_max + 1):
            before = jnp.roll(suf[n - 1], 1, axis=1)  # suf[n-1] at j - 1
            ok = (j >= n - 1) & (j <= L - 1) & (L + 1 >= n)
            match = hit & (before & ok)[:, None, :]
            found = jnp.max(jnp.where(match, j[:, None, :], -1), axis=2).astype(jnp.int32)
            best_c = jnp.where(found >= 0, found, best_c)
        k = jnp.arange(L1 - 1, dtype=jnp.int32)[None, None, :]
        period_c = jnp.maximum(lengths[:, None] - best_c, 1)[..., None]  # (L + 1) - 1 - best
        idx = best_c[..., None] + 1 + jnp.mod(k, period_c)  # in best+1 .. L
        got = jnp.take_along_axis(tokens, jnp.clip(idx, 0, S - 1).reshape(B, -1), axis=1)
        # idx == lengths is c itself; no match: c repeated
        at_c = (idx == lengths[:, None, None]) | (best_c[..., None] < 0)
        cand_cont = jnp.where(at_c, cand[..., None], got.reshape(B, C, L1 - 1))
        return root_cont, cand, cand_cont
