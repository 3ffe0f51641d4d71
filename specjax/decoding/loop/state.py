"""What the compiled loop carries (`LoopState`) and returns (`LoopResult`).

The array fields carry jaxtyping shape annotations (docs/design.md section 2's letters;
S for the token buffer's width S', equal to the cache capacity, since jaxtyping takes
identifiers). They are documentation: nothing checks them at run time in the library;
tests/core/test_shapes.py checks real values against them."""

# ruff: noqa: F722  (jaxtyping's shape strings are not Python expressions)

from __future__ import annotations

from typing import Any

from flax import struct
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from specjax.models.kv_cache import KVCache


@struct.dataclass
class LoopState:
    """The loop's carry: fixed-size buffers (gemma's sampler is the template).

    tokens i32[B,S'] prompt + output; lengths i32[B] committed tokens (tokens[b,
    lengths-1] is pending: its target K/V is not cached yet); prompt_lengths, budgets
    i32[B] (max new tokens); done bool[B]; cache: the target KVCache (positions
    0..lengths-2 valid); drafter_state: the drafter's own pytree; key: the PRNG key;
    steps i32[B] target forwards after the prefill while the row was active; accepted
    i32[B,G] accepted draft tokens per draft position; reached i32[B,G] steps that
    drafted position k with drafts < k accepted; ext: {name: state} of the loop
    extensions that are on (`specjax.decoding.loop.extension`); constraint: the rows'
    `specjax.constraints.loop.Constraint` (tables and each row's automaton state after
    its committed tokens), or None."""

    tokens: Int[Array, "B S"]
    lengths: Int[Array, " B"]
    prompt_lengths: Int[Array, " B"]
    budgets: Int[Array, " B"]
    done: Bool[Array, " B"]
    cache: KVCache
    drafter_state: Any
    key: PRNGKeyArray
    steps: Int[Array, " B"]
    accepted: Int[Array, "B G"]
    reached: Int[Array, "B G"]
    ext: dict = struct.field(default_factory=dict)
    constraint: Any = None


@struct.dataclass
class LoopResult:
    """tokens i32[B,S']; lengths, prompt_lengths i32[B]; steps i32[B]; accepted,
    reached i32[B,G] (alpha_k = accepted[k] / reached[k]); ext: {extension name: {counter:
    array}} from the loop extensions that were on (`LoopExtension.report`: e.g.
    ext["adaptive"]["chosen"], ext["partial"]["verified"]); drafter: {counter: array}
    from the drafter's own `report(state)` where it has one (e.g. medc's draft reuse,
    drafter["reused"], `specjax.drafters.eagle3.DraftChain.counts`)."""

    tokens: Int[Array, "B S"]
    lengths: Int[Array, " B"]
    prompt_lengths: Int[Array, " B"]
    steps: Int[Array, " B"]
    accepted: Int[Array, "B G"]
    reached: Int[Array, "B G"]
    ext: dict = struct.field(default_factory=dict)
    drafter: dict = struct.field(default_factory=dict)


def result(s: LoopState, cfg, drafter=None) -> LoopResult:
    """The caller's view of the final state: the buffers, the extensions' reports and the
    drafter's report (`specjax.core.drafter.drafter_report`)."""
    from specjax.core.drafter import drafter_report

    ext = {e.name: e.report(s.ext[e.name]) for e in cfg.extensions() if e.name in s.ext}
    counts = {} if drafter is None else drafter_report(drafter, s.drafter_state)
    return LoopResult(s.tokens, s.lengths, s.prompt_lengths, s.steps, s.accepted, s.reached,
                      ext, counts)
