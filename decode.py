"""Speculative decoding from local HF Qwen3 / Llama-3 checkpoints.

    python decode.py          # the demo: bundled target + draft LM on the bundled prompts
    python decode.py --target DIR [--drafter {none,ngram,DIR}] --prompt TEXT
    python decode.py --target DIR --drafter DIR --prompts prompts.jsonl --output out.jsonl \
        --summary summary.json

With a drafter, autoregressive decoding of the same prompts also runs, interleaved
batch by batch, and the summary reports the speedup and whether greedy outputs are
identical (--no-compare-ar skips it).

Prompt lines are JSON objects with "prompt" (text), "input_ids" (list of ints), or a
conversation ("messages" with role/content, or ShareGPT "conversations"), and an
optional "id". Conversations, and with --chat text prompts as one user turn, are rendered
with the target's chat template up to their last user turn (docs/chat.md); decoding then
also stops at the template's end-of-turn token. Output lines, in input order: id,
prompt_ids (the ids decoded from), output_ids (new tokens only), text (when the target
has a tokenizer). Bad input exits with code 2 and one line on
stderr, and writes no output file.

The options are `specjax.decoding.options.DecodeConfig`'s fields and the run is
`specjax.decoding.session`'s: this script parses, runs, prints and writes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax import cli
from specjax.compile_cache import (  # noqa: F401 - re-exported (decode.enable_compile_cache)
    DEFAULT_COMPILE_CACHE,
    enable_compile_cache,
)
from specjax.decoding.loading import (  # noqa: F401 - re-exported for scripts and tests
    DEFAULT_GAMMA,
    DEMO_DIR,
    DEMO_DRAFTERS,
)
from specjax.decoding.prompts import read_prompts  # noqa: F401 - re-exported


def build_parser() -> argparse.ArgumentParser:
    from specjax.decoding.options import add_arguments

    ap = cli.ArgumentParser(prog="decode.py",
                            description="Lossless speculative decoding with specjax.")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="JSONL file of prompts (default: the bundled demo prompts)")
    src.add_argument("--prompt", help="a single text prompt")
    ap.add_argument("--chat", action="store_true",
                    help="text prompts (--prompt, \"prompt\" lines) are one user turn, "
                         "rendered with the target's chat template (conversation lines "
                         "always are)")
    add_arguments(ap)  # every DecodeConfig option
    ap.add_argument("--output", help="write completions to this JSONL file")
    ap.add_argument("--summary", help="write the summary to this JSON file")
    ap.add_argument("--show", type=int, default=3, help="completions to print")
    return ap


def check_outputs(args) -> None:
    """Every output path (an existing directory, a missing or unwritable parent) before any
    work. Raises: SpecjaxError (one line naming the flag)."""
    from specjax.errors import SpecjaxError
    from specjax.fileio import check_output_file

    for flag, path in (("--output", args.output), ("--summary", args.summary)):
        if path:
            check_output_file(path, flag)
    if args.output and args.summary and os.path.abspath(args.output) == os.path.abspath(
            args.summary):
        raise SpecjaxError(f"--output and --summary both name {args.output}; pass two files")


def run(args) -> int:
    from specjax.decoding import report
    from specjax.decoding.options import from_args
    from specjax.decoding.session import build
    from specjax.errors import SpecjaxError
    from specjax.fileio import atomic_write_all

    cfg = from_args(args)
    check_outputs(args)
    session = build(cfg)
    prompts, chat = session.read_prompts(prompt=args.prompt, path=args.prompts, chat=args.chat)
    result = session.run(prompts, chat=chat)
    for rec in result.records[:args.show]:
        print(report.show(rec, session.tokenizer))
    print("\n" + report.title(result.summary))
    print(report.format_summary(result.summary))
    files = []  # both or neither (the paths were checked before any work)
    if args.output:
        lines = "".join(json.dumps(r) + "\n" for r in result.records).encode()
        files.append((args.output, lambda f: f.write(lines)))
    if args.summary:
        text = (json.dumps(result.summary, indent=2) + "\n").encode()
        files.append((args.summary, lambda f: f.write(text)))
    try:
        atomic_write_all(files)
    except OSError as e:
        raise SpecjaxError(f"cannot write {e.filename or args.output} ({e.strerror}); "
                           "nothing was written") from None
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.errors import SpecjaxError

    try:
        return run(args)
    except SpecjaxError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
