"""Export specjax's eagle3 and block drafters to the EAGLE-3 and DFlash layouts.

    python -m specjax.drafters.convert --to eagle3-hf runs/eagle3/drafter out/eagle3-hf
    python -m specjax.drafters.convert --to dflash runs/block/drafter out/dflash \\
        [--target checkpoints/demo/target] [--dtype bfloat16]

The command line of `specjax.drafters.convert.export_dir` (whose module docstring says
what each layout holds and which drafters it refuses).
"""

from __future__ import annotations

import sys

from specjax import cli
from specjax.drafters.convert import export_dir
from specjax.drafters.external import LAYOUTS
from specjax.errors import SpecjaxError


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m specjax.drafters.convert",
                            description=__doc__.splitlines()[0])
    ap.add_argument("--to", required=True, choices=LAYOUTS, help="the layout to write")
    ap.add_argument("src", help="a drafter directory written by train.py")
    ap.add_argument("dst", help="the directory to write (must not exist)")
    ap.add_argument("--target", help="the target's HF directory (default: the recorded one)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        export_dir(args.src, args.dst, args.to, args.target, args.dtype)
    except SpecjaxError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst} ({args.to})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
