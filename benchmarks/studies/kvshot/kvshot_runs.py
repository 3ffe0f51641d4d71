"""The KVShot study's run matrix, read by both kvshot.py (which trains it) and
kvshot_report.py (which reports on it), beside this file in benchmarks/studies/kvshot/: the
run names in training order and where each run lives."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CONFIG_DIR = os.path.join(ROOT, "configs", "study")
RUN_ROOT = os.path.join(ROOT, "runs", "study")
# Training order: hybrid_from_eagle3 starts from eagle3's export, so eagle3 comes first.
RUNS = ("eagle3", "kv2", "block_kv", "hybrid_from_eagle3", "hybrid", "kv1", "kv4",
        "block_hidden", "block_both")


def finished(name: str) -> bool:
    """True once run `name` exported its drafter (runs/study/NAME/drafter/config.json)."""
    return os.path.isfile(os.path.join(RUN_ROOT, name, "drafter", "config.json"))


# The redone study (issue 29): every run on the same regenerated data (the target's own
# greedy text), equal supervised positions per step (64 TTT chains or 64 blocks of G
# positions per sequence), the KV and hidden contexts on the same target layers, and
# SEEDS seeds each (train.seed; data order and held-out split are the same for all).
# block_kv is both "kv 2 layers trained block-wise" and "block with KV context": the block
# drafter with KV context has exactly the KV-only drafter's weights. eagle3_more is the
# control of hybrid_from_eagle3: eagle3 trained on from the same seed's eagle3 export for
# the same extra steps. The ablation that zeroes the hybrid's KV branch is an inference
# setting of hybrid_from_eagle3, not a run.
MATRIX_CONFIG_DIR = os.path.join(ROOT, "configs", "study2")
MATRIX_ROOT = os.path.join(ROOT, "runs", "study2")
MATRIX = ("eagle3", "kv2", "block_kv", "block_hidden", "hybrid_from_eagle3", "eagle3_more")
SEEDS = (0, 1, 2)
# runs that start from another run's export of the same seed
WARM_START = {"hybrid_from_eagle3": "eagle3", "eagle3_more": "eagle3"}


def matrix_run_dir(name: str, seed: int) -> str:
    """runs/study2/NAME-sSEED (absolute)."""
    return os.path.join(MATRIX_ROOT, f"{name}-s{seed}")


def matrix_finished(name: str, seed: int) -> bool:
    """True once the run exported its drafter."""
    return os.path.isfile(os.path.join(matrix_run_dir(name, seed), "drafter", "config.json"))


def matrix_order(names=MATRIX, seeds=SEEDS) -> list[tuple[str, int]]:
    """(name, seed) in training order: seed-major, so every drafter has one seed before
    any has two; a warm-started run comes after the run it starts from."""
    return [(n, s) for s in seeds for n in MATRIX if n in names]
