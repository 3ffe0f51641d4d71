"""Bytes, FLOPs and roofline times of the Pallas kernels at Qwen3-8B shapes, against the
unfused jnp paths they replace; measured times where this backend can run them.

    python benchmarks/kernels.py                 # the roofline tables (arithmetic only)
    python benchmarks/kernels.py --measure       # + times of the jnp paths on this backend
                                                 #   (and of packed_attention fwd + bwd)
    python benchmarks/kernels.py --markdown      # tables for README.md

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

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from specjax import cli  # noqa: E402

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


def verify_rows(Bs=(1, 8, 64), Gs=(4, 8, 16), rules=("greedy", "token", "block")):
    V = QWEN3_8B["V"]
    out = []
    for rule in rules:
        for B in Bs:
            for G in Gs:
                fused = verify_bytes(B, G, V, rule)
                ref = verify_bytes(B, G, V, rule, fused=False)
                out.append({"rule": rule, "B": B, "G": G, "bytes": fused, "ref_bytes": ref,
                            "flops": verify_flops(B, G, V),
                            **{f"us_{k}": 1e6 * fused / bw for k, bw in BANDWIDTH.items()}})
    return out


def attention_rows(Bs=(1, 8), Ts=(1, 8, 16), contexts=(1024, 8192, 32768), S=32768):
    c = QWEN3_8B
    out = []
    for B in Bs:
        for T in Ts:
            for L in contexts:
                fused = attention_bytes(B, T, L, S, c["N"], c["K"], c["H"])
                ref = attention_bytes(B, T, L, S, c["N"], c["K"], c["H"], fused=False)
                out.append({"B": B, "T": T, "L": L, "S": S, "bytes": fused, "ref_bytes": ref,
                            "flops": attention_flops(B, T, L, c["N"], c["H"]),
                            **{f"us_{k}": 1e6 * fused / bw for k, bw in BANDWIDTH.items()}})
    return out


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


def packed_rows(causal=(2048, 4096, 8192), block=((4096, 512, 16),), bq=128, bs=128):
    """One dict per training case: causal T = S (B 1) and block-wise (S, A, G+1) (B 1)."""
    c = QWEN3_8B
    N, K, H = c["N"], c["K"], c["H"]
    cases = [("causal", T, T, packed_limits("causal", T, T)) for T in causal]
    cases += [(f"block A {A} x {G1}", A * G1, S, packed_limits("block", A * G1, S, A))
              for S, A, G1 in block]
    out = []
    for name, T, S, limit in cases:
        B = limit.shape[0]
        kb = packed_train_bytes(limit, N, K, S, H, bq=bq, bs=bs)
        jb = jnp_train_bytes(B, T, S, N, K, H)
        kf, jf = packed_train_flops(limit, N, K, S, H, bq, bs), jnp_train_flops(B, T, S, N, H)
        kept, ref_kept = packed_kept_bytes(B, T, S, N, H)
        out.append({"case": name, "B": B, "T": T, "S": S,
                    "visible": float(limit.mean()), "bytes": sum(kb), "ref_bytes": sum(jb),
                    "flops": sum(kf), "ref_flops": sum(jf), "kept": kept,
                    "ref_kept": ref_kept,
                    **{f"ms_{d}": roofline_ms(kb, kf, d) for d in BANDWIDTH},
                    **{f"ref_ms_{d}": roofline_ms(jb, jf, d) for d in BANDWIDTH}})
    return out


def split_note() -> str:
    """One line of split-S arithmetic (decode_attention num_splits): programs vs cores."""
    from pallas_kernels.attention import pick_num_splits

    c = QWEN3_8B
    K, sms = c["K"], SMS["H100"]
    nQ = 8192 * (c["N"] // K) // 128
    return (f"Split-S (decode_attention num_splits P): the grid has B*K*P programs (one per "
            f"row, KV head and split); a GPU needs about one per SM to draw its bandwidth "
            f"(H100/H200: {sms} SMs). Qwen3-8B decode at B 1: B*K = {K} programs "
            f"({100 * K / sms:.0f}% of the SMs); P 8 -> {8 * K}, P 16 -> {16 * K}; "
            f"pick_num_splits(1, {K}, 32768, 128) = {pick_num_splits(1, K, 32768, 128)} "
            f"(it splits only below B*K = 8). Training needs no split: packed_attention's "
            f"grid is B*K*nQ = 1*{K}*{nQ} = {K * nQ} programs at T 8192. TPU v5e has one "
            f"TensorCore per chip, which runs the grid in sequence: split-S adds no "
            f"parallelism there.")


def block_q_note(T: int = 8192, bqs=(128, 256, 512)) -> str:
    """Kernel bytes and v5e roofline of the causal T = S row for other row tiles."""
    c = QWEN3_8B
    limit = packed_limits("causal", T, T)
    parts = []
    for bq in bqs:
        b = packed_train_bytes(limit, c["N"], c["K"], T, c["H"], bq=bq)
        f = packed_train_flops(limit, c["N"], c["K"], T, c["H"], bq=bq)
        ms = roofline_ms(b, f, "TPU v5e")
        parts.append(f"bq {bq}: {_mb(sum(b))} MiB, {sum(f) / sum(b):.0f} FLOP/B, "
                     f"{ms:.1f} ms v5e")
    ridge = ", ".join(f"{k} {PEAK_FLOPS[k] / BANDWIDTH[k]:.0f}" for k in BANDWIDTH)
    return (f"Row tile (causal T = S = {T}): the K/V stream carries about bq FLOP/B "
            f"(2*2*bq*bs*H FLOPs per 2*bs*H*2 B); ridge points {ridge} FLOP/B; "
            + "; ".join(parts) + ".")


def measure_verify(B: int, G: int, rule: str, repeats: int = 5) -> dict:
    """ms per call of `--kernels off` (specjax.decoding.verify on softmaxed logits) and of the fused
    path's jnp reference (and of the Pallas kernel where the backend is not the CPU), same
    inputs, interleaved, median over `repeats`."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.verify import verify_logits
    from specjax.decoding.verify import VERIFIERS

    V = QWEN3_8B["V"]
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    tl = jax.random.normal(k1, (B, G + 1, V), jnp.float32) * 3
    q = jax.nn.softmax(jax.random.normal(k2, (B, G, V), jnp.float32) * 3, axis=-1)
    x = jax.random.randint(k3, (B, G), 0, V)
    temp = 0.0 if rule == "greedy" else 1.0

    def off(tl, x, q, key):
        p = (jax.nn.one_hot(jnp.argmax(tl, -1), V) if rule == "greedy"
             else jax.nn.softmax(tl / temp, axis=-1))
        return VERIFIERS[rule](x, q, p, key)

    fns = {"off": jax.jit(off)}
    impls = ["reference"] + (["pallas"] if jax.default_backend() != "cpu" else [])
    for impl in impls:
        fns[impl] = jax.jit(lambda tl, x, q, key, impl=impl: verify_logits(
            tl, x, key, rule=rule, temperature=temp, draft_probs=q, impl=impl))
    times = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f(tl, x, q, jax.random.key(1)))  # compile
    for r in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(tl, x, q, jax.random.key(r)))
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def measure_packed(B: int = 1, T: int = 512, N: int = 8, K: int = 4, H: int = 64,
                   S: int = 512, repeats: int = 5, pallas: bool = True) -> dict:
    """ms per forward + backward (jax.grad w.r.t. q, k, v) of causal attention, f32, on
    this backend, interleaved, median over `repeats`: "jnp" = `attend` with a bool mask
    (the one-softmax path: f32 scores and probs materialised), loss sum(o); "reference" =
    packed_attention(impl="reference"), loss sum(o) + sum(finite lse); with `pallas`,
    "pallas" = packed_attention(impl="pallas") (Triton on a GPU, Mosaic on a TPU; on the
    CPU Pallas interpret mode, which is not a speed figure), same loss."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import packed_attention
    from specjax.drafters.attend import attend

    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32)
    k = jax.random.normal(kk, (B, K, S, H), jnp.float32)
    v = jax.random.normal(kv, (B, K, S, H), jnp.float32)
    limit = jnp.broadcast_to(jnp.minimum(jnp.arange(1, T + 1, dtype=jnp.int32), S), (B, T))
    mask = jnp.arange(S)[None, None, :] < limit[:, :, None]

    backend = "triton" if jax.default_backend() == "gpu" else "tpu"

    def packed_loss(impl):
        def loss(q, k, v):
            o, lse = packed_attention(q, k, v, limit, impl=impl, backend=backend)
            return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return loss

    losses = {"jnp": lambda q, k, v: jnp.sum(attend(q, [(k, v, mask)])),
              "reference": packed_loss("reference")}
    if pallas:
        losses["pallas"] = packed_loss("pallas")
    fns = {name: jax.jit(jax.grad(f, argnums=(0, 1, 2))) for name, f in losses.items()}
    times = {name: [] for name in fns}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))  # compile
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


def _mb(x):
    return f"{x / 2**20:.1f}"


def format_tables(measure: bool = False, markdown: bool = False) -> str:
    bws = list(BANDWIDTH)
    lines = []
    head = ["rule", "B", "G", "fused MiB", "unfused MiB", "fused/unfused",
            *[f"roofline us {k}" for k in bws]]
    vr = verify_rows()
    rows = [[r["rule"], r["B"], r["G"], _mb(r["bytes"]), _mb(r["ref_bytes"]),
             f"{r['bytes'] / r['ref_bytes']:.2f}", *[f"{r['us_' + k]:.1f}" for k in bws]]
            for r in vr]
    lines += _table("Verification, Qwen3-8B vocabulary (V 151,936, f32 logits)", head, rows,
                    markdown)
    head = ["B", "T", "context L", "capacity S", "kernel MiB", "jnp MiB", "kernel/jnp",
            *[f"roofline us {k}" for k in bws]]
    rows = [[r["B"], r["T"], r["L"], r["S"], _mb(r["bytes"]), _mb(r["ref_bytes"]),
             f"{r['bytes'] / r['ref_bytes']:.3f}", *[f"{r['us_' + k]:.1f}" for k in bws]]
            for r in attention_rows()]
    lines += [""] + _table("Attention into the KV cache, one Qwen3-8B layer (N 32, K 8, "
                           "H 128, bf16 cache)", head, rows, markdown)
    head = ["case", "T", "S", "mean limit", "kernel MiB", "jnp MiB", "kernel/jnp",
            "kernel GFLOP", "jnp GFLOP", "FLOP/B kernel", "FLOP/B jnp",
            "kept kernel MiB", "kept jnp MiB",
            *[f"roofline ms {k} (kernel / jnp)" for k in bws]]
    rows = [[r["case"], r["T"], r["S"], f"{r['visible']:.0f}", _mb(r["bytes"]),
             _mb(r["ref_bytes"]), f"{r['bytes'] / r['ref_bytes']:.3f}",
             f"{r['flops'] / 1e9:.0f}", f"{r['ref_flops'] / 1e9:.0f}",
             f"{r['flops'] / r['bytes']:.0f}", f"{r['ref_flops'] / r['ref_bytes']:.0f}",
             _mb(r["kept"]), _mb(r["ref_kept"]),
             *[f"{r['ms_' + k]:.2f} / {r['ref_ms_' + k]:.2f}" for k in bws]]
            for r in packed_rows()]
    lines += [""] + _table("Packed attention in training, forward + backward of one Qwen3-8B "
                           "layer (B 1, N 32, K 8, H 128, bf16; tiles 128 x 128)", head, rows,
                           markdown)
    lines += ["", block_q_note(), "", split_note()]
    if measure:
        import jax

        head = ["rule", "B", "G", *["ms " + k for k in ("off", "reference", "pallas")]]
        rows = []
        for rule in ("greedy", "token", "block"):
            for B, G in ((1, 7), (8, 7)):
                t = measure_verify(B, G, rule)
                rows.append([rule, B, G, *[f"{t[k]:.2f}" if k in t else "-"
                                           for k in ("off", "reference", "pallas")]])
        lines += [""] + _table(f"Measured on {jax.default_backend()} "
                               f"({jax.devices()[0].device_kind}), V 151,936, median of 5",
                               head, rows, markdown)
        shape = dict(B=1, T=512, N=8, K=4, H=64, S=512)
        t = measure_packed(**shape)  # the Pallas path: a few seconds in interpret mode
        names = {"jnp": "jnp attend (f32 scores, probs)",
                 "reference": "packed_attention impl=reference",
                 "pallas": "packed_attention impl=pallas"
                 + (" (interpret mode: not a speed figure)"
                    if jax.default_backend() == "cpu" else "")}
        rows = [[names[k], f"{v:.1f}"] for k, v in t.items()]
        lines += [""] + _table(f"Measured on {jax.default_backend()}: causal attention "
                               f"forward + backward (jax.grad), "
                               + ", ".join(f"{k} {v}" for k, v in shape.items())
                               + ", f32, median of 5", ["path", "ms"], rows, markdown)
    return "\n".join(lines)


def _table(title, head, rows, markdown):
    if markdown:
        return [f"**{title}**", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head), *["| " + " | ".join(map(str, r)) + " |" for r in rows]]
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda r: "  ".join(str(x).rjust(n) for x, n in zip(r, w, strict=True))  # noqa: E731
    return [title, fmt(head), *[fmt(r) for r in rows]]


def main(argv=None) -> int:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true",
                    help="also time the verification and packed-attention paths on this "
                         "backend")
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    args = ap.parse_args(argv)
    print(format_tables(args.measure, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
