"""Trains a language model (objective lm) or a drafter against a frozen target (objectives
ttt and block) on a device mesh; resumes from its run dir.

    python train.py --config configs/demo_target.yaml
    python train.py --config configs/demo_draft.yaml --set train.steps=2000 --run-dir runs/d
    python train.py --config configs/drafters/eagle3.yaml --target checkpoints/demo/target
    python train.py --config configs/demo_target.yaml --distributed     # one per host
    python train.py --config C.yaml --distributed --coordinator 10.0.0.1:1234 \
        --num-processes 2 --process-id 0                                # where not detected

A run dir that holds checkpoints is resumed from the newest one (settings that differ
from its config.yaml are named in a warning). SIGTERM saves a
checkpoint and exits 0. Bad flags or config values exit 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys

from specjax import cli


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="train.py",
                            description="Train a specjax model (see configs/*.yaml).")
    ap.add_argument("--config", required=True, help="YAML config file (configs/*.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE",
                    help="override a config key by its dotted name, e.g. train.steps=20 "
                         "(repeatable)")
    ap.add_argument("--run-dir", help="checkpoints, metrics and export (default: run_dir "
                                      "in the config, else runs/<config name>)")
    ap.add_argument("--target", help="drafter objectives: the frozen target's HF directory "
                                     "(overrides the config's target)")
    ap.add_argument("--stop-at-step", type=int, default=None,
                    help="checkpoint and exit after this step (the schedule keeps "
                         "train.steps)")
    ap.add_argument("--distributed", action="store_true",
                    help="one process of a multi-process run (one per host): calls "
                         "jax.distributed.initialize(), which detects TPU pods and SLURM")
    ap.add_argument("--coordinator", metavar="HOST:PORT",
                    help="--distributed: process 0's address, where it is not detected")
    ap.add_argument("--num-processes", type=int, metavar="N",
                    help="--distributed: how many processes (with --coordinator)")
    ap.add_argument("--process-id", type=int, metavar="I",
                    help="--distributed: this process's index in [0, N) (with "
                         "--coordinator)")
    ap.add_argument("--kernels", choices=("auto", "pallas", "reference", "chunked"),
                    help="attention of the training forwards (overrides train.kernels): "
                         "pallas_kernels.attention.packed_attention (pallas), jnp "
                         "(reference), or jnp one query chunk at a time with "
                         "recomputation (chunked: long rows on CPU); auto (default): "
                         "pallas on TPU/GPU, reference on CPU")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.errors import SpecjaxError

    cluster = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and any(v is not None for v in cluster):
        print("train.py: error: --coordinator, --num-processes and --process-id need "
              "--distributed", file=sys.stderr)
        return 2
    try:
        from specjax.train import load_config, train

        overrides = list(args.overrides)
        if args.kernels:
            overrides.append(f"train.kernels={args.kernels}")
        cfg = load_config(args.config, overrides, run_dir=args.run_dir, target=args.target)
        if args.distributed:
            from specjax.train import multihost

            multihost.initialize(*cluster)
        result = train(cfg, stop_at=args.stop_at_step, progress=not args.no_progress)
    except SpecjaxError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    import jax

    if jax.process_index() != 0:  # process 0 reports for the run
        return 0
    what = "preempted: checkpointed" if result.preempted else "stopped"
    if result.step >= cfg.train.steps:
        what = "done"
    rate = f", {result.tokens_per_s:.0f} tokens/s" if result.tokens_per_s else ""
    val = result.val_losses.get(result.step)
    val = f", val_loss {val:.4f}" if val is not None else ""
    best = ""
    if result.best is not None:
        best = f", best tau {result.best['tau']:.3f} at step {result.best['step']}"
    out = f", exported {result.export_dir}" if result.export_dir else ""
    print(f"train.py: {what} at step {result.step} in {cfg.run_dir}{val}{rate}{best}{out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
