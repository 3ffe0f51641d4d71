"""Smoke test of benchmarks/compare.py on the tiny random demo: a --quick run finishes,
writes the JSON and PNG, and every greedy speculative run equals AR token for token
(not the speed figures, which depend on the machine); bad input exits 2 in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "compare.py")
# benchmarks.compare.JSON_KEYS (not imported: importing the script sets up jax and torch
# and changes this process's environment).
JSON_KEYS = {"args", "environment", "load_average", "models", "prompts", "gamma",
             "new_tokens", "repeats", "threads", "systems", "lossless", "batch_sweep"}
SYSTEMS = {"transformers-greedy", "transformers-assisted", "transformers-prompt-lookup",
           "specjax-ar", "specjax-draft", "specjax-ngram", "specjax-ar-T1",
           "specjax-draft-T1-token", "specjax-draft-T1-block", "specjax-blk",
           "specjax-blk-T1-token", "specjax-blk-T1-block"}
T0_SPECULATIVE = ("specjax-draft", "specjax-ngram", "specjax-blk")
ALPHA = ("specjax-draft", "specjax-ngram", "specjax-draft-T1-token", "specjax-draft-T1-block",
         "specjax-blk", "specjax-blk-T1-token", "specjax-blk-T1-block")


def run_script(args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def demo_args(demo):
    return ["--target", demo / "target", "--draft", demo / "draft",
            "--prompts", demo / "prompts.jsonl"]


def block_drafter(demo, path):
    """A random-init block drafter (G=3) exported for the tiny demo target at `path`."""
    from flax import nnx

    from specjax.drafters import DrafterConfig, build_network
    from specjax.drafters.io import save_drafter
    from specjax.models.config import ModelConfig

    cfg = ModelConfig.from_dir(str(demo / "target"))
    dcfg = DrafterConfig.for_target(cfg, "block", gamma=3)
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    save_drafter(str(path), dcfg, nnx.state(net, nnx.Param), str(demo / "target"))
    return path


@pytest.mark.slow  # the heaviest benchmark test (transformers and every system); its bad
# input is checked in the default run
def test_compare_quick(tiny_demo, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "out" / "compare.json", tmp_path / "out" / "compare.png"
    blk = block_drafter(tiny_demo, tmp_path / "blk")
    proc = run_script([*demo_args(tiny_demo), "--quick", "--threads", "1",
                       "--drafters", blk, "--json", js, "--plot", png])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| specjax-ar |" in proc.stdout and "| batch |" in proc.stdout
    assert "Traceback" not in proc.stderr

    r = json.loads(js.read_text())
    assert set(r) == JSON_KEYS
    assert set(r["systems"]) == SYSTEMS
    G, n_new, n = r["gamma"], r["new_tokens"], r["prompts"]["count"]
    assert (G, n_new, n, r["repeats"]) == (4, 16, 2, 1)
    for name, s in r["systems"].items():
        assert len(s["wall_s"]) == 1 and all(w > 0 for w in s["wall_s"]), name
        assert {"median", "min", "max"} <= set(s["tokens_per_s"]), name
        assert [len(o) for o in s["outputs"]] == [n_new] * n, name  # EOS disabled: exact
        assert s["outputs_stable"] is True, name
        assert s["speedup_vs_specjax_ar"] > 0 and s["speedup_vs_transformers_greedy"] > 0
        if s["temperature"] == 0:
            eq = s["equal_to_transformers_greedy"]
            assert eq["of"] == n and 0 <= eq["mean_common_prefix"] <= n_new, name
        else:
            assert s["equal_to_transformers_greedy"] is None, name
    for name in ALPHA:
        s = r["systems"][name]
        g = 3 if "blk" in name else G  # a learned drafter runs at its trained G
        assert s["gamma"] == g and len(s["alpha"]) == g and 1.0 <= s["tau"] <= g + 1, name
        assert all(a is None or 0.0 <= a <= 1.0 for a in s["alpha"]), name
    assert r["systems"]["specjax-ar"]["tau"] is None
    assert r["systems"]["specjax-ar"]["speedup_vs_specjax_ar"] == pytest.approx(1.0)
    assert r["systems"]["transformers-assisted"]["target_forwards"] >= 1
    # Greedy speculation is lossless: identical to specjax AR, token for token.
    ar = r["systems"]["specjax-ar"]["outputs"]
    for name in T0_SPECULATIVE:
        assert r["systems"][name]["equals_specjax_ar"] is True, name
        assert r["systems"][name]["outputs"] == ar, name
        assert r["lossless"][name] is True
    assert all(r["lossless"].values())
    sweep = r["batch_sweep"]
    assert [(b["batch_size"], b["drafter"]) for b in sweep] == [
        (1, "draft"), (1, "blk"), (2, "draft"), (2, "blk")]
    for b in sweep:
        assert b["spec_equals_ar"] is True
        assert b["ar"]["tokens_per_s"]["median"] > 0 and b["speedup"] > 0
        assert b["rows"] % b["batch_size"] == 0
    assert {"jax", "torch", "usable_cores"} <= set(r["environment"])
    assert {"start", "end"} == set(r["load_average"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["missing_target", "gamma_zero", "gamma_not_int"])
def test_bad_input_exits_2_with_one_line(tiny_demo, tmp_path, case):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    extra = {"missing_target": ["--target", tmp_path / "nope"],
             "gamma_zero": ["--gamma", 0],
             "gamma_not_int": ["--gamma", "three"]}[case]
    proc = run_script([*demo_args(tiny_demo), "--quick", *extra, "--json", js, "--plot", png],
                      timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert err.count("\n") == 1 and err.startswith("compare.py: error:"), err
    assert ("nope" if case == "missing_target" else "--gamma") in err
    assert "Traceback" not in err
    assert not js.exists() and not png.exists()
