"""`python -m specjax.plan --config CONFIG [--drafter D] [--mesh data=D,model=M]`: the
per-device memory of decoding and of training, from configs alone, as a markdown table
(`specjax.plan.decode_plan` and `train_plan`)."""

from __future__ import annotations

import os
import sys

from specjax import cli, plan
from specjax.errors import SpecjaxError


def build_parser() -> cli.ArgumentParser:
    from specjax.drafters import registry

    ap = cli.ArgumentParser(
        prog="python -m specjax.plan",
        description="Per-device memory of decoding and of training, from configs alone.")
    ap.add_argument("--config", required=True, help="the target's HF config.json (or its dir)")
    ap.add_argument("--drafter", help="a drafter directory, or a kind: "
                                      f"{', '.join(registry.kinds())} (block:kv, block:both: "
                                      "a block drafter's context)")
    ap.add_argument("--mesh", default="data=1,model=1", help="data=D,model=M[,fsdp=F]")
    ap.add_argument("--max-length", type=int, default=4096, help="S: prompt + new tokens")
    ap.add_argument("--batch", type=int, default=1, help="decoding rows")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="decoding (and frozen-target) dtype")
    ap.add_argument("--train-batch", type=int, default=None,
                    help="also plan a training step with this global batch")
    ap.add_argument("--seq-len", type=int, default=2048, help="training T")
    ap.add_argument("--device-memory-gb", type=float, default=None,
                    help="per-device memory to compare with (GB)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from specjax.models.config import ModelConfig

        path = args.config
        cfg = ModelConfig.from_dir(os.path.dirname(path) if os.path.isfile(path) else path)
        mesh = plan.parse_mesh(args.mesh)
        for flag in ("max_length", "batch", "gamma", "seq_len"):
            if getattr(args, flag) < 1:
                raise SpecjaxError(f"--{flag.replace('_', '-')} must be >= 1")
        from specjax.dtypes import numpy_dtype

        dtype = numpy_dtype(args.dtype)
        dcfg = plan.drafter_config(args.drafter, cfg, args.gamma) if args.drafter else None
        sections = {"decoding": plan.decode_plan(cfg, mesh, args.batch, args.max_length,
                                                 dtype, dcfg=dcfg, gamma=args.gamma)}
        if args.train_batch:
            objective = "lm" if dcfg is None else dcfg.spec.objective
            sections[f"training ({objective}, batch {args.train_batch} x T {args.seq_len})"] = \
                plan.train_plan(cfg, mesh, args.train_batch, args.seq_len, dcfg=dcfg,
                                objective=objective, dtype=dtype)
    except SpecjaxError as e:
        print(f"specjax.plan: error: {e}", file=sys.stderr)
        return 2
    m = mesh.shape
    print(f"{cfg.family} target: {cfg.num_params / 1e9:.2f}B parameters (L {cfg.num_layers}, "
          f"D {cfg.hidden_size}, N {cfg.num_heads}, K {cfg.num_kv_heads}, H {cfg.head_dim}, "
          f"F {cfg.intermediate_size}, V {cfg.vocab_size}); mesh data={m['data']} "
          f"fsdp={m['fsdp']} model={m['model']} ({m['data'] * m['fsdp'] * m['model']} devices)"
          + (f"; drafter {dcfg.kind}" if dcfg else ""))
    print(f"decoding: batch {args.batch}, max length {args.max_length}, {args.dtype}\n")
    print("| per device | bytes |\n|---|---|")
    for title, parts in sections.items():
        print(f"| **{title}** | |")
        for k, v in parts.items():
            print(f"| {k} | {plan.fmt_bytes(v)} |")
        total = sum(parts.values())
        fits = ""
        if args.device_memory_gb:
            fits = " (fits)" if total <= args.device_memory_gb * 1e9 else " (does NOT fit)"
        print(f"| total | **{plan.fmt_bytes(total)}**{fits} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
