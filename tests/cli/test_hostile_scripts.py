"""Hostile output paths for the other scripts that write files (issue 27):
`python -m specjax.regenerate --out` and `python -m specjax.decoding.prompts OUT` refuse a path of
the wrong kind with one line and exit code 2, before any work, and a refused call
creates nothing."""

from __future__ import annotations

import os

import pytest

from specjax.tools import prompts as prompts_cli
from specjax.tools import regenerate as rg


def one_line(capsys, needle):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_regenerate_out_that_is_not_a_directory(tiny_demo, tmp_path, capsys, kind):
    (tmp_path / "f").write_text("mine")
    out = tmp_path / "f" if kind == "file" else tmp_path / "f" / "sub"
    code = rg.main(["--target", str(tiny_demo / "target"), "--out", str(out), "--limit", "2"])
    assert code == 2
    one_line(capsys, f"--out {out} is")
    assert sorted(os.listdir(tmp_path)) == ["f"] and (tmp_path / "f").read_text() == "mine"


def test_regenerate_refused_call_creates_no_out_dir(tiny_demo, tmp_path, capsys):
    out = tmp_path / "new" / "o"
    code = rg.main(["--target", str(tiny_demo / "target"), "--out", str(out), "--limit", "2",
                    "--max-new-tokens", "100000"])
    assert code == 2
    one_line(capsys, "max_position_embeddings")
    assert os.listdir(tmp_path) == []


def test_prompts_out_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    assert prompts_cli.main([str(tmp_path / "d"), "--n", "1"]) == 2
    one_line(capsys, "is a directory")
    assert os.listdir(tmp_path / "d") == []


def test_prompts_writes_its_file(tmp_path, capsys):
    out = tmp_path / "new" / "p.jsonl"
    assert prompts_cli.main([str(out), "--n", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert os.listdir(tmp_path / "new") == ["p.jsonl"]  # no temporary left
