"""Bytes, FLOPs and roofline times of the Pallas kernels at Qwen3-8B shapes, against the
unfused jnp paths they replace; measured times where this backend can run them.

    python benchmarks/kernels.py                 # the roofline tables (arithmetic only)
    python benchmarks/kernels.py --measure       # + times of the jnp paths on this backend
                                                 #   (and of packed_attention fwd + bwd)
    python benchmarks/kernels.py --markdown      # tables for README.md

The byte and FLOP model the tables count (what each path reads and writes, its FLOPs, the
roofline time) and the devices' vendor figures are benchmarks/lib/roofline.py's; its
module doc says what is counted.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from benchmarks.lib.roofline import (  # noqa: E402
    BANDWIDTH,
    PEAK_FLOPS,
    QWEN3_8B,
    SMS,
    attention_bytes,
    attention_flops,
    jnp_train_bytes,
    jnp_train_flops,
    packed_kept_bytes,
    packed_limits,
    packed_train_bytes,
    packed_train_flops,
    roofline_ms,
    verify_bytes,
    verify_flops,
)
from specjax import cli  # noqa: E402


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
