"""Block drafters against eagle3 and n-gram lookup (issue 52, docs/block_drafting.md): each
system a decoding session of decode.py's flags, measured as decode.py measures
(speculative and autoregressive runs interleaved per batch, in one process), with the
machinery of benchmarks/trees.py (`benchmarks.lib.system_table.measure`: T = 0, T = 1 with
token and block verification, batch 1 and 4, the bundled and held-out prompt sets, draft /
verify ms of one step at T = 0, B = 1).

    python benchmarks/block_drafting.py                                  # the shipped drafters
    python benchmarks/block_drafting.py --drafter selector=runs/study_block/selector/drafter
    python benchmarks/block_drafting.py --render-only                    # the doc from the JSON

Systems: the shipped eagle3 head as one chain and as its best CPU tree (EAGLE-2 2x12,
docs/trees.md), n-gram lookup, the shipped block drafter as one chain and as a best-first
tree over its block (`--tree-topk 4 --tree-nodes 16`), and each `--drafter NAME=DIR` (a
block drafter directory) as a chain and, unless it has a Markov head, as the same tree.
Results: benchmarks/results/block_drafting.json and the `<!-- block:results -->` section
of docs/block_drafting.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.lib.report import save_results  # noqa: E402
from benchmarks.lib.system_table import System, measure, merge, render  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "block_drafting.json")
DOC = os.path.join(ROOT, "docs", "block_drafting.md")
TREE = (4, 16)  # the block tree: top-4 per position, 16 nodes (root included)

SHIPPED = (
    System("eagle3 chain", "eagle3"),
    System("eagle3 tree 2x12", "eagle3", tree=(2, 12), rules=("token",)),
    System("ngram chain", "ngram"),
    System("block chain", "block"),
    System(f"block tree {TREE[0]}x{TREE[1]}", "block", tree=TREE, rules=("token",)),
)


def candidate_systems(name: str, path: str) -> list[System]:
    """A block drafter directory as a chain and (without a Markov head) a tree."""
    from specjax.drafters.config import CONFIG_NAME

    raw = json.load(open(os.path.join(path, CONFIG_NAME)))
    out = [System(f"{name} chain", path, kind=raw.get("kind"))]
    if not raw.get("markov_rank"):  # a Markov head drafts one chain
        out.append(System(f"{name} tree {TREE[0]}x{TREE[1]}", path, tree=TREE,
                          rules=("token",), kind=raw.get("kind")))
    return out


def write_doc(res: dict, doc: str = DOC) -> None:
    from benchmarks.lib.report import replace_doc_section

    replace_doc_section(doc, "block:results", render(res),
                        "# Block drafting\n\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                    help="a block drafter directory to measure beside the shipped ones")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--only", nargs="+", help="these systems only (by name)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-step-timing", action="store_true")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other rows of --json: replace only the rows measured now "
                         "(system_table.merge), each tagged with its own git and date")
    args = ap.parse_args(argv)
    if args.render_only:
        write_doc(json.load(open(args.json)))
        return 0
    systems = list(SHIPPED)
    for spec in args.drafter:
        name, sep, path = spec.partition("=")
        if not sep or not os.path.isdir(path):
            ap.exit(2, f"block_drafting.py: --drafter {spec!r}: want NAME=DIR with a drafter "
                       "directory\n")
        systems += candidate_systems(name, path)
    res = measure(args.prompts, args.new_tokens, args.temperatures, args.batch_sizes,
                  args.only, timing=not args.no_step_timing, warmup=args.warmup,
                  dtype=args.dtype, systems=tuple(systems))
    if args.merge and os.path.exists(args.json):
        res = merge(json.load(open(args.json)), res)
    save_results(args.json, res, RESULTS, write_doc)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
