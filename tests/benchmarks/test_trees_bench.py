"""benchmarks/trees.py (its machinery in benchmarks/lib/system_table.py): the accelerator
projection's limits and the report rendering (the measurement itself runs the shipped
drafters: `python benchmarks/trees.py --quick`)."""

import json

import pytest

from benchmarks import trees
from benchmarks.lib import roofline
from benchmarks.lib.system_table import project


@pytest.mark.parametrize("device", ["H100", "TPU v5e"])
def test_projection_limits(device):
    # No drafter cost and one verified node: a step is an autoregressive step, so the
    # speedup is tau itself.
    assert project(3.0, 1, 0, 0, device) == pytest.approx(3.0)
    # Memory-bound verify forward (a few nodes): still tau.
    assert project(3.0, 8, 0, 0, device) == pytest.approx(3.0)
    # Past the compute ridge (2 * params * nodes / peak > bytes / bandwidth) more nodes
    # cost more: the projection falls with N at fixed tau.
    ridge = roofline.PEAK_FLOPS[device] / roofline.BANDWIDTH[device]  # FLOPs per byte
    big = int(4 * ridge)
    assert project(3.0, big, 0, 0, device) < project(3.0, big // 2, 0, 0, device)
    # Drafter forwards are paid on top of the verify forward.
    assert project(3.0, 8, 7, 1, device) < project(3.0, 8, 0, 0, device)


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


def test_render_of_a_device_record_goes_to_its_own_section(tmp_path):
    rec = {"system": "ngram chain", "temperature": 0.0, "verify": "greedy", "batch": 1,
           "prompts": "bundled", "tau": 2.5, "alpha": [0.6], "tokens_per_s": 4000.0,
           "ar_tokens_per_s": 2300.0, "speedup": 1.74, "nodes": 5, "gamma": 4,
           "compile_s": 6.0, "identical": False, "identical_prompts": 6,
           "projected": {"H100": 2.5, "TPU v5e": 2.5}}
    res = {"runs": [rec], "prompts": 8, "new_tokens": 64, "git": "abc", "date": "d",
           "machine": "x", "cores": 16, "numpy": "2", "jax": "0.11.2", "weights": ["w"],
           "device": "NVIDIA H200", "dtype": "bfloat16"}
    text = trees.render(res)
    assert text.startswith("Measured on an NVIDIA H200 (jax 0.11.2, target bfloat16")
    assert "speedup (measured)" in text and "| NO (6/8) |" in text and "CPU" not in text
    doc = tmp_path / "trees.md"
    doc.write_text("# Draft trees\n\nprose\n")
    trees.write_doc(res, str(doc))
    body = doc.read_text()
    assert "<!-- trees:device -->" in body and "<!-- trees:results -->" not in body


def test_committed_device_table_matches_its_results():
    """docs/trees.md's H200 table is `--render-only --json` of the committed JSON."""
    res = json.load(open(trees.RESULTS.replace("trees.json", "trees_h200.json")))
    assert res["device"] != "cpu" and trees.render(res) in open(trees.DOC).read()


def test_committed_doc_matches_committed_results():
    """docs/trees.md's table is what `--render-only` makes of the committed JSON (a
    figure edited by hand fails)."""
    res = json.load(open(trees.RESULTS))
    assert trees.render(res) in open(trees.DOC).read()
    assert all(r["identical"] for r in res["runs"] if r["temperature"] == 0)


def test_merge_replaces_only_the_rows_measured_again():
    def row(system, t, verify, b, tau):
        return {"system": system, "temperature": t, "verify": verify, "batch": b,
                "prompts": "bundled", "tau": tau, "alpha": [0.5], "tokens_per_s": 1.0,
                "ar_tokens_per_s": 1.0, "speedup": 1.0, "nodes": 8, "gamma": 7,
                "compile_s": 1.0, "identical": None if t else True,
                "projected": {"H100": 1.0, "TPU v5e": 1.0}}

    head = {"prompts": 2, "new_tokens": 8, "date": "d0", "machine": "x", "cores": 2,
            "numpy": "2", "jax": "0.10.2", "weights": ["w"]}
    old = dict(head, git="old", runs=[row("a", 0.0, "greedy", 1, 1.0),
                                      row("a", 1.0, "token", 1, 2.0),
                                      row("a", 1.0, "block", 1, 3.0)])
    new = dict(head, git="new", date="d1", warmup=2,
               runs=[row("a", 1.0, "token", 4, 4.0), row("a", 1.0, "token", 1, 5.0)])
    out = trees.merge(old, new)
    got = [(r["verify"], r["batch"], r["tau"], r.get("git")) for r in out["runs"]]
    assert got == [("greedy", 1, 1.0, None), ("token", 1, 5.0, "new"),
                   ("token", 4, 4.0, "new"), ("block", 1, 3.0, None)]
    assert out["git"] == "old"  # the header stays the file's; new rows carry their own
    text = trees.render(out)
    assert "Rows T=1 token B=1: measured later (`--merge`), git new, d1" in text
    with pytest.raises(ValueError, match="prompts"):
        trees.merge(old, dict(new, prompts=3))


def test_sweep_systems_and_its_own_doc_section_and_plot(tmp_path):
    names = [s.name for s in trees.SWEEP]
    assert len(names) == len(set(names))
    # trees run greedy only, K x G drafts at T > 0 with block verification only, the
    # chain at both (the reference of each panel)
    greedy = {s.name for s in trees.SWEEP if s.greedy}
    block = {s.name for s in trees.SWEEP if "block" in s.rules}
    assert greedy & block == {"eagle3 chain"}
    assert all(s.tree is not None for s in trees.SWEEP if s.name in greedy - block)
    assert all(s.num_drafts * s.gamma + 1 >= 4 for s in trees.SWEEP if s.name in block - greedy)

    def row(system, t, nodes, tau, speedup, k=1, g=7):
        return {"system": system, "temperature": t, "verify": "block" if t else "greedy",
                "batch": 1, "prompts": "bundled", "tau": tau, "alpha": [0.5],
                "tokens_per_s": 1.0, "ar_tokens_per_s": 1.0, "speedup": speedup,
                "nodes": nodes, "gamma": g, "num_drafts": k, "compile_s": 1.0,
                "identical": True if t == 0 else None,
                "projected": {"H100": 1.0, "TPU v5e": 1.0}}

    runs = [row("eagle3 chain", 0.0, 8, 5.6, 1.5), row("eagle3 tree 2x8", 0.0, 8, 5.5, 1.6),
            row("eagle3 tree 2x12", 0.0, 12, 5.8, 1.55),
            row("eagle3 chain", 1.0, 8, 3.0, 1.0), row("eagle3 K=2 G=3", 1.0, 7, 2.9, 1.1, 2, 3)]
    res = {"runs": runs, "prompts": 2, "new_tokens": 8, "git": "abc", "date": "d",
           "machine": "x", "cores": 2, "numpy": "2", "jax": "0.10.2", "weights": ["w"],
           "sweep": True}
    doc, png = tmp_path / "trees.md", tmp_path / "img" / "sweep.png"
    doc.write_text("# Draft trees\n\nprose\n<!-- trees:results -->\nold\n<!-- /trees:results -->\n")
    trees.write_doc(res, str(doc), plot=str(png))
    body = doc.read_text()
    assert "<!-- trees:sweep -->" in body and "| T=1 block | 1 | bundled | eagle3 K=2 G=3 | 7 |" \
        in body and "\nold\n" in body  # the main table is left alone
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_committed_sweep_table_matches_its_results():
    """docs/trees.md's sweep table is `--sweep --render-only` of the committed JSON, and
    every greedy row of it was identical to autoregressive decoding."""
    res = json.load(open(trees.SWEEP_RESULTS))
    assert res["sweep"] and trees.render(res) in open(trees.DOC).read()
    assert all(r["identical"] for r in res["runs"] if r["temperature"] == 0)


def test_block_drafting_doc_matches_its_results():
    """docs/block_drafting.md's table is what `benchmarks/block_drafting.py --render-only`
    makes of the committed JSON (a figure edited by hand fails), and every T = 0 row there
    is identical to autoregressive decoding."""
    from benchmarks import block_drafting

    res = json.load(open(block_drafting.RESULTS))
    assert trees.render(res) in open(block_drafting.DOC).read()
    assert all(r["identical"] for r in res["runs"] if r["temperature"] == 0)
