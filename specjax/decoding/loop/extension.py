"""Loop extensions: how a decoding mode plugs into the one compiled loop.

A mode that needs state or counters of its own (partial verification, an adaptive draft
length, a test-only mode) is a frozen, hashable object in a `LoopConfig` field marked
`extension_field()`; the loop collects the set fields (`LoopConfig.extensions()`) and
calls their hooks. Its state lives in `LoopState.ext[name]`, its counters reach the
caller as `LoopResult.ext[name]`. Nothing else in the loop names a mode, so a new mode
is one module and one config field (tests/decoding/test_loop_extension.py shows one).

Hooks (all optional; the defaults do nothing):
  check(cfg, drafter, tree_mode)        ValueError for a combination the mode refuses
  init(model, cfg, drafter, state, inputs)
                                        its state after the prefill (`inputs`: the
                                        caller's run-time inputs for this mode, or None)
  report(ext_state)                     {name: array}: counters for LoopResult.ext
  verify_forward(...)                   replaces the target's verify forward of a chain
                                        step (`replaces_forward = True`)
  phases(graphdef, drafter, cfg, inputs)
                                        replaces the loop's (start, step) pair, e.g. to
                                        choose among several steps (`owns_step = True`)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

EXTENSION = "loop_extension"


def extension_field():
    """A `LoopConfig` field that holds a loop extension (None: the mode is off)."""
    return dataclasses.field(default=None, metadata={EXTENSION: True})


class LoopExtension:
    """Base class of loop extensions (see the module docstring). Subclasses are frozen
    dataclasses; `name` keys their state and report."""

    name: ClassVar[str] = ""
    lossy: ClassVar[bool] = False  # the mode changes what the target would have produced
    replaces_forward: ClassVar[bool] = False
    owns_step: ClassVar[bool] = False

    def check(self, cfg, drafter, tree_mode: bool) -> None:
        """Raises ValueError where this mode cannot run with cfg and drafter."""

    def init(self, model, cfg, drafter, state, inputs) -> Any:
        """The mode's state after the prefill (a pytree; None for none)."""
        return None

    def report(self, ext_state) -> dict:
        """Counters for `LoopResult.ext[name]` from the final state."""
        return {}

    def verify_forward(self, model, ext_state, s, chain, positions, capture, attention):
        """-> (logits f32[B,T,V], hidden [C,B,T,D] or None, cache, ext_state) for a chain
        step's verify forward of chain i32[B,T] at positions i32[B,T]."""
        raise NotImplementedError

    def phases(self, graphdef, drafter, cfg, inputs=None):
        """-> (start, step) replacing the loop's (`specjax.decoding.loop.programs`)."""
        raise NotImplementedError
