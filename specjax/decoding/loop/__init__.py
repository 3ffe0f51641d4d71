"""The decoding loop: static config (`config`), the carry and the result (`state`), the
prefill (`prefill`), ONE step body (`step`), the compiled programs (`programs`) and the
interface through which a mode plugs in (`extension`). docs/design.md section 3."""

from specjax.decoding.loop.config import KERNEL_CHOICES, DraftShape, LoopConfig
from specjax.decoding.loop.extension import LoopExtension, extension_field
from specjax.decoding.loop.programs import (
    PhasePrograms,
    autoregressive_loop,
    loop_phases,
    phase_programs,
    speculative_loop,
)
from specjax.decoding.loop.state import LoopResult, LoopState
from specjax.decoding.loop.step import Chain, Phases, compact_path, propose_drafts, step_phases

__all__ = ["KERNEL_CHOICES", "Chain", "DraftShape", "LoopConfig", "LoopExtension", "LoopResult",
           "LoopState", "PhasePrograms", "Phases", "autoregressive_loop", "compact_path",
           "extension_field", "loop_phases", "phase_programs", "propose_drafts",
           "speculative_loop", "step_phases"]
