"""What a forward of a few rows costs on this backend: the target's weight matmuls alone
(every layer's q/k/v/o/gate/up/down and the LM head, no attention), for M = 1, 2, 4,
8, 16 rows, in f32 and with bf16 inputs and f32 accumulation (`specjax.models.matmul.linear`,
which pads one row to two on CPU). f32 comes three times: as `linear` computes it (on CPU,
2..`CPU_WEIGHT_MAJOR_MAX_ROWS` rows weight-major, `w @ x.T` behind an optimization
barrier, 5-16 rows padded to a multiple of 8), the same without that padding, and as
the plain `x @ w.T` product XLA picks otherwise.

    python benchmarks/matmul_rows.py                       # the demo target's shapes
    python benchmarks/matmul_rows.py --target DIR --rows 1 8 --repeats 20

Speculative decoding pays off when verifying G+1 rows costs little more than one row.
On XLA:CPU a one-row f32 matmul is a bandwidth-bound matrix-vector product while two or
more rows take a GEMM path, so this table says how much a verification of G+1 tokens
costs against an autoregressive step before any drafter runs. Weights are random (the
target's shapes from its config.json); each variant is one jitted function; the
variants interleave, and the table gives the median and minimum over --repeats rounds
of 5 calls each (ms per call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.pop("JAX_NUM_CPU_DEVICES", None)  # measure ONE CPU device
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # uninstalled checkout

from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "checkpoints", "demo", "target"),
                    help="HF directory whose config.json gives the shapes")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=10)
    return ap


def weights(cfg, dtype):
    """Random [out, in] matrices of every layer and the LM head, in `dtype`."""
    import jax

    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, KH = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(NH, D), (KH, D), (KH, D), (D, NH), (F, D), (F, D), (D, F)]
    key = jax.random.key(0)
    layers = []
    for _ in range(cfg.num_layers):
        ws = []
        for s in shapes:
            key, k = jax.random.split(key)
            ws.append((0.02 * jax.random.normal(k, s)).astype(dtype))
        layers.append(ws)
    head = (0.02 * jax.random.normal(key, (V, D))).astype(dtype)
    return layers, head


def forward(x, layers, head):
    """The matmul chain of a decoder forward on x [M,D] (attention replaced by a sum of
    the projections, so every matmul has its real shape)."""
    import jax
    import jax.numpy as jnp

    from specjax.models.matmul import linear

    for q, k, v, o, g, u, d in layers:
        qq, kk, vv = linear(x, q), linear(x, k), linear(x, v)
        rep = qq.shape[-1] // kk.shape[-1]
        x = x + linear(qq + jnp.tile(kk + vv, rep), o)
        x = x + linear(jax.nn.silu(linear(x, g)) * linear(x, u), d)
    return linear(x, head)


def run(args) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from specjax.models.config import ModelConfig

    if not os.path.isfile(os.path.join(args.target, "config.json")):
        raise SpecjaxError(f"--target {args.target} has no config.json")
    if min(args.rows) < 1 or args.repeats < 1:
        raise SpecjaxError("--rows and --repeats must be >= 1")
    cfg = ModelConfig.from_dir(args.target)
    from specjax.models import matmul as model_lib

    f32, bf16 = weights(cfg, jnp.float32), weights(cfg, jnp.bfloat16)
    # name -> (weights, CPU_WEIGHT_MAJOR_MAX_ROWS and CPU_WEIGHT_MAJOR_PAD_ROWS while tracing)
    limit, pad = model_lib.CPU_WEIGHT_MAJOR_MAX_ROWS, model_lib.CPU_WEIGHT_MAJOR_PAD_ROWS
    variants = {"f32": (f32, limit, pad), "f32 unpadded": (f32, limit, (0, -1)),
                "f32 plain": (f32, 0, pad), "bf16 inputs": (bf16, limit, pad)}
    results = []
    print(f"{jax.default_backend()} backend, jax {jax.__version__}, target shapes of "
          f"{args.target} ({cfg.num_params / 1e6:.1f}M params, matmuls only)\n")
    print("| rows | f32 ms (min) | f32 unpadded ms (min) | f32 plain ms (min) "
          "| bf16 inputs ms (min) | f32 / f32 at 1 row | f32 plain / f32 at 1 row |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for M in args.rows:
        x = jnp.ones((M, cfg.hidden_size), jnp.float32)
        times = {name: [] for name in variants}
        compiled = {}
        try:
            for name, ((layers, head), lim, pd) in variants.items():
                # read while tracing
                model_lib.CPU_WEIGHT_MAJOR_MAX_ROWS, model_lib.CPU_WEIGHT_MAJOR_PAD_ROWS = lim, pd
                fresh = lambda *a: forward(*a)  # noqa: E731 (jit caches traces per function)
                compiled[name] = jax.jit(fresh).lower(x, layers, head).compile()
        finally:
            model_lib.CPU_WEIGHT_MAJOR_MAX_ROWS, model_lib.CPU_WEIGHT_MAJOR_PAD_ROWS = limit, pad
        for name, ((layers, head), _, _) in variants.items():
            jax.block_until_ready(compiled[name](x, layers, head))
        for _ in range(args.repeats):
            for name, ((layers, head), _, _) in variants.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    out = compiled[name](x, layers, head)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / 5 * 1e3)
        row = {"rows": M, **{name: {"median_ms": statistics.median(t), "min_ms": min(t)}
                             for name, t in times.items()}}
        base = base or row["f32"]["median_ms"]
        cells = " | ".join(f"{row[n]['median_ms']:.2f} ({row[n]['min_ms']:.2f})"
                           for n in variants)
        print(f"| {M} | {cells} | {row['f32']['median_ms'] / base:.2f}x | "
              f"{row['f32 plain']['median_ms'] / base:.2f}x |", flush=True)
        results.append(row)
    return results


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except SpecjaxError as e:
        print(f"matmul_rows.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
