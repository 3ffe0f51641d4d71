"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858) as a
`specjax.core.drafter.TreeDrafter`, around any drafter with `propose_tree_topk`: the
eagle3 family (eagle3, hybrid, imported EAGLE-3 heads; `Eagle3Drafter`), kv and block.

    drafter = DynamicTree(eagle3_drafter, topk=4, nodes=32)
    speculative_loop(..., drafter, dparams, LoopConfig(..., verify="token"), ...)

Each step the inner drafter expands the top-`topk` children of the `topk` best nodes per
depth (one batched drafter forward per depth, G - 1 forwards as for one chain), reranks
every expanded candidate by its cumulative draft log-probability and keeps the best
`nodes` - 1 (`Eagle3Drafter.propose_tree_topk`; kv drafters and draft LMs build the same
rule from their own distributions; the block drafter, whose positions are independent,
keeps the exact best `nodes` - 1 prefixes instead, DDTree's best-first tree,
`specjax.core.tree.best_first_tree`); the loop verifies the tree with one
tree-masked target forward and hands the accepted path to the inner drafter's `update`.
The children of a node are deterministic (top-K), so at T > 0 the node's q is one-hot at
its token: verify with "token" (recursive rejection over siblings, exact); "block" needs
independent drafts and is refused by the loop. `stop_below` (--draft-stop) has no effect
in tree mode: every tree has G levels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.errors import SpecjaxError

_INHERIT = "inherit"  # DynamicTree.attention's default: keep the inner drafter's


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A TreeDrafter around a drafter with `propose_tree_topk` (eagle3.Eagle3Drafter,
    kv, block).

    inner: the chain drafter (its gamma G is the tree's largest depth); topk: K >= 1,
    children per expanded node and frontier width; nodes: N, the tree's node budget
    (root included), 2 <= N <= 1 + K + (G-1)*K*K (the candidates the expansion makes).
    attention: the inner drafter's attention kernel (`specjax.decoding.kernel_policy`
    replaces this field; by default the inner's own).

    Raises SpecjaxError for a drafter without a tree proposal or a K, N out of range."""

    inner: Any
    topk: int
    nodes: int
    attention: Any = _INHERIT

    def __post_init__(self):
        if not hasattr(self.inner, "propose_tree_topk"):
            raise SpecjaxError(f"--tree-topk: {type(self.inner).__name__} has no dynamic "
                               "draft tree (eagle3, hybrid, kv, block drafters and draft LMs do)")
        G, K, N = self.inner.gamma, self.topk, self.nodes
        if K < 1:
            raise SpecjaxError(f"--tree-topk {K}: must be >= 1")
        most = 1 + K + (G - 1) * K * K
        if not 2 <= N <= most:
            raise SpecjaxError(f"--tree-nodes {N}: needs 2..{most} nodes for top-{K} "
                               f"expansion to depth G={G} (1 + K + (G-1)*K*K)")
        if self.attention is _INHERIT:
            object.__setattr__(self, "attention", getattr(self.inner, "attention", None))
        elif dataclasses.is_dataclass(self.inner) and any(
                f.name == "attention" for f in dataclasses.fields(self.inner)):
            object.__setattr__(self, "inner",
                               dataclasses.replace(self.inner, attention=self.attention))

    # ------------------------------------------------------------------ delegated

    @property
    def gamma(self) -> int:
        return self.inner.gamma

    @property
    def capture(self) -> tuple[int, ...]:
        return self.inner.capture

    @property
    def sampling(self):
        return self.inner.sampling

    @property
    def cfg(self):
        """The inner drafter's DrafterConfig (the Engine shards its params by its heads)."""
        return getattr(self.inner, "cfg", None)

    @property
    def tree_nodes(self) -> int:
        return self.nodes

    @property
    def max_children(self) -> int:
        return self.topk

    def init(self, params, view, key):
        return self.inner.init(params, view, key)

    def propose(self, params, state, view, key):
        """The inner drafter's chain (the loop calls `propose_tree` instead)."""
        return self.inner.propose(params, state, view, key)

    def propose_tree(self, params, state, view, key):
        """-> (DraftTree of `nodes` nodes, depths <= G; state unchanged)."""
        return self.inner.propose_tree_topk(params, state, view, key, self.topk, self.nodes)

    def update(self, params, state, view, num_accepted):
        return self.inner.update(params, state, view, num_accepted)

    def update_after_tree(self, params, state, view, num_accepted):
        """The inner drafter's `update_after_tree` where it has one (the draft LM, whose
        proposals write its own cache), else its `update`."""
        fn = getattr(self.inner, "update_after_tree", self.inner.update)
        return fn(params, state, view, num_accepted)
