"""Decoding speed against cache capacity and context length (the demo target, AR, greedy).

    python benchmarks/context_length.py                       # both sweeps, plot + JSON
    python benchmarks/context_length.py --capacities 160 4096 --contexts  # capacity only
    python benchmarks/context_length.py --quick               # smoke run (tiny model)

Two sweeps, each in ONE process with timed runs interleaved across its settings:

1. Capacity: a 32-token prompt and 128 new tokens at `--max-length` 160 .. 4096. The
   attention reads the KV cache in chunks (`specjax.models.attention`, --chunk slots) only up
   to the longest row's position, so tokens/s should not depend on the capacity. The
   previous behaviour, one softmax over all S slots, is the same code with a chunk of
   at least S (`--chunk 0` below means "unchunked"), timed in the same run.
2. Context: prompts of 128 .. 32k tokens (held-out real text: the Python standard
   library's validation split, the demo tokenizer) with capacity = prompt + 64: prefill
   seconds (a run with one new token) and decode tokens/s (64 new tokens, minus the
   prefill run's time). Prefill runs in the backend's default pieces
   (`specjax.models.prefill.prefill_pieces()`; LoopConfig.prefill_chunk, prefill_min_chunk).

Prints markdown tables; writes `--json` and a PNG of tokens/s against context length.
Beyond the demo target's max_position_embeddings (2048) the output is not meaningful
text, but the cost is what is measured here (as decode.py --allow-long-context).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.lib.prompts import text_ids  # noqa: E402
from specjax import cli  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.fileio import atomic_write, check_output_file, save_figure  # noqa: E402


def build_parser():
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="checkpoints/demo/target")
    ap.add_argument("--capacities", type=int, nargs="*", default=[160, 1024, 4096])
    ap.add_argument("--contexts", type=int, nargs="*",
                    default=[128, 1024, 4096, 16384, 32768])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 256],
                    help="attention chunks compared in the capacity sweep (0: unchunked)")
    ap.add_argument("--chunk", type=int, default=256, help="chunk of the context sweep")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--context-new-tokens", type=int, default=64,
                    help="new tokens per run of the context sweep")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--context-repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    ap.add_argument("--json", default=None,
                    help="write the results here (its directory must exist; checked first)")
    ap.add_argument("--plot", default=None,
                    help="PNG of decode tokens/s vs context (needs matplotlib; its directory "
                         "must exist; checked first)")
    return ap


def _engine(target, chunk, max_length, prompt_width):
    """An autoregressive Engine built by hand: the attention chunk is a model attribute
    that no decoding session exposes (this sweep is its A/B), and the capacity S is set
    apart from the prompt's length."""
    from flax import nnx

    from specjax.decoding.engine import Engine

    model = nnx.merge(*nnx.split(target))
    model.attention_chunk = chunk if chunk > 0 else 1 << 30
    return Engine(model, max_length=max_length, prompt_width=prompt_width, kernels="off")


def capacity_sweep(target, ids, args, log):
    import jax

    P, N = args.prompt_tokens, args.new_tokens
    engines = {}
    for S in args.capacities:
        for c in args.chunks:
            e = _engine(target, c, S, P)
            log(f"compile capacity {S} chunk {c or 'none'}: {e.compile():.1f} s")
            e.run([ids[:P]], N, jax.random.key(0))  # warm-up
            engines[(S, c)] = e
    times = {k: [] for k in engines}
    outs = {}
    for r in range(args.repeats):
        for k, e in (list(engines.items())[r % len(engines):]
                     + list(engines.items())[:r % len(engines)]):
            out = e.run([ids[:P]], N, jax.random.key(0))
            times[k].append(out.wall_s)
            outs[k] = out.outputs[0]
    first = next(iter(outs.values()))
    same = all(o == first for o in outs.values())
    rows = [{"capacity": S, "chunk": c, "tok_s": N / statistics.median(times[(S, c)]),
             "walls_s": times[(S, c)]} for S, c in engines]
    return rows, same


