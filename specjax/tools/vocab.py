"""`python -m specjax.drafters.vocab DIR [--size N] [--tokens-npy F.npy ...]`: writes a
hot draft vocabulary into a drafter directory (`specjax.drafters.vocab`, whose docstring
says what it is): the `--size` most frequent ids of the training split of the corpus, or
of the given token streams."""

from __future__ import annotations

import os
import sys

from specjax import cli
from specjax.drafters.vocab import (
    VOCAB_NAME,
    check_size,
    corpus_counts,
    save_draft_vocab,
    stream_counts,
)
from specjax.errors import SpecjaxError


def build_parser() -> cli.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m specjax.drafters.vocab",
                            description="Write a hot draft vocabulary (the most "
                                        "frequent training-split ids) into a drafter directory.")
    ap.add_argument("drafter", help="a drafter directory written by train.py")
    ap.add_argument("--size", type=int, default=2048, help="hot ids to keep (default 2048)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer directory (default: the drafter's target's)")
    ap.add_argument("--cache-dir", default="runs/token_cache",
                    help="where the tokenized corpus is cached")
    ap.add_argument("--tokens-npy", nargs="+", default=None,
                    help="count these flat .npy token streams instead of the corpus "
                         "(e.g. specjax.regenerate's train.npy)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from specjax.drafters.io import read_config

        cfg = read_config(args.drafter)
        vocab = int(cfg["vocab_size"])
        tok = args.tokenizer or cfg.get("target", {}).get("path")
        if not args.tokens_npy and (not tok or not os.path.isdir(tok)):
            raise SpecjaxError(f"--tokenizer: no tokenizer directory (the drafter records "
                               f"{tok!r}); pass --tokenizer DIR")
        check_size(args.size, vocab)  # before counting anything
        if args.tokens_npy:
            counts = stream_counts(args.tokens_npy, vocab)
            source = "token streams " + ", ".join(args.tokens_npy)
        else:
            counts = corpus_counts(tok, args.cache_dir, vocab)
            source = f"training split of the stdlib corpus, tokenizer {tok}"
        rec = save_draft_vocab(args.drafter, counts, args.size, source)
    except SpecjaxError as e:
        print(f"specjax.drafters.vocab: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.drafter}/{VOCAB_NAME}: {rec['size']} ids cover {rec['coverage']:.1%} of "
          f"{rec['counted_tokens']:,} training tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
