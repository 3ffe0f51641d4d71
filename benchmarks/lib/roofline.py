"""The analytic byte and FLOP model of the Pallas kernels against the unfused jnp paths they
replace, the devices' vendor figures (memory bandwidth, peak dense bf16 FLOP/s, SMs) and
Qwen3-8B's shapes: arithmetic only (no jax import). benchmarks/kernels.py tabulates it; the
device rounds (benchmarks/device_round.py, benchmarks/big_round.py, benchmarks.lib.device)
divide measured times by it; benchmarks.lib.system_table projects speedups with its
figures.

Verification (pallas_kernels/verify), per call: B rows, G drafts, V = 151,936.
- fused kernel: two passes over the target logits [B, G+1, V] (stats, then residuals)
  and one over the draft probabilities [B, G, V] f32 (the residual pass); greedy needs
  only the first pass; no [B, G+1, V] array is written.
- unfused (specjax.decoding.verify, `--kernels off`): the softmax reads the logits twice (max,
  then exp-sum) and writes the f32 probabilities; block verification reads p and q again
  for the residual masses A_i; both read p (and q) once more for the correction token.
Attention into the KV cache (one layer; Qwen3-8B N 32, K 8, H 128, bf16 cache):
- kernel: K and V of the valid context only (L tokens), plus queries and output;
- jnp (today's model.py): K and V of the whole capacity S, and the f32 scores
  [B, N, T, S] written by the QK matmul and read by the softmax and the PV matmul.
Roofline time = bytes / memory bandwidth (both kernels are memory-bound at these shapes:
a few FLOPs per byte). Bandwidths: TPU v5e 819 GB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s
(vendor figures).
Packed attention in TRAINING (pallas_kernels/attention/packed.py), forward + backward of
one layer, Qwen3-8B heads, bf16 q/k/v/o, f32 lse; tiles bq = bs = 128 (the defaults):
- kernel: per (row b, KV head) the R = N/K heads are folded into T*R rows; row tile i
  (bq rows = bq/R queries) has tmax_i = its largest limit and reads the n_i =
  cdiv(tmax_i, bs) K/V tiles below it (HBM, no cache reuse: exact on TPU, where every
  grid step DMAs its blocks; an upper bound on GPUs, whose L2 serves some re-reads).
  P = sum of n_i over all tiles, rows and KV heads. Forward: q read, o and lse written,
  limits read once, K and V re-read once per (row tile, S tile) pair: 2*P*bs*H*2 B.
  Backward: delta = rowsum(dO*O) (reads dO, o, g_lse, writes di); dq pass (reads q, dO,
  lse, di, limits, writes dq, re-reads K, V per pair); dk/dv pass (reads K, V once, writes
  dk, dv, re-reads q, dO, lse, di, limits per pair). The fold/unfold transposes of q, o,
  dO, dq ([B,T,N,H] copies in XLA) are not counted.
  FLOPs: matmuls of the visible tiles only (whole tiles, masked entries inside a tile
  included): forward 2 (QK^T, PV), backward 7 (dq pass QK^T, dO V^T, dS K; dk/dv pass
  QK^T, dO V^T, P^T dO, dS^T Q) -> backward = 3.5x forward (a fused FA2 backward with
  atomic dq is 5 = 2.5x; the two passes buy atomics-free TPU/GPU kernels with 2 recomputed
  matmuls). Kept for the backward: o [B,T,N,H] bf16 + lse [B,T,N] f32 (q, k, v are kept
  by both paths and not counted).
- jnp (specjax/drafters/attend.py `attend`, model.py cache-free forward): every [B,N,T,S]
  entry, masked ones included. Forward: f32 scores written (QK^T) and read (softmax),
  f32 probs written and read (PV): 4 passes of B*N*T*S*4 B, plus q, k, v read, o written.
  Backward: dP written (dO V^T), dP and P read and dS written (softmax backward), dS read
  twice (dS K, dS^T Q), P read (P^T dO): 7 passes, plus dO read twice, q, k, v read, dq,
  dk, dv written. FLOPs: forward 2 matmuls over all T*S, backward 4 (no recomputation) =
  2x forward. Kept for the backward: f32 probs [B,N,T,S] (a lower bound: with bf16
  activations `attend` also keeps the bf16 copy of P it feeds to the PV matmul).
Roofline time, per pass: max(bytes / bandwidth, FLOPs / peak), summed over forward and
backward; peaks are the vendor dense bf16 figures: TPU v5e 197 TFLOP/s, H100 SXM and
H200 989 TFLOP/s (no sparsity).
"""

from __future__ import annotations

