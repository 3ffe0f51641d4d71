"""Verification rules as objects: what the loop asks of a rule, in one protocol.

    rule = LoopConfig(...).rule()          # the rule that runs at this sampling setting
    tau, next_token = rule.chain(draft, q, logits, key, sampling)
    verify_tree = rule.tree_rule(max_depth=G, max_children=C, drafts=True)
    fused = rule.fused(sampling, kernels, backend, interpret)   # or None

A rule is a small frozen dataclass (hashable: part of `LoopConfig`, a static argument of
`jax.jit`). The arithmetic lives in `specjax.decoding.verify` (chains),
`specjax.decoding.tree_verify` (trees) and `pallas_kernels.verify` (fused): the rules here
only choose among it, so every rule is one object instead of a string switch and a set of
attribute probes.

  Greedy      accept while the draft equals the target's argmax (every lossless rule at
              temperature 0 is this one: `for_sampling`).
  TokenLevel  token-level rejection sampling (Leviathan et al. 2023, Algorithm 1); trees:
              recursive rejection over siblings (SpecInfer).
  Block       block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2); trees:
              multi-draft block verification over K independent drafts.
  Custom      a user's fn(draft, q, p, key) -> Verdict on the filtered probabilities (tests
              inject biased rules with it); no tree form, never fused.
  FlyVerify   (`specjax.decoding.fly`) LOSSY loose verification, temperature 0 only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax

from specjax.core.sampling import SamplingParams, filtered_probs
from specjax.decoding import tree_verify
from specjax.decoding.kernel_policy import FUSED_VERIFY
from specjax.decoding.verify import Verdict, verify_block, verify_greedy, verify_token

VerifyFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], Verdict]


class Verifier(Protocol):
    """A verification rule of the speculative loop.

    name: the rule's name in summaries and flags ("greedy", "token", "block", "fly", ...).
    lossy: True for a rule whose output is NOT the target's (FLy); the loop and the
      summaries say so.
    """

    name: str
    lossy: bool

    def for_sampling(self, sampling: SamplingParams) -> Verifier:
        """The rule that runs at this sampling setting: Greedy at temperature 0 for a
        lossless rule (every lossless rule is greedy there), the rule itself otherwise.
        Raises ValueError where the rule cannot run at this setting."""
        ...

    def chain(self, draft: jax.Array, q: jax.Array, logits: jax.Array, key: jax.Array,
              sampling: SamplingParams) -> Verdict:
        """One chain per row: draft i32[B,G], q f32[B,G,V] (the drafter's filtered
        distributions; unused by greedy rules), logits f32[B,G+1,V] (the target's, raw),
        key -> Verdict(num_accepted i32[B] in 0..G, next_token i32[B])."""
        ...

    def tree_rule(self, *, max_depth: int, max_children: int, drafts: bool) -> Callable:
        """fn(tree: DraftTree, p f32[B,N,V] filtered, key) -> TreeVerdict. drafts: the tree
        is K independent drafts of one drafter (`tree_from_drafts`), not a tree drafter's
        own tree. Raises ValueError for a rule with no tree form."""
        ...

    def fused(self, sampling: SamplingParams, kernels: str, backend: str,
              interpret: bool | None) -> Callable | None:
        """fn(logits f32[B,G+1,V], draft i32[B,G], q f32[B,G,V], key) -> Verdict through
        `pallas_kernels.verify`, or None where this rule takes the unfused path."""
        ...

    def fused_note(self, sampling: SamplingParams, kernels: str) -> str | None:
        """One line saying why `fused` returns None although kernels != "off" (decode.py
        prints it on stderr, `specjax.decoding.kernel_policy.describe`), else None.
        Optional: a rule without it is described by its name."""
        ...


@dataclasses.dataclass(frozen=True)
class _Lossless:
    """The three lossless rules: the chain rule on the filtered probabilities, its tree form,
    and the fused kernel path (pallas_kernels.verify) when kernels are on and no top-k /
    top-p filter is set."""

    name = ""
    lossy = False

    def for_sampling(self, sampling: SamplingParams) -> Verifier:
        return GREEDY if sampling.greedy else self

    def chain(self, draft, q, logits, key, sampling) -> Verdict:
        return self._fn(draft, q, filtered_probs(logits, sampling), key)

    def fused_note(self, sampling, kernels):
        if (kernels in FUSED_VERIFY and not sampling.greedy
                and (sampling.top_k or sampling.top_p < 1)):
            return (f"kernels={kernels}: top-k/top-p sampling has no fused verification "
                    "kernel; verifying unfused (specjax.decoding.verify)")
        return None

    def fused(self, sampling, kernels, backend, interpret):
        if kernels not in FUSED_VERIFY or self.fused_note(sampling, kernels) is not None:
            return None
        from pallas_kernels.verify import verify_logits

        rule, temperature = self.name, sampling.temperature

        def fn(logits, draft, q, key):
            return verify_logits(logits, draft, key, rule=rule, temperature=temperature,
                                 draft_probs=None if rule == "greedy" else q, impl=kernels,
                                 backend=backend, interpret=interpret)
        return fn


@dataclasses.dataclass(frozen=True)
class Greedy(_Lossless):
    name = "greedy"
    _fn = staticmethod(verify_greedy)

    def tree_rule(self, *, max_depth, max_children, drafts):
        return functools.partial(tree_verify.verify_tree_greedy, max_depth=max_depth)


@dataclasses.dataclass(frozen=True)
class TokenLevel(_Lossless):
    name = "token"
    _fn = staticmethod(verify_token)

    def tree_rule(self, *, max_depth, max_children, drafts):
        return functools.partial(tree_verify.verify_tree_token, max_depth=max_depth,
                                 max_children=max_children)


@dataclasses.dataclass(frozen=True)
class Block(_Lossless):
    name = "block"
    _fn = staticmethod(verify_block)

    def tree_rule(self, *, max_depth, max_children, drafts):
        if not drafts:
            raise ValueError("verify='block' needs K independent drafts (num_drafts); "
                             "a tree drafter's tree is verified with verify='token'")
        return functools.partial(tree_verify.verify_tree_block, max_depth=max_depth)


@dataclasses.dataclass(frozen=True)
class Custom:
    """A user's chain rule fn(draft i32[B,G], q f32[B,G,V], p f32[B,G+1,V], key) -> Verdict
    on the filtered probabilities (replaced by Greedy at temperature 0, as every lossless
    rule). No tree form; never fused (decode.py says so in one line when kernels are on)."""

    fn: VerifyFn
    name: str = "custom"
    lossy = False

    def for_sampling(self, sampling):
        return GREEDY if sampling.greedy else self

    def chain(self, draft, q, logits, key, sampling) -> Verdict:
        return self.fn(draft, q, filtered_probs(logits, sampling), key)

    def tree_rule(self, *, max_depth, max_children, drafts):
        raise ValueError(f"verify={self.fn!r} has no draft-tree form (num_drafts > 1)")

    def fused_note(self, sampling, kernels):
        if kernels not in FUSED_VERIFY:
            return None
        return f"kernels={kernels}: a custom verify rule is not fused; verifying with it unfused"

    def fused(self, sampling, kernels, backend, interpret):
        return None


GREEDY = Greedy()
RULES: dict[str, Verifier] = {"greedy": GREEDY, "token": TokenLevel(), "block": Block()}


def as_rule(verify: str | Verifier | VerifyFn) -> Verifier:
    """A rule from a name ("greedy", "token", "block"), a rule object (returned as it is)
    or a plain function (wrapped in `Custom`). Raises ValueError for another name."""
    if isinstance(verify, str):
        if verify not in RULES:
            raise ValueError(f"verify={verify!r}: expected one of {tuple(RULES)} or a rule")
        return RULES[verify]
    if hasattr(verify, "chain") and hasattr(verify, "for_sampling"):
        return verify
    if callable(verify):
        return Custom(verify)
    raise ValueError(f"verify={verify!r} is neither a rule name, a rule nor a function")
