"""FLy loose verification (`--verify fly`): LOSSY, opt-in, temperature 0 only.

"Training-Free Loosely Speculative Decoding" (FLy, arXiv 2511.22972) accepts a draft token
that is not the target's argmax when the target is unsure at that position and its own
predictions agree with the draft right after it: the mismatch is read as a paraphrase,
not an error. The output is then no longer the target's greedy output; the paper reports
that at least 99% of the target's task accuracy is kept.

The rule is the one in the authors' code (AMD-AGI/FLy, `fly/models/FLy.py`: the
`enable_fly` window of `win_len` and `rej_by_entropy` with `entropy_thre`; defaults
`win_len` 6 and `entropy_thre` 0.3 in `fly_config/FLy_Llama3_70b.json`), for one chain of
G drafts:

1. native[i]: draft i equals the target's argmax at position i (each position judged on
   its own, with the target conditioned on the drafts before it, whatever they were);
2. the deferred window: a native mismatch at i becomes an acceptance when the next W - 1
   positions (i + 1 .. i + W - 1) are all native matches; the last W positions keep
   their native decision, so a flip needs i < G - W (and W <= G at all);
3. the entropy gate: H3[i] = -sum over the target's 3 most likely tokens of p log p (the
   full-vocabulary softmax at temperature 1, in nats); a mismatch with H3[i] < threshold
   (the target is sure) is always rejected;
4. the row emits the drafts up to the first position still rejected, then the target's
   argmax there (or the bonus token after G accepted drafts), as greedy verification.

vLLM's port (vllm-project/vllm#53987) checks the next W positions instead of W - 1 and also
requires a nonzero target probability; specjax follows the authors' code.

Degenerate settings are exact (tests): with threshold = inf every mismatch is rejected,
and with W > G no window fits, so both give exactly greedy verification.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.drafter import take_rows
from specjax.decoding.kernel_policy import FUSED_VERIFY
from specjax.decoding.verify import Verdict


def top_k_entropy(probs, k: int = 3):
    """f32[...]: -sum over the k largest entries of probs f32[..., V] of p log p (nats)."""
    top = jax.lax.top_k(probs.astype(jnp.float32), k)[0]
    return -jnp.sum(jnp.where(top > 0, top * jnp.log(jnp.maximum(top, 1e-38)), 0.0), axis=-1)


def fly_accept(native, entropy, window: int, threshold: float):
    """bool[B,G]: FLy's per-position decisions from native bool[B,G] (draft == target
    argmax) and entropy f32[B,G] (the target's top-3 entropy), rule steps 2-3 of the
    module docstring."""
    G = native.shape[1]
    flip = jnp.zeros_like(native)
    if 1 <= window <= G:
        starts = G - window + 1  # window start i covers i .. i + window - 1
        ok = ~native[:, :starts]
        for d in range(1, window):
            ok = ok & native[:, d:d + starts]
        flip = flip.at[:, :starts].set(ok)
        flip = flip.at[:, G - window:].set(False)  # the last W positions stay native
    accepted = native | flip
    sure = entropy < threshold
    return accepted & ~(sure & ~native)


@dataclasses.dataclass(frozen=True)
class FlyVerify:
    """The FLy rule as a verification rule of the loop (`LoopConfig.verify`, a
    `specjax.decoding.rules.Verifier`; as a function:
    __call__(draft i32[B,G], q (unused), p f32[B,G+1,V], key (unused)) -> Verdict, where
    p is the target's full softmax at temperature 1 (`probs`), not the one-hot greedy p).

    window: W (the deferred window; >= 1). threshold: the entropy gate in nats (inf:
    every mismatch rejected, i.e. greedy). top_k: tokens in the gate's entropy (3).
    LOSSY: the output is not the target's greedy output."""

    window: int = 6
    threshold: float = 0.3
    top_k: int = 3
    lossy = True

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"fly window={self.window} must be >= 1")
        if not self.threshold >= 0:
            raise ValueError(f"fly threshold={self.threshold} must be >= 0 (nats)")

    @staticmethod
    def probs(logits):
        """The p this rule reads: f32[..., V] softmax of the target's logits (T = 1)."""
        return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

    name = "fly"

    def for_sampling(self, sampling) -> FlyVerify:
        """This rule at temperature 0; ValueError above it (a lossy rule never turns into
        greedy verification, `specjax.decoding.rules.Verifier`)."""
        if not sampling.greedy:
            raise ValueError("a lossy verification rule (FLy) runs at temperature 0 only")
        return self

    def chain(self, draft, q, logits, key, sampling) -> Verdict:
        """The rule on the target's softmax at temperature 1 (`probs`), whatever the
        sampling filter (`specjax.decoding.rules.Verifier.chain`)."""
        return self(draft, q, self.probs(logits), key)

    def tree_rule(self, *, max_depth, max_children, drafts):
        raise ValueError("--verify fly (lossy) verifies one chain, not a draft tree")

    def fused_note(self, sampling, kernels):
        if kernels not in FUSED_VERIFY:
            return None
        return f"kernels={kernels}: --verify fly (lossy) has no fused kernel; verifying unfused"

    def fused(self, sampling, kernels, backend, interpret):
        return None

    def __call__(self, draft, q, p, key) -> Verdict:
        del q, key
        G = draft.shape[1]
        target = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [B,G+1]
        native = draft == target[:, :G]
        keep = fly_accept(native, top_k_entropy(p[:, :G], self.top_k), self.window,
                          self.threshold)
        tau = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
        nxt = take_rows(target, tau)
        return Verdict(tau, nxt)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How close lossy outputs are to the lossless ones, prompt by prompt:
    {"prefix_tokens": mean tokens before the first difference, "token_agreement": the
    fraction of the reference's positions where both hold the same token,
    "identical_rows": rows that are equal}."""
    prefix, same, total, rows = [], 0, 0, 0
    for o, r in zip(outputs, reference, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), min(len(o), len(r)))
        prefix.append(n)
        same += sum(a == b for a, b in zip(o, r, strict=False))
        total += max(len(r), 1)
        rows += o == r
    return {"prefix_tokens": sum(prefix) / max(len(prefix), 1),
            "token_agreement": same / max(total, 1), "identical_rows": rows}
