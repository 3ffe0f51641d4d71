"""scripts/big_round.sh (the 8B-size accelerator round, issue 54): bad arguments exit 2
with one line; the projection arithmetic; --dry-run (slow) runs every step on the CPU at
tiny shapes and each passes, so the round a device session runs cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "big_round.sh")
DRIVER = os.path.join(ROOT, "benchmarks", "big_round.py")

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("args, match", [
    (["--budget", "60"], "--out DIR is required"),
    (["--out", "X", "--budget", "soon"], "--budget SECONDS"),
    (["--out", "X", "--budget", "9", "--part", "4"], "--part must be 1, 2 or 3"),
    (["--out", "X", "--bogus"], "unknown argument --bogus"),
])
def test_bad_arguments_exit_2(tmp_path, args, match):
    args = [str(tmp_path / "o") if a == "X" else a for a in args]
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert match in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, match", [
    (["--only", "nope"], "unknown step 'nope'"),
    (["--only", "ar", "--part", "1"], "--only and --part"),
    (["--ar-plan", "1:attention"], "--ar-plan: bad row '1:attention'"),
    (["--heads-plan", "1:medusa"], "--heads-plan: bad row '1:medusa'"),
])
def test_driver_rejects_bad_input(tmp_path, args, match):
    p = subprocess.run([sys.executable, DRIVER, "--out", str(tmp_path / "o"), *args],
                       capture_output=True, text=True)
    assert p.returncode == 2 and match in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_projection_arithmetic():
    """A step cost exactly linear in tau (10 + 2 tau ms, AR 10 ms) and a head of 3 ms:
    the projected speedups are tau * 10 / (10 + 2 tau) and tau * 10 / (13 + 2 tau)."""
    sys.path.insert(0, ROOT)
    from benchmarks.big_round import PUBLISHED, projection

    spec = [{"B": 1, "tau": t, "ms_per_step": 10 + 2 * t, "ar_ms_per_step": 10.0}
            for t in (1.0, 2.5, 5.0)]
    heads = [{"B": 1, "kind": "eagle3", "drafter_ms_per_step": 3.0},
             {"B": 8, "kind": "eagle3", "drafter_ms_per_step": 9.0}]
    rows = projection({"steps": {"spec": {"rows": spec}, "heads": {"rows": heads}}})
    assert [r["published"] for r in rows] == list(PUBLISHED)
    for r in rows:
        t = r["tau"]
        assert r["speedup_free_drafter"] == pytest.approx(t * 10 / (10 + 2 * t))
        assert r["speedup_with_eagle3_head"] == pytest.approx(t * 10 / (13 + 2 * t))
    assert projection({"steps": {}}) == []


@pytest.mark.slow
def test_dry_run_every_step_passes(tmp_path):
    out = tmp_path / "round"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", SCRIPT, "--dry-run", "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=850)
    res = json.loads((out / "big_round.json").read_text())
    assert p.returncode == 0, (res.get("failed"), p.stdout[-3000:])
    steps = res["steps"]
    assert res["dry_run"] and res["failed"] == []
    assert set(steps) == {"environment", "bandwidth", "ar", "cmdbuf", "profile", "spec",
                          "tree", "heads", "train", "exact", "update"}
    upd = {r["kind"]: r for r in steps["update"]["rows"]}
    assert set(upd) == {"eagle3", "eagle3-noupdate", "block", "block-noupdate"}
    assert "update_ms_per_step" in upd["eagle3"] and "propose_ms_per_step" in upd["block"]
    assert [r["identical_to_ar"] for r in steps["exact"]["rows"]][-1] is True
    assert all("error" not in r and "skipped" not in r for r in steps.values()), steps
    spec = steps["spec"]["rows"]
    assert [r["target_tau"] for r in spec] == [1.0, 2.0, 4.0, 6.0]
    assert spec[0]["tau"] == 1.0 and all(r["identical_to_ar"] for r in spec)
    # one compiled loop for every tau (the acceptance is a parameter)
    assert all(r["compile_s"] <= 0.2 * spec[0]["compile_s"] for r in spec[1:]), spec
    assert all(r["identical_to_ar"] for r in steps["tree"]["rows"] + steps["heads"]["rows"])
    assert {r["setting"] for r in steps["cmdbuf"]["rows"]} == {"none", "with_while"}
    assert all(r["tokens_per_s"] > 0 and r["plan_bytes"] > 0 for r in steps["train"]["rows"])
    assert res["projection"] and (out / "profile_summary.json").exists()
    assert (out / "big_round.log").exists()
