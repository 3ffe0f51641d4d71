"""Fused verification from logits: greedy, token-level and block verification.

`verify_logits` applies the rules of docs/design.md section 4 (greedy; Leviathan et al. 2023
token-level rejection sampling; Sun et al. 2024, arXiv 2403.10444, Algorithm 2 block
verification) to target LOGITS, without materialising the [B, G+1, V] probabilities that
`specjax.decoding.verify` takes. Two passes over the vocabulary, in tiles:

1. stats: per position the target's max and sum-exp of logits / T (greedy: its argmax);
   the draft's too when it comes as logits.
2. residuals (sampling only): for every candidate accepted length j = 0..G, the mass of
   r_j = max(c_j p_{j+1} - q_{j+1}, 0) (c_j = 1 for token-level, the block rule's
   clipped ratio w_j for block verification; q_{G+1} = 0 so r_G is the bonus
   distribution) and an exponential race that samples from r_j, plus a race over
   p_{j+1} itself for rows whose residual mass is 0.

Between them, on [B, G] arrays only: p_i(x_i) and q_i(x_i) from gathered logits, the
token rule's acceptances or the block rule's w and h, the accepted length tau, and the
next token = race winner at j = tau. One-hot drafts (n-gram and greedy drafters) read no
draft array at all.

`impl="pallas"` runs the passes as Pallas kernels (`kernel.py`; `interpret=True` on
CPU), `impl="reference"` as jnp (`reference.py`); both compute the same tile functions
(`tiles.py`) in the same order with the same randomness, so they return identical
results for the same key. Top-k / top-p are not fused: callers filter with
`specjax.decoding.verify` instead (specjax.decoding.loop does, with one log line).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.verify import kernel, reference, tiles

RULES = ("greedy", "token", "block")
DRAFT_MODES = ("probs", "logits", "onehot")
DEFAULT_TILE = 8192  # vLLM's vocabulary tile (docs/design.md section 10); clipped to V


class Verdict(NamedTuple):
    num_accepted: jax.Array  # i32[B] in 0..G
    next_token: jax.Array  # i32[B]


def pick_tile(V: int, tile: int | None = None, backend: str = "tpu") -> int:
    """The vocabulary tile: `tile` or the default (8192), never more than V rounded up to
    a multiple of 128 (backend "tpu", also the jnp reference's) or to a power of two of
    at least 128 (backend "triton": Triton's block shapes are powers of two). Raises
    ValueError on a tile that is not a positive multiple of 128 (the TPU lane width) or,
    for backend "triton", not a power of two."""
    if tile is None:
        tile = DEFAULT_TILE
    if tile <= 0 or tile % 128:
        raise ValueError(f"tile={tile} must be a positive multiple of 128")
    if backend == "triton":
        if tile & (tile - 1):
            raise ValueError(f"tile={tile} must be a power of two for the Triton backend")
        return min(tile, max(128, 1 << (V - 1).bit_length()))
    return min(tile, -(-V // 128) * 128)


def _gather(x, idx):
    return jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def verify_logits(target_logits, draft_tokens, key, *, rule="block", temperature=1.0,
                  draft_probs=None, draft_logits=None, impl="reference", tile=None,
                  interpret=None, backend="tpu") -> Verdict:
    """Accepted length and next token per row, from target logits.

    target_logits: f32 or bf16 [B, G+1, V], the target's logits at the pending token and
      the G draft tokens (row i scores position i+1; the last is the bonus position).
    draft_tokens: i32[B, G], the drafted tokens x_1..x_G.
    key: a PRNG key (unused for greedy). The same key gives the same result in both impls.
    rule: "greedy", "token" or "block"; temperature 0 means greedy whatever the rule.
    temperature: applied to target logits and to draft logits (not to draft_probs).
    draft_probs: f32[B, G, V], the drafter's filtered distributions q_1..q_G; or
    draft_logits: f32/bf16 [B, G, V] at the same temperature; neither: one-hot drafts
      (q_i = onehot(x_i), the closed-form residual of greedy and n-gram drafters).
    impl: "pallas" (kernels) or "reference" (jnp). tile: V tile (multiple of 128).
    interpret: run the Pallas kernels in interpret mode (default: on CPU).
    backend: "tpu" (Mosaic) or "triton" compiler parameters for the kernels; "auto":
      triton on the GPU backend, tpu elsewhere.
    Returns Verdict(num_accepted i32[B], next_token i32[B]).
    Raises ValueError on unknown rules/impls, mismatched shapes, or both draft inputs.
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}: expected one of {RULES}")
    if impl not in ("pallas", "reference"):
        raise ValueError(f"impl={impl!r}: expected 'pallas' or 'reference'")
    if draft_probs is not None and draft_logits is not None:
        raise ValueError("pass draft_probs or draft_logits, not both")
    B, G1, V = target_logits.shape
    G = G1 - 1
    if G < 1 or draft_tokens.shape != (B, G):
        raise ValueError(f"draft_tokens {draft_tokens.shape} must be [B, G] = [{B}, {G}] "
                         f"for target_logits {target_logits.shape} (G >= 1)")
    src = draft_probs if draft_probs is not None else draft_logits
    if src is not None and src.shape != (B, G, V):
        raise ValueError(f"draft distributions {src.shape} must be [B, G, V] = [{B}, {G}, {V}]")
    mode = "probs" if draft_probs is not None else "logits" if draft_logits is not None else "onehot"
    if backend == "auto":
        backend = "triton" if jax.default_backend() == "gpu" else "tpu"
    tile = pick_tile(V, tile, backend if impl == "pallas" else "tpu")
    greedy = rule == "greedy" or temperature == 0
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if impl == "pallas":
        kw = dict(interpret=interpret, backend=backend)
        rows = backend == "triton"
        sp, rp = ((kernel.stats_pass_rows, kernel.residual_pass_rows) if rows
                  else (kernel.stats_pass, kernel.residual_pass))
        stats_pass = lambda *a, **k: sp(*a, **k, **kw)  # noqa: E731
        residual_pass = lambda *a, **k: rp(*a, **k, **kw)  # noqa: E731
    else:
        stats_pass, residual_pass = reference.stats_pass, reference.residual_pass
    x = draft_tokens.astype(jnp.int32)

    if greedy:
        amax = stats_pass(target_logits, None, inv_t=1.0, tile=tile, greedy=True)["amax"]
        tau = jnp.sum(jnp.cumprod(x == amax[:, :G], axis=1), axis=1).astype(jnp.int32)
        return Verdict(tau, _gather(amax, tau))

    inv_t = 1.0 / float(temperature)
    st = stats_pass(target_logits, draft_logits if mode == "logits" else None,
                    inv_t=inv_t, tile=tile, greedy=False)
    lse_t = st["m_t"] + jnp.log(st["s_t"])  # [B, G+1]
    px = jnp.exp(_gather(target_logits[:, :G].astype(jnp.float32), x) * inv_t - lse_t[:, :G])
    lse_d = None
    if mode == "probs":
        qx = _gather(draft_probs.astype(jnp.float32), x)
    elif mode == "logits":
        lse_d = st["m_d"] + jnp.log(st["s_d"])
        qx = jnp.exp(_gather(draft_logits[:, :G].astype(jnp.float32), x) * inv_t - lse_d)
    else:
        qx = jnp.ones_like(px)

    k_accept, k_race = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, G))
    seeds = jax.random.bits(k_race, (B,), jnp.uint32)
    if rule == "token":
        accept = u * qx < px  # u < p/q without dividing; never accepts p(x) = 0
        tau = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
        c = jnp.ones((B, G1), jnp.float32)
    else:
        ratio = jnp.where(qx > 0, px / jnp.where(qx > 0, qx, 1.0),
                          jnp.where(px > 0, jnp.inf, 0.0))
        ws, wi = [], jnp.ones((B,), jnp.float32)
        for i in range(G):  # G is static and small: w_i = min(1, w_{i-1} * ratio_i)
            wi = jnp.minimum(1.0, wi * ratio[:, i])
            ws.append(wi)
        w = jnp.stack(ws, axis=1)  # [B, G]: w_1..w_G
        c = jnp.concatenate([jnp.ones((B, 1), jnp.float32), w], axis=1)  # w_0..w_G
    mass, _, race_idx, _, fb_idx = residual_pass(
        target_logits, src, mode=mode, x=x, lse_t=lse_t, lse_d=lse_d, c=c, seeds=seeds,
        inv_t=inv_t, tile=tile)
    if rule == "block":
        a = mass[:, 1:G]  # A_i for i = 1..G-1
        denom = a + (1.0 - w[:, :-1])
        h = jnp.where(denom > 0, a / jnp.where(denom > 0, denom, 1.0), 1.0)
        h = jnp.concatenate([h, w[:, -1:]], axis=1)  # h_G = w_G
        idx = jnp.arange(1, G + 1, dtype=jnp.int32)
        tau = jnp.max(jnp.where(u < h, idx[None, :], 0), axis=1).astype(jnp.int32)
    nxt = jnp.where(mass > 0, race_idx, fb_idx)
    return Verdict(tau, _gather(nxt, tau))


__all__ = ["Verdict", "verify_logits", "pick_tile", "tiles", "RULES", "DRAFT_MODES"]