def context_sweep(target, ids, args, log):
    import jax

    N = args.context_new_tokens
    rows = []
    for P in args.contexts:
        e = _engine(target, args.chunk, P + N, P)
        log(f"compile context {P}: {e.compile():.1f} s")
        e.run([ids[:P]], 1, jax.random.key(0))  # warm-up: the first call costs more
        pre, full = [], []
        for _ in range(args.context_repeats):
            pre.append(e.run([ids[:P]], 1, jax.random.key(0)).wall_s)
            full.append(e.run([ids[:P]], N, jax.random.key(0)).wall_s)
        p, f = statistics.median(pre), statistics.median(full)
        rows.append({"context": P, "prefill_s": p, "total_s": f,
                     "decode_tok_s": (N - 1) / max(f - p, 1e-9)})
        log(f"context {P}: prefill {p:.2f} s, decode {rows[-1]['decode_tok_s']:.1f} tok/s")
    return rows


def write_plot(path, result):
    """PNG: decode tokens/s against context (left) and against capacity (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = result.get("context", [])
    ax = axes[0]
    ax.plot([r["context"] for r in rows], [r["decode_tok_s"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens); capacity = context + new tokens")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode speed against context")
    ax = axes[1]
    for chunk in sorted({r["chunk"] for r in result.get("capacity", [])}):
        rs = [r for r in result["capacity"] if r["chunk"] == chunk]
        ax.plot([r["capacity"] for r in rs], [r["tok_s"] for r in rs], "o-",
                label=f"chunks of {chunk}" if chunk else "all S slots (unchunked)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"cache capacity S (prompt {result['prompt_tokens']} + "
                  f"{result['new_tokens']} new tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title("same decode, growing capacity")
    if result.get("capacity"):
        ax.legend()
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle("demo target, AR greedy, batch 1, 2-core CPU", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except SpecjaxError as e:
        print(f"context_length.py: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:  # before any work: a bad path fails now, not after the sweeps
            check_output_file(path, flag)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SpecjaxError("--plot needs matplotlib (pip install matplotlib)") from None

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    from specjax.models.checkpoint import load_model

    if args.quick:
        from flax import nnx

        from specjax.models.model import Transformer
        from specjax.testing.tiny import tiny_config

        target = Transformer(tiny_config(512), rngs=nnx.Rngs(0))
        import numpy as np

        ids = np.random.default_rng(0).integers(0, 512, 4096).tolist()
        args.capacities, args.contexts = [64, 512], [32, 512]
        args.new_tokens, args.prompt_tokens, args.repeats = 16, 16, 1
        args.context_new_tokens = 16
    else:
        target = load_model(args.target)
        ids = text_ids(os.path.join(os.path.dirname(args.target.rstrip("/")), "tokenizer"),
                        max([args.prompt_tokens, *args.contexts]))
    result = {"new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens}
    if args.capacities:
        rows, same = capacity_sweep(target, ids, args, log)
        result["capacity"], result["capacity_outputs_identical"] = rows, same
        print("| capacity S | attention | tokens/s |\n|---:|---|---:|")
        for r in rows:
            how = f"chunks of {r['chunk']}" if r["chunk"] else "all S slots"
            print(f"| {r['capacity']} | {how} | {r['tok_s']:.1f} |")
        print(f"\noutputs identical across settings: {same}\n")
    if args.contexts:
        rows = context_sweep(target, ids, args, log)
        result["context"] = rows
        print("| context | prefill s | decode tokens/s |\n|---:|---:|---:|")
        for r in rows:
            print(f"| {r['context']} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} |")
    if args.plot:
        write_plot(args.plot, result)
    if args.json:
        text = json.dumps(result, indent=1).encode()
        atomic_write(args.json, lambda f: f.write(text))
    return 0


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    if code == 0:  # a refusal stays one line
        print(f"(took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(code)
