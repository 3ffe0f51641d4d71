"""Verification scheduled by a trained confidence head (issue 52): the block drafter of
configs/drafters/block_cpu.yaml without and with DSpark's confidence head
(configs/drafters/block_cpu_confidence.yaml), each under --gamma fixed and decode.py's
default --gamma auto (which, for a drafter with a confidence head, picks each step's verify
length from its confidence: docs/adaptive.md, "Verify lengths from the drafter's
confidence"; without one, from the cost table and the running acceptance estimates).

    python benchmarks/studies/block/confidence.py [--prompts N] [--only NAME ...]
    python benchmarks/studies/block/confidence.py --report

Each case is one `python decode.py --drafter DIR --show 0 [--gamma fixed]` run on the first
N bundled prompts (128 new tokens, T = 0, batch 1), its autoregressive reference
interleaved batch by batch in the same run (the speedup is a ratio within one run).
Summaries: benchmarks/results/studies/block/confidence/NAME.json; the table:
benchmarks/results/studies/block/confidence/README.md.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))  # an uninstalled checkout

from benchmarks.studies.block import runs  # noqa: E402

OUT = "benchmarks/results/studies/block/confidence"

# name -> (drafter directory, extra decode.py flags)
CASES = {
    "plain fixed": ("runs/block_cpu/drafter", ["--gamma", "fixed"]),
    "plain auto": ("runs/block_cpu/drafter", []),
    "confidence fixed": ("runs/block_cpu_confidence/drafter", ["--gamma", "fixed"]),
    "confidence auto": ("runs/block_cpu_confidence/drafter", []),
}


def main(argv=None) -> int:
    return runs.main(argv, __doc__, "confidence.py", CASES, OUT,
                     "Verification scheduled by a trained confidence head", 16)


if __name__ == "__main__":
    sys.exit(main())
