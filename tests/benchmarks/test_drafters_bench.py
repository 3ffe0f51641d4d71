"""benchmarks/drafters.py without measuring anything (seconds): the committed documents
equal what the script renders from the committed results (a figure edited by hand in a
marked section fails here), every marked section exists once, rendering is idempotent,
the measuring loop keeps decode.py's summaries (decode.py replaced by a stub), the prose
parameter counts equal the weights files', and bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import drafters  # noqa: E402  (no jax import)

SCRIPT = os.path.join(ROOT, "benchmarks", "drafters.py")
COMMITTED = os.path.join(ROOT, drafters.RESULTS)


def fake_record(name: str, speedup: float) -> dict:
    """A record as measure() writes it, with made-up decode.py figures and the drafter's
    real static part."""
    gamma = 4 if name in ("draft", "ngram") else 7
    return {"drafter": drafters.DRAFTERS[name][0], **drafters.describe(name),
            "decode": {"new_tokens": 6400, "wall_s": 25.0, "compile_s": 3.0,
                       "tokens_per_s": 300.0 * speedup, "tau": 1.0 + speedup,
                       "alpha": [0.9] * gamma, "drafter": drafters.DRAFTERS[name][0],
                       "gamma": gamma, "verify": "greedy", "kernels": "reference",
                       "batch_size": 1, "prompts": 50, "mesh": None,
                       "ar_tokens_per_s": 300.0, "speedup": speedup, "ar_identical": True},
            "command": f"python decode.py --drafter {drafters.DRAFTERS[name][0]} --show 0",
            "measured_at": "2031-01-02T03:04:05Z", "run_s": 99.0,
            "load_average": [0.1, 0.2, 0.3],
            "env": {"commit": "abc1234", "changed_files": [], "jax": "0.0.test",
                    "usable_cores": 2}}


@pytest.fixture(scope="module")
def fake_results():
    return {"drafters": {n: fake_record(n, 1.11 + 0.1 * i)
                         for i, n in enumerate(drafters.DRAFTERS)}}


def copy_docs(dst) -> str:
    for rel in drafters.DOCS:
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, rel), os.path.join(dst, rel))
    return str(dst)


def run_script(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_committed_documents_agree_with_committed_results():
    results = drafters.load_results(COMMITTED)
    for path, text in drafters.rendered(results, ROOT).items():
        with open(path) as f:
            assert f.read() == text, (
                f"{os.path.relpath(path, ROOT)} differs from what `python benchmarks/"
                "drafters.py --render-only` makes of the committed results: the figures "
                "in marked sections come from benchmarks/results/drafters.json only")
    md = os.path.splitext(COMMITTED)[0] + ".md"
    if results["drafters"]:
        with open(md) as f:
            assert f.read() == drafters.report(results)
    else:
        assert not os.path.exists(md)


def test_committed_results_match_shipped_weights():
    results = drafters.load_results(COMMITTED)
    if not results["drafters"]:
        pytest.skip("benchmarks/results/drafters.json not measured yet")
    assert set(results["drafters"]) == set(drafters.DRAFTERS), "a drafter is missing"
    assert drafters.stale(results) == [], (
        "weights changed since they were measured: rerun `python benchmarks/drafters.py "
        "--only NAME` on a quiet machine")


def test_every_marked_section_exists_once():
    for rel, sections in drafters.DOCS.items():
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        for key in sections:
            assert text.count(f"<!-- drafters:{key} -->") == 1, (rel, key)
            assert text.count(f"<!-- /drafters:{key} -->") == 1, (rel, key)
    assert set(drafters.SECTIONS) >= {k for s in drafters.DOCS.values() for k in s}


def test_render_only_on_a_copy(tmp_path, fake_results):
    docs = copy_docs(tmp_path / "docs")
    res = tmp_path / "res" / "drafters.json"
    res.parent.mkdir()
    res.write_text(json.dumps(fake_results))
    proc = run_script("--render-only", "--results", res, "--docs-root", docs)
    assert proc.returncode == 0, proc.stderr
    first = {rel: open(os.path.join(docs, rel)).read() for rel in drafters.DOCS}
    # every document now quotes the fake figures, with command, date, commit and sha
    eagle3 = fake_results["drafters"]["eagle3"]
    card = first["checkpoints/demo/drafters/eagle3/README.md"]
    assert "**1.11x**" in card and "2031-01-02" in card and "commit abc1234" in card
    assert f"`{eagle3['weights_sha256']}`" in card
    for rel, text in first.items():
        assert "python benchmarks/drafters.py" in text and "abc1234" in text, rel
        assert "not measured yet" not in text, rel
    table = first["checkpoints/demo/drafters/README.md"]
    assert table.count("| 1.11x |") == 1 and "| n-gram (prompt lookup) |" in table
    md = (tmp_path / "res" / "drafters.md").read_text()
    assert md == drafters.report(fake_results)
    # idempotent: a second run changes nothing
    proc = run_script("--render-only", "--results", res, "--docs-root", docs)
    assert proc.returncode == 0, proc.stderr
    assert {rel: open(os.path.join(docs, rel)).read() for rel in drafters.DOCS} == first
    # the prose around the markers is untouched: rendering the committed (or empty)
    # results again gives back the committed documents
    committed = drafters.load_results(COMMITTED)
    for path, text in drafters.rendered(committed, docs).items():
        assert text == open(os.path.join(ROOT, os.path.relpath(path, docs))).read()


def test_a_figure_edited_by_hand_is_caught(fake_results):
    rel = "checkpoints/demo/drafters/README.md"
    with open(os.path.join(ROOT, rel)) as f:
        text = drafters.render_text(f.read(), ["table"], fake_results, rel)
    edited = text.replace("| 1.11x |", "| 1.51x |")
    assert edited != text
    assert drafters.render_text(edited, ["table"], fake_results, rel) == text


def test_markers_keep_their_indentation(fake_results):
    text = "- bullet\n  <!-- drafters:readme -->\n  old\n  <!-- /drafters:readme -->\nend\n"
    out = drafters.render_text(text, ["readme"], fake_results)
    lines = out.splitlines()
    assert lines[1] == "  <!-- drafters:readme -->" and lines[-2] == "  <!-- /drafters:readme -->"
    assert lines[2].startswith("  In decode.py") and "eagle3 1.11x" in lines[2]
    assert drafters.render_text(out, ["readme"], fake_results) == out
    with pytest.raises(drafters.SpecjaxError, match="0 `<!-- drafters:table -->`"):
        drafters.render_text(text, ["table"], fake_results, "X.md")


def test_measuring_loop_with_a_stub_decode(tmp_path, monkeypatch, fake_results):
    """main() runs decode.py once per drafter, in DRAFTERS' order, with --show 0, a
    --summary file and the first N prompts; it keeps the summary whole, merges into the
    existing results and rewrites the documents; a failing decode.py is one line, exit 1."""
    docs = copy_docs(tmp_path / "docs")
    res = tmp_path / "drafters.json"
    res.write_text(json.dumps({"drafters": {"block": fake_results["drafters"]["block"]}}))
    calls, real_run = [], subprocess.run

    def fake_run(cmd, **kw):
        if "decode.py" not in cmd:  # git, uname
            return real_run(cmd, **kw)
        calls.append(cmd)
        assert cmd[:2] == [sys.executable, "decode.py"] and kw["cwd"] == drafters.ROOT
        with open(cmd[cmd.index("--prompts") + 1]) as f:
            n = len(f.readlines())
        name = cmd[cmd.index("--drafter") + 1]
        summary = {**fake_results["drafters"]["kv1"]["decode"], "drafter": name,
                   "prompts": n, "speedup": 1.77, "extra_key": 1}
        with open(cmd[cmd.index("--summary") + 1], "w") as f:
            json.dump(summary, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(drafters.subprocess, "run", fake_run)
    rc = drafters.main(["--only", "ngram", "kv1", "--prompts", "3", "--results", str(res),
                        "--docs-root", docs])
    assert rc == 0
    assert [c[c.index("--drafter") + 1] for c in calls] == ["checkpoints/demo/drafters/kv1",
                                                            "ngram"]
    assert all("--show" in c and c[c.index("--show") + 1] == "0" for c in calls)
    out = json.loads(res.read_text())
    assert list(out["drafters"]) == ["block", "kv1", "ngram"]
    kv1 = out["drafters"]["kv1"]
    assert kv1["decode"]["extra_key"] == 1 and kv1["decode"]["prompts"] == 3
    assert kv1["own_params"] == 2950784 and kv1["kind"] == "kv"
    assert kv1["held_out"]["file"] == "train_metrics.jsonl" and kv1["held_out"]["step"] == 2000
    assert kv1["command"] == "python decode.py --drafter checkpoints/demo/drafters/kv1 --show 0"
    assert kv1["env"]["commit"] and "usable_cores" in kv1["env"]
    card = open(os.path.join(docs, "checkpoints/demo/drafters/kv1/README.md")).read()
    assert "**1.77x**" in card and "the first 3 bundled prompts" in card
    assert (tmp_path / "drafters.md").read_text() == drafters.report(out)

    def failing(cmd, **kw):
        if "decode.py" not in cmd:  # git, uname
            return real_run(cmd, **kw)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback\nValueError: boom\n")

    monkeypatch.setattr(drafters.subprocess, "run", failing)
    before = res.read_text()
    assert drafters.main(["--only", "draft", "--prompts", "1", "--results", str(res),
                          "--docs-root", docs]) == 1
    assert res.read_text() == before


def test_parameter_counts_and_held_out_records():
    """The cards' prose parameter counts are the weights files' (block's card said 5.3M
    while its file holds 5.64M), and the held-out record is the exported one."""
    cards = {"eagle3": "checkpoints/demo/drafters/eagle3/README.md",
             "block": "checkpoints/demo/drafters/block/README.md",
             "kv1": "checkpoints/demo/drafters/kv1/README.md",
             "hybrid": "checkpoints/demo/drafters/hybrid/README.md",
             "draft": "checkpoints/demo/README.md"}
    for name, rel in cards.items():
        r = drafters.describe(name)
        with open(os.path.join(ROOT, rel)) as f:
            prose = re.sub(r"<!-- drafters:.*?<!-- /drafters:[a-z0-9]+ -->", "", f.read(),
                           flags=re.S)
        pat = r"(\d+\.\d+)M own parameters" if name != "draft" else \
            r"draft LM, (\d+\.\d+)M parameters"
        said = re.findall(pat, prose)
        assert said and set(said) == {f"{r['own_params'] / 1e6:.2f}"}, (name, said)
        if name != "draft":  # the training log's own count agrees
            d = os.path.join(ROOT, drafters.DRAFTERS[name][0])
            logs = sorted(x for x in os.listdir(d) if x.startswith("train_metrics"))
            with open(os.path.join(d, logs[0])) as f:
                assert json.loads(f.readline())["params"] == r["own_params"]
    e = drafters.held_out(os.path.join(ROOT, "checkpoints/demo/drafters/eagle3"))
    assert (e["file"], e["step"]) == ("train_metrics_gpu5.jsonl", 7791)  # the fifth round
    assert drafters.held_out(os.path.join(ROOT, "checkpoints/demo/draft")) is None


def test_count_params_reads_the_header(tmp_path):
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]}}
                        ).encode()
    p = tmp_path / "m.safetensors"
    p.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 44)
    assert drafters.count_params(str(p)) == 17
    (tmp_path / "bad.safetensors").write_bytes(b"abc")
    with pytest.raises(drafters.SpecjaxError, match="not a safetensors file"):
        drafters.count_params(str(tmp_path / "bad.safetensors"))


@pytest.mark.parametrize("args, message", [
    (["--only", "nope"], "argument --only: invalid choice"),
    (["--prompts", "0"], "--prompts 0: must be >= 1"),
    (["--prompts", "100000"], "has 50 prompts"),
    (["--render-only", "--only", "ngram"], "--render-only measures nothing"),
    (["--render-only", "--results", "BAD"], "cannot read"),
    (["--render-only", "--docs-root", "EMPTY"], "not found under"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    (tmp_path / "empty").mkdir()
    args = [str(bad) if a == "BAD" else str(tmp_path / "empty") if a == "EMPTY" else a
            for a in args]
    if "--results" not in args:  # never touch the committed files
        args += ["--results", str(tmp_path / "r.json")]
    if "--docs-root" not in args:
        args += ["--docs-root", copy_docs(tmp_path / "docs")]
    proc = run_script(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drafters.py: error: "), proc.stderr
    assert message in lines[0]
