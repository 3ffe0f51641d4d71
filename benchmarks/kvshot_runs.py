"""The KVShot study's run matrix, read by both benchmarks/kvshot.py (which trains it) and
benchmarks/kvshot_report.py (which reports on it): the run names in training order and
where each run lives."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(ROOT, "configs", "study")
RUN_ROOT = os.path.join(ROOT, "runs", "study")
# Training order: hybrid_from_eagle3 starts from eagle3's export, so eagle3 comes first.
RUNS = ("eagle3", "kv2", "block_kv", "hybrid_from_eagle3", "hybrid", "kv1", "kv4",
        "block_hidden", "block_both")


def finished(name: str) -> bool:
    """True once run `name` exported its drafter (runs/study/NAME/drafter/config.json)."""
    return os.path.isfile(os.path.join(RUN_ROOT, name, "drafter", "config.json"))
