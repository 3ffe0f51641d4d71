"""benchmarks/trees.py: the accelerator projection's limits and the report rendering (the
measurement itself runs the shipped drafters: `python benchmarks/trees.py --quick`)."""

import json

import pytest

from benchmarks import kernels as kb
from benchmarks import trees


@pytest.mark.parametrize("device", ["H100", "TPU v5e"])
def test_projection_limits(device):
    # No drafter cost and one verified node: a step is an autoregressive step, so the
    # speedup is tau itself.
    assert trees.project(3.0, 1, 0, 0, device) == pytest.approx(3.0)
    # Memory-bound verify forward (a few nodes): still tau.
    assert trees.project(3.0, 8, 0, 0, device) == pytest.approx(3.0)
    # Past the compute ridge (2 * params * nodes / peak > bytes / bandwidth) more nodes
    # cost more: the projection falls with N at fixed tau.
    ridge = kb.PEAK_FLOPS[device] / kb.BANDWIDTH[device]  # FLOPs per byte
    big = int(4 * ridge)
    assert trees.project(3.0, big, 0, 0, device) < trees.project(3.0, big // 2, 0, 0, device)
    # Drafter forwards are paid on top of the verify forward.
    assert trees.project(3.0, 8, 7, 1, device) < trees.project(3.0, 8, 0, 0, device)


def test_render_and_doc_section(tmp_path):
    rec = {"system": "eagle3 K=2", "temperature": 0.0, "verify": "greedy", "batch": 1,
           "prompts": "bundled", "tau": 4.5, "alpha": [0.9], "tokens_per_s": 10.0,
           "ar_tokens_per_s": 8.0, "speedup": 1.25, "nodes": 15, "gamma": 7,
           "compile_s": 1.0, "identical": True, "draft_ms": 3.0, "verify_ms": 5.0,
           "projected": {"H100": 3.1, "TPU v5e": 3.0}}
    res = {"runs": [rec, dict(rec, temperature=1.0, verify="token", identical=None)],
           "prompts": 2, "new_tokens": 8, "git": "abc", "date": "2026-11-26",
           "machine": "x", "cores": 2, "numpy": "2", "jax": "0.10.2", "weights": ["w"]}
    text = trees.render(res)
    assert "| T=0 | 1 | bundled | eagle3 K=2 | 15 | 4.50 |" in text
    assert "3.0 / 5.0" in text and "PROJECTION" in text and "| T=1 token |" in text
    doc = tmp_path / "trees.md"
    doc.write_text("# Draft trees\n\nprose\n")
    trees.write_doc(res, str(doc))
    trees.write_doc(res, str(doc))  # replaced, not appended twice
    body = doc.read_text()
    assert body.count("<!-- trees:results -->") == 1 and body.startswith("# Draft trees")
    json.dumps(res)


def test_committed_doc_matches_committed_results():
    """docs/trees.md's table is what `--render-only` makes of the committed JSON (a
    figure edited by hand fails)."""
    res = json.load(open(trees.RESULTS))
    assert trees.render(res) in open(trees.DOC).read()
    assert all(r["identical"] for r in res["runs"] if r["temperature"] == 0)
