"""The path selector's calibration at T > 0 (issue 52): the shipped block drafter
(checkpoints/demo/drafters/block; its selector trained against the target's greedy token)
continued 256 steps two ways on the same data order, the selector's target the greedy token
again (the control) or the target's distribution over its 16 candidates
(`drafter.selector_soft_labels`):

    python train.py --config configs/drafters/block_cpu_soft_selector.yaml
    python train.py --config configs/drafters/block_cpu_soft_selector.yaml \\
      --set drafter.selector_soft_labels=false --run-dir runs/block_cpu_hard_selector
    python benchmarks/studies/block/soft_selector.py [--prompts N] [--only NAME ...]
    python benchmarks/studies/block/soft_selector.py --report

Each case is one decode.py run at --gamma fixed (G = 7, so tau compares drafters and not
schedules) at T = 0 and T = 1 on the first N bundled prompts (benchmarks/studies/block/
runs.py). The runs' exports get the shipped drafter's draft_vocab.json (the same hot
vocabulary for all three). Summaries and the table: benchmarks/results/studies/block/
soft_selector/.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))  # an uninstalled checkout

from benchmarks.studies.block import runs  # noqa: E402

OUT = "benchmarks/results/studies/block/soft_selector"
SHIPPED = "checkpoints/demo/drafters/block"
DRAFTERS = {"shipped": SHIPPED, "hard": "runs/block_cpu_hard_selector/drafter",
            "soft": "runs/block_cpu_soft_selector/drafter"}
CASES = {f"{name} T={t}": (path, ["--gamma", "fixed", "--temperature", str(t)])
         for t in (0, 1) for name, path in DRAFTERS.items()}


def _shared_vocabulary() -> None:
    """The shipped drafter's draft_vocab.json into the runs' exports that lack it."""
    vocab = os.path.join(runs.ROOT, SHIPPED, "draft_vocab.json")
    for path in DRAFTERS.values():
        dst = os.path.join(runs.ROOT, path, "draft_vocab.json")
        if os.path.isdir(os.path.dirname(dst)) and not os.path.exists(dst):
            shutil.copyfile(vocab, dst)


def main(argv=None) -> int:
    return runs.main(argv, __doc__, "soft_selector.py", CASES, OUT,
                     "The path selector's target at T > 0", 48, _shared_vocabulary)


if __name__ == "__main__":
    sys.exit(main())
