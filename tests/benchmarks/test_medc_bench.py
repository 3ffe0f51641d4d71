"""benchmarks/medc.py's report: docs/medc.md's three marked sections are what `python
benchmarks/medc.py report` makes of the committed results
(benchmarks/results/studies/medc/*.json and tree.json)."""

from __future__ import annotations

import json

import pytest

from benchmarks import medc
from benchmarks.studies.kvshot import protocol


@pytest.mark.timeout(60)
def test_committed_doc_sections_are_the_report_of_the_committed_results(tmp_path,
                                                                       monkeypatch):
    """Each of medc:results, medc:reuse and medc:tree in the committed docs/medc.md holds
    exactly its renderer's text from the committed results (every run measured, so no
    section is the "Not measured yet" placeholder), and `medc.py report` run on a copy of
    the doc leaves it unchanged: a figure edited by hand, or results changed without
    re-rendering, show here."""
    results = protocol.load_results(medc.RESULTS_DIR)
    assert set(results) == {(n, medc.SEED) for n in
                            ("eagle3", "medc", "medc_reuse", "medc_noreuse")}
    with open(medc.TREE_RESULTS) as f:
        tree = json.load(f)
    committed = open(medc.DOC).read()
    sections = {"medc:results": medc.render(results), "medc:reuse": medc.render_reuse(results),
                "medc:tree": medc.render_tree(tree)}
    for tag, body in sections.items():
        assert "Not measured yet" not in body, tag
        begin, end = f"<!-- {tag} -->\n", f"<!-- /{tag} -->"
        assert committed.count(begin) == 1 and committed.count(end) == 1, tag
        got = committed[committed.index(begin) + len(begin):committed.index(end)]
        assert got == body, tag
    copy = tmp_path / "medc.md"
    copy.write_text(committed)
    monkeypatch.setattr(medc, "DOC", str(copy))
    monkeypatch.chdir(medc.ROOT)  # main() changes to the checkout
    assert medc.main(["report"]) == 0
    assert copy.read_text() == committed
