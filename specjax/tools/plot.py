"""Training curves of one or more runs as a PNG, from their metrics.jsonl files.

    python -m specjax.train.plot runs/demo_target_continue/metrics.jsonl --out curve.png

The command line of `specjax.train.plot.plot` (whose module docstring says what is drawn).
"""

from __future__ import annotations

import sys

from specjax import cli
from specjax.errors import SpecjaxError
from specjax.train.plot import plot


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m specjax.train.plot",
                            description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--labels", nargs="+", help="one label per file")
    ap.add_argument("--offset-tokens", nargs="+", type=int, help="one token offset per file")
    ap.add_argument("--title")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for flag, v in (("--labels", args.labels), ("--offset-tokens", args.offset_tokens)):
            if v is not None and len(v) != len(args.metrics):
                raise SpecjaxError(f"{flag} needs one value per metrics file")
        plot(args.metrics, args.out, args.labels, args.offset_tokens, args.title)
    except SpecjaxError as e:
        print(f"plot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
