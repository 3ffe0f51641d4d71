"""A drafter whose acceptance is set by hand, for measuring the loop at a chosen tau.

With random weights (an 8B-shaped target made on a device, no checkpoint) no trained
drafter exists, and a drafter that proposes garbage runs the loop at tau = 1. The oracle
drafter knows the target's own greedy continuation (recorded by an autoregressive run of
the same prompts, `record`) and proposes it, each draft token kept with probability
`acceptance` and otherwise replaced by a wrong token ((recorded + 1) mod V). Under greedy
verification a row then accepts the drafts up to the first replaced one, so the expected
tau of a step is sum_{k=0}^{G} a^k = (1 - a^{G+1}) / (1 - a) (`expected_tau`;
`acceptance_for_tau` inverts it). Where the speculative run leaves the recorded
continuation (bf16 rounding of a G + 1-token forward flipping a near-tied argmax), its
drafts stop matching and the measured tau falls below the expected one: benchmarks
report the measured tau.

Lossless at every temperature like any drafter whose proposal is chosen independently
of the target's sampling: q is one-hot at the proposed token (docs/design.md section 4;
the n-gram drafter relies on the same fact). Proposing costs a gather and a few random
numbers, so a loop's time per step with it is the target's verify forward plus the
loop's own work: the baseline that a real drafter's cost is read against.

    a = acceptance_for_tau(4.0, gamma=7)
    drafter, params = OracleDrafter.create(prompts, completions, gamma=7, acceptance=a,
                                           vocab_size=V)
    Engine(target, drafter=drafter, drafter_params=params, ...)

The acceptance is a parameter (params["acceptance"], f32[]), not part of the static
drafter, so one compiled loop runs every tau (`with_acceptance`).

`OracleTreeDrafter` proposes the same chain inside a draft tree of `tree_nodes` nodes, the
other nodes wrong tokens hung off the chain (so a step verifies N nodes at the chain's
acceptance): the verify cost of a tree of N nodes, measured in the loop.

Test-only (benchmarks/big_round.py, tests/drafters/test_oracle.py): specjax's decoding
never builds one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import SamplingParams
from specjax.core.tree import DraftTree


def expected_tau(acceptance: float, gamma: int) -> float:
    """E[tokens per step] = sum_{k=0}^{G} a^k when each draft token is right with
    probability a independently and greedy verification stops at the first wrong one."""
    a = float(acceptance)
    return float(sum(a ** k for k in range(gamma + 1)))


def acceptance_for_tau(tau: float, gamma: int) -> float:
    """The per-token acceptance a with `expected_tau(a, gamma) == tau` (bisection; tau in
    [1, gamma + 1]). Raises ValueError outside that range."""
    if not 1.0 <= tau <= gamma + 1:
        raise ValueError(f"tau={tau} must lie in [1, gamma + 1 = {gamma + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tau(mid, gamma) < tau else (lo, mid)
    return (lo + hi) / 2


def record(prompts, completions, width: int | None = None) -> np.ndarray:
    """i32[B, W] rows prompt + completion (token ids, W = width or the longest row), padded
    with 0: token j of row b sits at the loop's token-buffer position j."""
    rows = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    W = max(width or 0, max(len(r) for r in rows))
    out = np.zeros((len(rows), W), np.int32)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


