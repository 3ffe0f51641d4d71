"""The static settings of one compiled loop (`LoopConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specjax.core.sampling import SamplingParams
from specjax.decoding import kernel_policy
from specjax.decoding.loop.extension import EXTENSION, LoopExtension, extension_field
from specjax.decoding.rules import Verifier, VerifyFn, as_rule
from specjax.models.prefill import prefill_pieces

KERNEL_CHOICES = kernel_policy.LOOP_KERNELS


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """What one verify forward feeds per row, the one place its node count is computed
    (the loop's cache capacity, the cache's sharding on a mesh and the memory check read
    it): gamma G, the draft length (0: autoregressive); drafts K (1: one chain); tree_nodes:
    a tree drafter's own node budget (`specjax.core.drafter.TreeDrafter`), or None."""

    gamma: int
    drafts: int = 1
    tree_nodes: int | None = None

    @property
    def nodes(self) -> int:
        """N: the tree drafter's budget, else G + 1 for a chain and 1 + K*G for K drafts."""
        if self.tree_nodes is not None:
            return self.tree_nodes
        return self.gamma + 1 if self.drafts == 1 else 1 + self.drafts * self.gamma

    @classmethod
    def of(cls, drafter, num_drafts: int = 1, gamma: int | None = None) -> DraftShape:
        """The shape a loop verifies with this drafter (None: autoregressive, G = 0)."""
        if drafter is None:
            return cls(0 if gamma is None else gamma, num_drafts)
        own = drafter.tree_nodes if hasattr(drafter, "propose_tree") else None
        return cls(drafter.gamma if gamma is None else gamma, num_drafts, own)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of one compiled loop (a static argument of `jax.jit`).

    max_length: prompt + new tokens per row, at most (positions).
    prompt_width: Tp, the padded prompt width of the prefill (static shape).
    sampling: target (and drafter) filtering.
    eos_token_ids: tokens that stop a row (empty: only budgets stop rows).
    verify: the verification rule, a `specjax.decoding.rules.Verifier` or its name
      ("greedy", "token", "block"; a plain function fn(draft, q, p, key) -> Verdict is
      wrapped in `rules.Custom`). Stored as the rule object; `rule()` gives the one that
      runs at this sampling (greedy at temperature 0 for every lossless rule; a LOSSY rule
      such as `specjax.decoding.fly.FlyVerify` runs at temperature 0 only: ValueError
      otherwise).
    kernels: how verification runs. "off": `specjax.decoding.verify` on the filtered
      probabilities; "reference" / "pallas": `pallas_kernels.verify.verify_logits`
      straight from the target's logits, as jnp or as Pallas kernels (interpret mode on
      CPU); the two give identical output for the same seed. Top-k / top-p and custom
      rules are not fused: they take the "off" path (one log line). "pallas" also runs
      the target's attention into its KV cache in decode and verify forwards through
      `pallas_kernels.attention` (see `target_attention`); "off" and "reference" keep the
      chunked jnp attention (`specjax.models.attention`). "attention": the attention
      kernels of "pallas", verification unfused as "off" (`kernel_policy.resolve_kernels`:
      the GPU's "auto").
    pallas_backend: "auto" (Triton on GPU, Mosaic TPU layout elsewhere), "tpu" or
      "triton": the kernels' layout and compiler parameters (specjax.export sets it).
    pallas_interpret: None (interpret mode on the CPU backend only) or a bool.
    prefill_chunk: prompts wider than this many tokens are prefilled in pieces of at
      most this many (`specjax.models.prefill.scan_prompt_pieces`), each writing its K/V
      before the next attends to them, so activation memory follows the chunk, not the
      prompt. Pieces wholly past every row's prompt are skipped. None:
      `specjax.models.prefill.default_prefill_chunk()` (256 on the CPU backend, 512
      elsewhere).
    prefill_min_chunk: the smallest piece (`specjax.models.prefill.prefill_pieces`). None:
      `specjax.models.prefill.default_prefill_min_chunk(prefill_chunk)`.
    cache_sharding: None (one device, or whatever XLA propagates), or the NamedSharding of
      the target cache's k and v [L,B,K,S,H] on a mesh
      (`specjax.decoding.sharding.cache_sharding`), applied where the cache is created.
    num_drafts: K >= 1 drafts per step. K = 1: one chain of G drafts (the drafter's
      propose). K > 1: K drafts of G tokens from the same state (at temperature 0 the
      top-K first tokens, each continued greedily; above it K independent samples),
      verified as one draft tree of N = 1 + K*G nodes in one target forward with a tree
      mask (`specjax.core.tree`, `specjax.decoding.tree_verify`); the accepted path's K/V
      are compacted into place (`specjax.decoding.loop.step.compact_path`).

    exact: True: the target's forwards are batch-invariant
      (`specjax.models.invariant`): each token row is computed by the same program in a
      verify forward of G + 1 tokens as in a one-token forward, so greedy speculative
      output equals autoregressive output (exact=True too) bit for bit in any dtype, at
      the price of the rows' parallelism. With the jnp attention only ("off" or
      "reference"): ValueError with "pallas" or "attention".

    Loop extensions (`specjax.decoding.loop.extension`; None: off):
    schedule: a `specjax.decoding.adaptive.GammaSchedule`: each step picks its draft
      length from `schedule.choices` (chains only; the speculative loop then takes a cost
      table as a run-time input).
    partial: a `specjax.decoding.partial.PartialVerify`: SpecPV partial verification,
      LOSSY (chains with a fixed draft length only): past a context threshold most verify
      forwards attend to a partial KV cache, with a full verification whenever its buffer
      fills.
    """

    max_length: int
    prompt_width: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    verify: str | Verifier | VerifyFn = "block"
    kernels: str = "off"
    pallas_backend: str = "auto"
    pallas_interpret: bool | None = None
    prefill_chunk: int | None = None
    prefill_min_chunk: int | None = None
    cache_sharding: Any = None
    num_drafts: int = 1
    exact: bool = False
    schedule: Any = extension_field()
    partial: Any = extension_field()

    def __post_init__(self):
        object.__setattr__(self, "verify", as_rule(self.verify))
        if self.num_drafts < 1:
            raise ValueError(f"num_drafts={self.num_drafts} must be >= 1")
        for name in ("prefill_chunk", "prefill_min_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels={self.kernels!r}: expected one of {KERNEL_CHOICES}")
        if self.exact and self.lossy:
            raise ValueError("exact=True keeps the output identical to autoregressive "
                             "decoding: not with a lossy rule or extension")
        if self.exact and self.kernels in kernel_policy.ATTENTION_KERNELS:
            raise ValueError(f"exact=True takes the jnp attention, not kernels={self.kernels!r}"
                             " (use 'reference' or 'off')")
        self.rule()  # a rule that cannot run at this sampling raises here
        owners = [e.name for e in self.extensions() if e.owns_step]
        if len(owners) > 1:
            raise ValueError(f"loop extensions {owners} each replace the step: one at most")
        for ext in self.extensions():
            ext.check(self, None, self.num_drafts > 1)

    def extensions(self) -> tuple[LoopExtension, ...]:
        """The loop extensions that are on (fields marked `extension_field()`, set)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.metadata.get(EXTENSION) and getattr(self, f.name) is not None)

    @property
    def lossy(self) -> bool:
        """True when the rule or a loop extension is LOSSY."""
        return self.verify.lossy or any(e.lossy for e in self.extensions())

    def rule(self) -> Verifier:
        """The verification rule that runs at this sampling setting
        (`specjax.decoding.rules.Verifier.for_sampling`)."""
        return self.verify.for_sampling(self.sampling)

    def prefill_sizes(self) -> tuple[int, ...]:
        """The prefill's static piece sizes, largest first (`specjax.models.prefill.prefill_pieces`)."""
        return prefill_pieces(self.prefill_chunk, self.prefill_min_chunk)

    def fused_verify(self) -> Callable | None:
        """fn(target_logits [B,G+1,V], draft i32[B,G], q f32[B,G,V], key) -> Verdict
        through pallas_kernels.verify, or None where this config takes the "off" path."""
        return self.rule().fused(self.sampling, self.kernels, self.pallas_backend,
                                 self.pallas_interpret)

    def invariant_rows(self) -> int | None:
        """The target forwards' `invariant_rows`: the exact mode's tile
        (`specjax.models.invariant.ROWS`) with exact=True, else None."""
        from specjax.models import invariant

        return invariant.ROWS if self.exact else None

    def target_attention(self) -> Callable | None:
        """The `attention=` argument of the target's decode and verify forwards
        (`specjax.models.model.Transformer.__call__`): None (the chunked jnp
        `specjax.models.attention.cache_attention`) unless kernels is "pallas" or
        "attention", then the
        causal `pallas_kernels.attention.decode_attention` over the layer-major cache,
        read in place, whose cost follows each row's length, not the capacity. The prefill
        always takes the jnp path. With `cache_sharding` (a mesh) the jnp path runs too
        (`specjax.decoding.kernel_policy.target_attention`; decode.py says so in one line,
        `kernel_policy.describe`)."""
        return kernel_policy.target_attention(self.kernels, self.cache_sharding,
                                              self.pallas_backend, self.pallas_interpret)

    def drafter_attention(self) -> Callable | None:
        """The kernel a learned drafter attends with (its `attention` field; the `kernel`
        of `specjax.drafters.attend.attend`): None (jnp) unless kernels is "pallas" or
        "attention", then
        `pallas_kernels.attention.packed_attention`; on a mesh the jnp path
        (`specjax.decoding.kernel_policy.drafter_attention`)."""
        return kernel_policy.drafter_attention(self.kernels, self.cache_sharding,
                                               self.pallas_backend, self.pallas_interpret)

    def tree_nodes(self, gamma: int, drafter=None) -> int:
        """N, the verify forward's tokens per row (`DraftShape.nodes`): G + 1 for a chain,
        1 + K*G for K drafts, a tree drafter's own `tree_nodes`."""
        return DraftShape.of(drafter, self.num_drafts, gamma).nodes
