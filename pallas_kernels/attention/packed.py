"""Packed attention for training layouts: every query has its own key limit.

`packed_attention(q, k, v, limit)` attends query t of row b over the key slots
s < limit[b, t] and returns the output AND its log-sum-exp, so that a caller can merge
it with other (small) attention sources by log-sum-exp in jnp. The layouts it serves:

- TTT training of EAGLE-3 drafters: queries at T positions, keys of the same positions,
  limit[b, t] = t + 1 (causal).
- Block-wise (DFlash) training: A blocks of G+1 positions packed into T = A*(G+1)
  queries, keys = the context of the sequence, limit = the anchor of the query's block
  (the block's own keys are the caller's second source).
- Inference: a few queries (T = 1..17) into a drafter's own cache of S slots.

The algorithm is flash attention 2 (Dao 2023) with per-query prefix masks and
flash-decoding's tile skipping: the forward is an online softmax over S tiles, S tiles
past a query tile's largest limit are skipped (cost follows the limits, not S), and the
backward runs the two flash-attention kernels (dq over S tiles; dk/dv over the query
tiles that see the S tile) from the saved log-sum-exp. Nothing of size [T, S] is
materialised in HBM, forward or backward. See `packed_kernel` for the kernels (TPU:
Mosaic with scalar prefetch; GPU: Triton) and `packed_reference` for the jnp reference.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import packed_kernel
from pallas_kernels.attention.packed_kernel import Plan
from pallas_kernels.attention.packed_reference import check_args, packed_attention_reference

BACKENDS = ("tpu", "triton")
IMPLS = ("pallas", "reference")
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_S = 128
# triton: the most bytes of one query tile and one key tile, (bq + bs) * H * itemsize, per
# itemsize, so that the kernels fit a GPU's shared memory (227 KiB per block on H100);
# f32 tiles need about twice the room of bf16 tiles of the same bytes
# (`scripts/device_round.sh` compiles both: step packed_check).
TRITON_TILE_BYTES = {2: 64 * 1024, 4: 32 * 1024}


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, int(2 ** np.ceil(np.log2(max(n, 1)))))


def pick_blocks(M: int, S: int, H: int, block_q: int = DEFAULT_BLOCK_Q,
                block_s: int = DEFAULT_BLOCK_S, backend: str = "tpu",
                itemsize: int = 2) -> tuple[int, int]:
    """The (row tile, slot tile) the kernels use for M = T*R folded query rows and S slots.

    tpu: the row tile is `block_q` if it is < M (then a multiple of 128: the dk/dv kernel
    holds per-row values as lane vectors), else M rounded up to a multiple of 8 (one
    tile); the slot tile is `block_s` if < S (then a multiple of 8), else S.
    triton: both powers of two >= 16 (Triton's shape rules), capped at M resp. S rounded
    up to one; H must be a power of two >= 16 too; then the larger of the two is halved
    (down to 16) while (bq + bs) * H * itemsize > TRITON_TILE_BYTES[itemsize] (64 KiB
    for bf16, 32 KiB for f32), so that the kernels fit a GPU's shared memory (itemsize:
    bytes per element of q, k and v).
    Raises ValueError on a non-positive block, one that breaks these rules, a bad H for
    triton, or an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if block_q <= 0 or block_s <= 0:
        raise ValueError(f"block_q={block_q}, block_s={block_s} must be positive")
    if backend == "tpu":
        if block_q >= M:
            bq = -(-M // 8) * 8
        elif block_q % 128:
            raise ValueError(f"block_q={block_q} must be a multiple of 128 (TPU lane tiling) "
                             f"when smaller than the T*R={M} query rows")
        else:
            bq = block_q
        if block_s >= S:
            bs = S
        elif block_s % 8:
            raise ValueError(f"block_s={block_s} must be a multiple of 8 (TPU tiling) "
                             f"when smaller than S={S}")
        else:
            bs = block_s
        return bq, bs
    for name, b in (("block_q", block_q), ("block_s", block_s)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16 for triton")
    if H < 16 or H & (H - 1):
        raise ValueError(f"head dim H={H} must be a power of two >= 16 for triton")
    bq, bs = min(block_q, _pow2_at_least(M, 16)), min(block_s, _pow2_at_least(S, 16))
    budget = TRITON_TILE_BYTES.get(itemsize, TRITON_TILE_BYTES[4])
    while (bq + bs) * H * itemsize > budget and max(bq, bs) > 16:
        if bq >= bs:
            bq //= 2
        else:
            bs //= 2
    return bq, bs


class _Config(NamedTuple):
    plan: Plan
    backend: str
    interpret: Any  # bool or pltpu.InterpretParams (hashable)


def _metadata(limit, plan: Plan):
    lim = packed_kernel.row_limits(limit, plan)
    return lim, packed_kernel.tile_max(lim, plan)


def _forward(q, k, v, limit, cfg: _Config):
    plan = cfg.plan
    fwd = packed_kernel.KERNELS[cfg.backend][0]
    qf = packed_kernel.fold_rows(q, plan)
    lim, tmax = _metadata(limit, plan)
    of, lsef = fwd(qf, k, v, lim, tmax, plan=plan, interpret=cfg.interpret)
    out = (packed_kernel.unfold_rows(of, plan), packed_kernel.unfold_rows(lsef, plan)[..., 0])
    return out, (qf, k, v, of, lsef, limit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _packed(q, k, v, limit, cfg: _Config):
    return _forward(q, k, v, limit, cfg)[0]


def _packed_bwd(cfg: _Config, res, g):
    plan = cfg.plan
    _, dq_kernel, dkv_kernel = packed_kernel.KERNELS[cfg.backend]
    qf, k, v, of, lsef, limit = res
    g_o, g_lse = g
    dof = packed_kernel.fold_rows(g_o.astype(qf.dtype), plan)
    delta = jnp.sum(dof.astype(jnp.float32) * of.astype(jnp.float32), axis=-1, keepdims=True)
    di = delta - packed_kernel.fold_rows(g_lse.astype(jnp.float32)[..., None], plan)
    lim, tmax = _metadata(limit, plan)
    dqf = dq_kernel(qf, k, v, dof, lsef, di, lim, tmax, plan=plan, interpret=cfg.interpret)
    qlist, qcount = packed_kernel.q_tile_lists(tmax, plan)
    dk, dv = dkv_kernel(qf, k, v, dof, lsef, di, lim, qlist, qcount, plan=plan,
                        interpret=cfg.interpret)
    return packed_kernel.unfold_rows(dqf, plan), dk, dv, None


_packed.defvjp(lambda q, k, v, limit, cfg: _forward(q, k, v, limit, cfg), _packed_bwd)


def packed_attention(q, k, v, limit, *, block_q=DEFAULT_BLOCK_Q, block_s=DEFAULT_BLOCK_S,
                     backend="tpu", impl="pallas", interpret=None):
    """Attention of each query over the key slots below its own limit, with log-sum-exp.

    Flash attention 2 (Dao 2023) with per-query prefix limits and flash-decoding style
    skipping of the S tiles no query of a tile sees; forward and backward are Pallas
    kernels (see the module doc).

    Args:
      q: [B, T, N, H] queries, float32 or bfloat16, already rotated.
      k, v: [B, K, S, H] keys and values, q's dtype. GQA: N = K * R, query head n uses KV
        head n // R. Slots no query of row b sees (s >= max_t limit[b, t]) are never read
        into the results or gradients (they may hold anything, NaN included).
      limit: i32[B, T] (any integer dtype): query t of row b sees slots
        s < limit[b, t]; values are clipped to 0..S; 0 means it sees nothing. Limits need
        not be monotonic (the cost follows each query tile's largest limit).
      block_q: row tile over the T*R folded query rows (row t*R + r is query t of head
        k*R + r); block_s: tile over S. See `pick_blocks` for the rules per backend.
      backend: "tpu" (Mosaic, scalar prefetch, S tiles as a grid axis) or "triton" (GPU,
        loops over the tiles inside each program).
      impl: "pallas" (the kernels) or "reference" (the jnp reference, with ordinary
        autodiff for the backward).
      interpret: Pallas interpret mode: None = on CPU only (jax.default_backend() ==
        "cpu"); True / False; or a `pltpu.InterpretParams` (tpu backend only).

    Returns:
      (o, lse): o [B, T, N, H] in q.dtype, lse f32[B, T, N] = log sum_s exp(score) over
      the visible slots, score = q.k / sqrt(H) in f32. A query that sees nothing gets
      o = 0 and lse = -inf (no NaN, also in the gradients).

    Differentiable (reverse mode, `jax.custom_vjp`) w.r.t. q, k and v, with cotangents
    for both o and lse (dS = P * (dP - rowsum(dO * O) + g_lse)).

    Raises:
      ValueError: on bad shapes (q not 4-D, k not [B, K, S, H], v != k's shape, N not a
        multiple of K, limit not an integer [B, T], an empty axis), mixed or unsupported
        dtypes, an unknown backend or impl; with impl="pallas" also on bad block sizes or
        a bad H for triton (`pick_blocks`), or an InterpretParams with backend "triton".
    """
    B, T, N, K, R, S, H = check_args(q, k, v, limit)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    limit = jnp.clip(jnp.asarray(limit).astype(jnp.int32), 0, S)
    if impl == "reference":
        return packed_attention_reference(q, k, v, limit)
    bq, bs = pick_blocks(T * R, S, H, block_q, block_s, backend, q.dtype.itemsize)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    elif isinstance(interpret, bool | np.bool_):
        interpret = bool(interpret)
    else:
        from jax.experimental.pallas import tpu as pltpu

        if not isinstance(interpret, pltpu.InterpretParams) or backend != "tpu":
            raise ValueError(f"interpret={interpret!r}: expected None, a bool, or a "
                             f"pltpu.InterpretParams with backend='tpu'")
    cfg = _Config(Plan(B, T, N, K, S, H, bq, bs), backend, interpret)
    return _packed(q, k, v, limit, cfg)


__all__ = ["packed_attention", "packed_attention_reference", "pick_blocks", "BACKENDS",
           "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_S"]
