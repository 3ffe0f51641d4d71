"""`python -m specjax.decoding.prompts OUT [--n N] [--seed S]`: writes the held-out
code-completion prompts of `specjax.decoding.prompts.held_out_prompts` as JSONL."""

from __future__ import annotations

import json
import os
import sys

from specjax import cli
from specjax.decoding.prompts import held_out_prompts
from specjax.errors import SpecjaxError
from specjax.fileio import atomic_write


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m specjax.decoding.prompts",
                            description="Write held-out code-completion prompts (JSONL).")
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.n < 1:
            raise SpecjaxError(f"--n={args.n} must be >= 1")
        if os.path.isdir(args.out):  # before the corpus is read
            raise SpecjaxError(f"out {args.out} is a directory; pass a file name")
        prompts = held_out_prompts(args.n, args.seed)
        data = "".join(json.dumps(p) + "\n" for p in prompts).encode()
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            atomic_write(args.out, lambda f: f.write(data))
        except OSError as e:
            raise SpecjaxError(f"out {args.out} cannot be written ({e.strerror})") from None
    except SpecjaxError as e:
        print(f"python -m specjax.decoding.prompts: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
