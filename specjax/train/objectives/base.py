"""What every drafter objective shares: the frozen target pieces and the statistics."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class Frozen(NamedTuple):
    """The target's frozen pieces a drafter uses: embed [V,D], head [V,D] (the embedding
    when tied), inv_freq f32[H/2] (RoPE, llama3 scaling included)."""

    embed: jax.Array
    head: jax.Array
    inv_freq: jax.Array

    @classmethod
    def from_target(cls, target) -> Frozen:
        """From a `specjax.models.model.Transformer` (arrays as they are)."""
        embed = target.embed[...]
        head = embed if target.lm_head is None else target.lm_head[...]
        return cls(embed, head, target.inv_freq[...])


def summarize(stats: dict) -> dict:
    """Host-side metrics from summed stats: alpha (list, None where unreached), tau,
    and gate (hybrid's mean gate) when present."""
    acc = np.asarray(stats["accepted"], np.float64)
    chains = float(np.asarray(stats["chains"]))
    reached = np.concatenate([[chains], acc[:-1]])
    alpha = [float(a / r) if r > 0 else None for a, r in zip(acc, reached, strict=True)]
    out = {"alpha": alpha, "tau": 1.0 + float(acc.sum()) / chains if chains else float("nan")}
    if "correct" in stats and chains:  # per-step accuracy, not conditional on earlier steps
        out["acc"] = [float(c) / chains for c in np.asarray(stats["correct"], np.float64)]
    if "gate" in stats:
        n = float(np.asarray(stats["gate_count"]))
        out["gate"] = float(np.asarray(stats["gate"])) / n if n else float("nan")
    return out