BANDWIDTH = {"TPU v5e": 819e9, "H100": 3.35e12, "H200": 4.8e12}  # bytes/s
QWEN3_8B = {"V": 151_936, "N": 32, "K": 8, "H": 128, "L": 36}
PEAK_FLOPS = {"TPU v5e": 197e12, "H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s
SMS = {"H100": 132, "H200": 132}  # streaming multiprocessors (SXM parts)


def verify_bytes(B: int, G: int, V: int, rule: str, logits_bytes: int = 4,
                 fused: bool = True) -> int:
    """Bytes one verification call moves from memory (inputs read, arrays written)."""
    target = B * (G + 1) * V * logits_bytes
    draft = B * G * V * 4  # f32 draft probabilities
    p32 = B * (G + 1) * V * 4
    if rule == "greedy":  # argmax of the logits; the unfused path also one-hots them
        return target if fused else target + p32 + p32
    if fused:
        return 2 * target + draft  # stats pass + residual pass
    softmax = 2 * target + p32  # max, exp-sum (fused normalise) -> write p
    a_pass = (p32 + draft) if rule == "block" else 0  # residual masses A_i
    correction = B * V * 4 * 2  # p and q at tau, gathered (one row each)
    return softmax + a_pass + p32 // (G + 1) + correction


def verify_flops(B: int, G: int, V: int) -> int:
    """Arithmetic per call, both passes: about 12 FLOPs per element (scale, max, exp,
    sum, residual, log, hash noise, compare)."""
    return 12 * B * (2 * G + 1) * V


def attention_bytes(B: int, T: int, L: int, S: int, N: int, K: int, H: int,
                    cache_bytes: int = 2, fused: bool = True) -> int:
    """Bytes one layer's decode/verify attention moves: T queries of B rows into a cache
    with L valid tokens of capacity S."""
    q_and_out = 2 * B * T * N * H * cache_bytes
    if fused:
        return 2 * B * K * L * H * cache_bytes + q_and_out
    scores = B * N * T * S * 4
    return 2 * B * K * S * H * cache_bytes + q_and_out + 3 * scores


def attention_flops(B: int, T: int, L: int, N: int, H: int) -> int:
    return 4 * B * T * N * L * H


def packed_limits(kind: str, T: int, S: int, A: int | None = None):
    """i32[1, T] key limits of one training row: "causal" (T = S, limit t + 1: the target
    forward, TTT step 0) or "block" (A blocks of T/A queries; block a sees the context
    slots below its anchor (a + 1) * S // A, anchors spread uniformly over S)."""
    import numpy as np

    if kind == "causal":
        return np.arange(1, T + 1, dtype=np.int64)[None]
    if kind == "block":
        anchors = (np.arange(1, A + 1, dtype=np.int64) * S) // A
        return np.repeat(anchors, T // A)[None]
    raise ValueError(f"kind={kind!r}")


def packed_pairs(limit, N: int, K: int, S: int, bq: int = 128, bs: int = 128) -> int:
    """P: the (row tile, S tile) pairs the kernels compute, over rows and KV heads."""
    import numpy as np

    B, T = limit.shape
    R = N // K
    rows = np.repeat(np.minimum(limit, S), R, axis=1)  # row t*R + r: query t
    nQ = -(-T * R // bq)
    rows = np.pad(rows, ((0, 0), (0, nQ * bq - T * R)))  # padding rows see nothing
    tmax = rows.reshape(B, nQ, bq).max(axis=-1)
    return K * int((-(-tmax // bs)).sum())


def packed_train_bytes(limit, N: int, K: int, S: int, H: int, act_bytes: int = 2,
                       bq: int = 128, bs: int = 128) -> tuple[int, int]:
    """(forward, backward) bytes of `packed_attention`'s kernels for one layer (module doc)."""
    B, T = limit.shape
    Mp = -(-T * (N // K) // bq) * bq
    rows = B * K * Mp * H * act_bytes  # one folded [B, K, Mp, H] array (q, o, dO, dq)
    col = B * K * Mp * 4  # one f32/i32 value per folded row (lse, di, limit)
    P = packed_pairs(limit, N, K, S, bq, bs)
    kv_pair = 2 * P * bs * H * act_bytes  # K and V tiles per (row tile, S tile) pair
    fwd = 2 * rows + 2 * col + kv_pair  # q in, o out, limit in, lse out
    delta = 2 * rows + 2 * col  # dO, o in; g_lse in, di out
    dq = 3 * rows + 3 * col + kv_pair  # q, dO in, dq out; lse, di, limit in
    nS = -(-S // bs)
    dkv = 4 * B * K * nS * bs * H * act_bytes + P * (2 * bq * H * act_bytes + 3 * bq * 4)
    return fwd, delta + dq + dkv


def packed_train_flops(limit, N: int, K: int, S: int, H: int, bq: int = 128,
                       bs: int = 128) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of the kernels: 2 resp. 7 [bq, bs, H] matmuls per
    computed tile pair."""
    tile = 2 * bq * bs * H * packed_pairs(limit, N, K, S, bq, bs)
    return 2 * tile, 7 * tile


def jnp_train_bytes(B: int, T: int, S: int, N: int, K: int, H: int,
                    act_bytes: int = 2) -> tuple[int, int]:
    """(forward, backward) bytes of the unfused jnp attention (module doc)."""
    scores = B * N * T * S * 4
    qo = B * T * N * H * act_bytes
    kv = B * K * S * H * act_bytes
    return 4 * scores + 2 * qo + 2 * kv, 7 * scores + 4 * qo + 4 * kv


def jnp_train_flops(B: int, T: int, S: int, N: int, H: int) -> tuple[int, int]:
    fwd = 4 * B * N * T * S * H
    return fwd, 2 * fwd


def packed_kept_bytes(B: int, T: int, S: int, N: int, H: int,
                      act_bytes: int = 2) -> tuple[int, int]:
    """Bytes kept for the backward per layer: (kernel: o + lse, jnp: f32 probs)."""
    return B * T * N * H * act_bytes + B * T * N * 4, B * N * T * S * 4


def roofline_ms(nbytes: tuple[int, ...], flops: tuple[int, ...], device: str) -> float:
    """Sum over passes (forward, backward) of max(bytes / bandwidth, FLOPs / peak), ms."""
    return 1e3 * sum(max(b / BANDWIDTH[device], f / PEAK_FLOPS[device])
                     for b, f in zip(nbytes, flops, strict=True))