def with_acceptance(params: dict, acceptance: float) -> dict:
    """The oracle's params with another acceptance (in [0, 1]; the same compiled loop)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance={acceptance} must lie in [0, 1]")
    return {**params, "acceptance": jnp.float32(acceptance)}


def _rows(rec, B: int):
    """The recording i32[B, W] (one row [1, W] serves every row)."""
    return jnp.broadcast_to(rec, (B, rec.shape[1]))


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """gamma: G; vocab_size: V. params: {"tokens": i32[B, W] from `record` (or [1, W]:
    one recording for every row), "acceptance": f32[] the probability each draft token is
    the recorded one}."""

    gamma: int
    vocab_size: int
    sampling: SamplingParams = SamplingParams()
    capture: tuple[int, ...] = ()

    @classmethod
    def create(cls, prompts, completions, *, gamma: int, acceptance: float, vocab_size: int,
               **kw):
        """(drafter, params) for rows prompt + completion (lists of token ids)."""
        return (cls(gamma, vocab_size, **kw),
                with_acceptance({"tokens": jnp.asarray(record(prompts, completions))},
                                acceptance))

    def init(self, params, view, key):
        return ()

    def update(self, params, state, view, num_accepted):
        return state

    def _chain(self, params, view, key):
        """draft i32[B,G]: the recorded tokens after each row's pending one, each kept
        with probability `acceptance`, else (recorded + 1) mod V."""
        B = view.lengths.shape[0]
        rec = _rows(params["tokens"], B)
        W = rec.shape[1]
        idx = view.lengths[:, None] + jnp.arange(self.gamma)[None, :]
        true = jnp.take_along_axis(rec, jnp.clip(idx, 0, W - 1), axis=1)
        keep = jax.random.uniform(key, (B, self.gamma)) < params["acceptance"]
        return jnp.where(keep, true, (true + 1) % self.vocab_size).astype(jnp.int32)

    def propose(self, params, state, view, key):
        """-> draft i32[B,G], its one-hot q f32[B,G,V], state."""
        draft = self._chain(params, view, key)
        return draft, jax.nn.one_hot(draft, self.vocab_size, dtype=jnp.float32), state


def _tree_layout(gamma: int, nodes: int) -> tuple[np.ndarray, np.ndarray, int]:
    """parents, depths (i32[N]) and the most children of one node, for the chain 1..G
    plus nodes - 1 - G extra nodes, extra node e (0-based) a child of chain node e mod G
    (node 0, the root, for e mod G == 0)."""
    parents, depths = [-1] + list(range(gamma)), list(range(gamma + 1))
    for e in range(nodes - 1 - gamma):
        p = e % gamma
        parents.append(p)
        depths.append(depths[p] + 1)
    kids = np.bincount(np.asarray(parents[1:]), minlength=nodes)
    return np.asarray(parents, np.int32), np.asarray(depths, np.int32), int(kids.max())


@dataclasses.dataclass(frozen=True)
class OracleTreeDrafter(OracleDrafter):
    """OracleDrafter's chain inside a tree of tree_nodes nodes (>= G + 1): nodes 1..G are
    the chain, the others wrong tokens ((recorded + 2 + e) mod V, never the recorded
    token) hung off the chain, extra node e under chain node e mod G."""

    tree_nodes: int = 16

    def __post_init__(self):
        if self.tree_nodes < self.gamma + 1:
            raise ValueError(f"tree_nodes={self.tree_nodes} must be >= gamma + 1 = "
                             f"{self.gamma + 1}")

    @property
    def max_children(self) -> int:
        return _tree_layout(self.gamma, self.tree_nodes)[2]

    def propose_tree(self, params, state, view, key):
        """-> (DraftTree of tree_nodes nodes, q one-hot), state."""
        chain = self._chain(params, view, key)
        B = chain.shape[0]
        parents, depths, _ = _tree_layout(self.gamma, self.tree_nodes)
        extra = self.tree_nodes - 1 - self.gamma
        # an extra node under chain node p (depth d) stands for position d + 1: a token
        # other than the recorded one there (chain holds the recorded token or + 1)
        rec = _rows(params["tokens"], B)
        p = parents[self.gamma + 1:]
        pos = view.lengths[:, None] + jnp.asarray(p)[None, :]
        true = jnp.take_along_axis(rec, jnp.clip(pos, 0, rec.shape[1] - 1), axis=1)
        e = jnp.arange(extra, dtype=jnp.int32)[None, :]
        wrong = (true + 2 + e) % self.vocab_size
        tokens = jnp.concatenate([view.pending[:, None].astype(jnp.int32), chain,
                                  wrong.astype(jnp.int32)], axis=1)
        q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        q = q.at[:, 0].set(0.0)
        tree = DraftTree(tokens=tokens, parents=jnp.broadcast_to(jnp.asarray(parents),
                                                                 (B, self.tree_nodes)),
                         depths=jnp.broadcast_to(jnp.asarray(depths), (B, self.tree_nodes)),
                         valid=jnp.ones((B, self.tree_nodes), bool), q=q)
        return tree, state
