"""benchmarks/studies/kvshot/kvshot_device.py: the KVShot matrix on a lent accelerator, checked on the CPU
with --dry-run (a few training steps, tiny measurements)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

from benchmarks.studies.kvshot import kvshot_device as kd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "studies", "kvshot", "kvshot_device.py")


def test_selected_adds_warm_start_parents():
    assert kd.selected(None) == list(kd.MATRIX)
    assert kd.selected(["hybrid_from_eagle3"]) == ["eagle3", "hybrid_from_eagle3"]
    assert kd.selected(["kv2"]) == ["kv2"]


@pytest.mark.parametrize("args", [["train", "--out", "X", "--budget", "0"],
                                  ["all", "--out", "X", "--budget", "10", "--jobs", "0"],
                                  ["all", "--out", "X", "--budget", "10", "--only", "nope"]])
def test_bad_arguments_exit_2(tmp_path, args):
    args = [str(tmp_path / a) if a == "X" else a for a in args]
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_dry_run_trains_measures_and_packs(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    p = subprocess.run([sys.executable, SCRIPT, "all", "--dry-run", "--out", str(out),
                        "--budget", "900", "--seeds", "0", "--only", "hybrid_from_eagle3",
                        "--jobs", "2", "--runs-root", str(runs)],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    with tarfile.open(out / "study_train.tar.gz") as t:
        names = t.getnames()
    for run in ("eagle3-s0", "hybrid_from_eagle3-s0"):
        assert f"runs/runs/{run}/drafter/config.json" in names
        assert f"runs/runs/{run}/metrics.jsonl" in names
    with tarfile.open(out / "study_measure.tar.gz") as t:
        got = sorted(os.path.basename(n) for n in t.getnames())
        rec = json.load(t.extractfile(
            next(n for n in t.getnames() if n.endswith("hybrid_from_eagle3-s0.json"))))
    assert got == ["eagle3-s0.json", "hybrid_from_eagle3-s0.json"]
    # the hybrid is measured with its KV branch zeroed too, and T = 0 equals AR on CPU f32
    assert {"t0", "t0_nokv", "t1_block"} <= set(rec["decode"])
    assert all(rec["decode"]["t0"]["identical"])
    assert "train: 2 of 2 runs finished" in (out / "study_device.log").read_text()
