"""`python -m specjax.prepare --target DIR --data chats.jsonl --out DIR`: chat
conversations rendered with the target's chat template into a token stream and an
assistant-turn loss mask (`specjax.prepare.prepare`, whose docstring says what is
written)."""

from __future__ import annotations

import os
import sys

from specjax import cli
from specjax.errors import SpecjaxError
from specjax.prepare import FILES, prepare


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(
        prog="specjax.prepare",
        description="Chat conversations (JSONL, OpenAI or ShareGPT) rendered with the "
                    "target's chat template into a token stream and an assistant-turn "
                    "loss mask, for drafter training.")
    ap.add_argument("--target", required=True, metavar="DIR",
                    help="HF model directory whose tokenizer has a chat template")
    ap.add_argument("--data", required=True, metavar="FILE.jsonl", help="conversations")
    ap.add_argument("--out", required=True, metavar="DIR",
                    help="output directory (must not exist or be empty)")
    ap.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                    help="share of whole conversations held out as val_*.npy (default 0)")
    ap.add_argument("--max-length", type=int, default=None, metavar="N",
                    help="cut conversations to their first N tokens (default: keep whole; "
                         "the trainer cuts rows from the concatenated stream, so a long "
                         "conversation spans several rows)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the validation split")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        m = prepare(args.target, args.data, args.out, val_fraction=args.val_fraction,
                    max_length=args.max_length, seed=args.seed)
    except SpecjaxError as e:
        print(f"specjax.prepare: error: {e}", file=sys.stderr)
        return 2
    for split, c in m["splits"].items():
        print(f"{split}: {c['conversations']} conversations, {c['tokens']} tokens "
              f"({c['assistant_tokens']} assistant) -> "
              f"{os.path.join(args.out, FILES[split][0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
