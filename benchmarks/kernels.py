"""Bytes, FLOPs and roofline times of the Pallas kernels at Qwen3-8B shapes, against the
unfused jnp paths they replace; measured times where this backend can run them.

    python benchmarks/kernels.py                 # the roofline tables (arithmetic only)
    python benchmarks/kernels.py --measure       # + times of the jnp paths on this backend
    python benchmarks/kernels.py --markdown      # tables for README.md

Verification (pallas_kernels/verify), per call: B rows, G drafts, V = 151,936.
- fused kernel: two passes over the target logits [B, G+1, V] (stats, then residuals)
  and one over the draft probabilities [B, G, V] f32 (the residual pass); greedy needs
  only the first pass; no [B, G+1, V] array is written.
- unfused (specjax.verify, `--kernels off`): the softmax reads the logits twice (max,
  then exp-sum) and writes the f32 probabilities; block verification reads p and q again
  for the residual masses A_i; both read p (and q) once more for the correction token.
Attention into the KV cache (one layer; Qwen3-8B N 32, K 8, H 128, bf16 cache):
- kernel: K and V of the valid context only (L tokens), plus queries and output;
- jnp (today's model.py): K and V of the whole capacity S, and the f32 scores
  [B, N, T, S] written by the QK matmul and read by the softmax and the PV matmul.
Roofline time = bytes / memory bandwidth (both kernels are memory-bound at these shapes:
a few FLOPs per byte). Bandwidths: TPU v5e 819 GB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s
(vendor figures).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

BANDWIDTH = {"TPU v5e": 819e9, "H100": 3.35e12, "H200": 4.8e12}  # bytes/s
QWEN3_8B = {"V": 151_936, "N": 32, "K": 8, "H": 128, "L": 36}


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


def measure_verify(B: int, G: int, rule: str, repeats: int = 5) -> dict:
    """ms per call of `--kernels off` (specjax.verify on softmaxed logits) and of the fused
    path's jnp reference (and of the Pallas kernel where the backend is not the CPU), same
    inputs, interleaved, median over `repeats`."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.verify import verify_logits
    from specjax.verify import VERIFIERS

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
    return "\n".join(lines)


def _table(title, head, rows, markdown):
    if markdown:
        return [f"**{title}**", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head), *["| " + " | ".join(map(str, r)) + " |" for r in rows]]
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = lambda r: "  ".join(str(x).rjust(n) for x, n in zip(r, w, strict=True))  # noqa: E731
    return [title, fmt(head), *[fmt(r) for r in rows]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true",
                    help="also time the verification paths on this backend")
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    args = ap.parse_args(argv)
    print(format_tables(args.measure, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
