"""Small random-weight checkpoints for tests, benchmarks and the engine demo.

    python -m specjax.testing.tiny out/tiny            # target + draft + prompts

The command line of `specjax.testing.tiny.make_demo` (whose module docstring says what
is written).
"""

from __future__ import annotations

import sys

from specjax import cli
from specjax.testing.tiny import make_demo


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m specjax.testing.tiny",
                            description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=512)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    make_demo(args.out_dir, args.vocab_size)
    print(f"wrote {args.out_dir}/target, {args.out_dir}/draft, {args.out_dir}/prompts.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
