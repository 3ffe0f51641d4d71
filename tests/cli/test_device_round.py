"""scripts/device_round.sh: bad arguments exit 2 with one line; --dry-run (slow) runs every
step of the device round on the CPU (Pallas interpret mode, tiny shapes) and each check
passes there, so the script a device session runs cannot rot between sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "device_round.sh")


@pytest.mark.parametrize("args, match", [
    (["--budget", "60"], "--out DIR is required"),
    (["--out", "X", "--budget", "soon"], "--budget SECONDS"),
    (["--out", "X", "--bogus"], "unknown argument --bogus"),
])
def test_bad_arguments_exit_2(tmp_path, args, match):
    args = [str(tmp_path / "o") if a == "X" else a for a in args]
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert match in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_driver_rejects_unknown_step(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device_round.py"),
                        "--out", str(tmp_path / "o"), "--only", "nope"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "unknown step 'nope'" in p.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_dry_run_every_step_passes(tmp_path):
    out = tmp_path / "round"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=1200)
    res = json.loads((out / "device_round.json").read_text())
    assert p.returncode == 0, (res.get("failed"), p.stdout[-3000:])
    steps = res["steps"]
    assert res["dry_run"] and res["failed"] == []
    assert all("error" not in r and "skipped" not in r for r in steps.values()), steps
    for name in ("verify_check", "attention_check", "packed_check", "big_target"):
        assert steps[name]["passed"] is True
    assert steps["decode_demo"]["identical"] is True
    assert len(steps["verify_check"]["cases"]) == 2 * 2 * 5  # shapes x dtypes x cases
    assert all(r["pallas_ms"] > 0 for r in steps["attention_time"]["rows"])
    assert (out / "device_round.log").exists()
    assert (out / "study_manifest.json").exists() and (out / "study_train.npy.gz").exists()


def test_device_results_match_documents(tmp_path):
    """The committed summary.md and docs/kernels.md section equal what device_report.py
    renders from the committed round JSONs (a figure edited by hand fails here)."""
    import glob

    report = os.path.join(ROOT, "benchmarks", "device_report.py")
    dirs = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "device", "*")))
    assert dirs
    for d in dirs:
        p = subprocess.run([sys.executable, report, d, "--check"], capture_output=True,
                           text=True)
        assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, report, str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and "no round*.json" in p.stderr
