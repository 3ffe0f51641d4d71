"""Hot draft vocabularies (specjax.drafters.vocab): the chosen ids against a brute-force
ranking, the drafter's logits over them against the full-vocabulary drafter's, greedy
output unchanged through the real loop, and one-line errors for bad files and flags.
(Lossless sampling with a hot vocabulary: tests/drafters/test_drafters_distribution.py.)"""

import json

import jax
import numpy as np
import pytest

from specjax.drafters import make_drafter
from specjax.drafters.io import FORMAT
from specjax.drafters.vocab import hot_ids, load_draft_vocab, save_draft_vocab
from specjax.errors import SpecjaxError
from specjax.testing.tiny import save_random_drafter
from specjax.tools.vocab import main
from tests.decoding.test_speculative_greedy import BUDGETS, models, rows, run_ar
from tests.drafters.test_drafters_decode import drafter_net, run_learned


@pytest.mark.parametrize("seed", range(5))
def test_hot_ids_are_the_most_frequent_by_brute_force(seed):
    rng = np.random.RandomState(seed)
    counts = rng.randint(0, 6, size=40)  # many ties
    size = rng.randint(1, 41)
    ranked = sorted(range(40), key=lambda i: (-counts[i], i))  # ties: lower id first
    assert hot_ids(counts, size).tolist() == sorted(ranked[:size])
    with pytest.raises(SpecjaxError, match="--size"):
        hot_ids(counts, 41)


@pytest.mark.parametrize("kind,context", [("eagle3", None), ("kv", None), ("block", "hidden")])
def test_hot_logits_are_the_full_logits_at_those_ids(kind, context):
    target, _ = models()
    dcfg, net = drafter_net(kind, context)
    V = target.cfg.vocab_size
    ids = np.sort(np.random.RandomState(0).choice(V, size=V // 3, replace=False))
    full_d, full_p = make_drafter(dcfg, net, target, gamma=3)
    hot_d, hot_p = make_drafter(dcfg, net, target, gamma=3, draft_vocab=ids)
    assert hot_p["head"].shape == (len(ids), target.cfg.hidden_size)
    out = jax.random.normal(jax.random.key(1), (2, 5, target.cfg.hidden_size))
    want = np.asarray(full_d.logits(net, out, full_p))
    got = np.asarray(hot_d.logits(net, out, hot_p))
    np.testing.assert_allclose(got[..., ids], want[..., ids], rtol=1e-6, atol=1e-6)
    outside = np.setdiff1d(np.arange(V), ids)
    assert np.isneginf(got[..., outside]).all()


@pytest.mark.parametrize("kind,context", [("eagle3", None), ("kv", None), ("block", "both")])
def test_greedy_output_is_unchanged(kind, context):
    V = models()[0].cfg.vocab_size
    ids = tuple(range(0, V, 2))  # half the ids: some targets' tokens can never be drafted
    sp = run_learned(kind, context, 3, BUDGETS, draft_vocab=ids)
    assert rows(sp) == rows(run_ar(BUDGETS))


def test_file_roundtrip_and_bad_files(tmp_path):
    counts = np.array([5, 0, 9, 9, 1, 7])
    rec = save_draft_vocab(str(tmp_path), counts, 3, "test counts")
    assert rec["ids"] == [2, 3, 5] and rec["coverage"] == pytest.approx(25 / 31)
    assert load_draft_vocab(str(tmp_path), 6).tolist() == [2, 3, 5]
    assert load_draft_vocab(str(tmp_path / "none"), 6) is None
    for bad in ("{", '{"ids": [1, 1]}', '{"ids": [7]}', '{"ids": "x"}', '{"ids": []}'):
        (tmp_path / "draft_vocab.json").write_text(bad)
        with pytest.raises(SpecjaxError, match="draft_vocab.json") as e:
            load_draft_vocab(str(tmp_path), 6)
        assert "\n" not in str(e.value)


def test_cli_counts_token_streams(tmp_path, capsys):
    """--tokens-npy: the hot ids of two streams' summed counts, by brute force; bad
    streams are one-line errors that leave no draft_vocab.json behind."""
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"format": FORMAT, "kind": "eagle3",
                                               "vocab_size": 10}))
    rng = np.random.RandomState(0)
    a, b = rng.randint(0, 10, 300).astype(np.uint16), rng.randint(0, 4, 50).astype(np.int32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    argv = [str(d), "--size", "4", "--tokens-npy", str(tmp_path / "a.npy"),
            str(tmp_path / "b.npy")]
    assert main(argv) == 0
    both = np.concatenate([a, b]).tolist()
    ranked = sorted(range(10), key=lambda i: (-both.count(i), i))
    rec = json.loads((d / "draft_vocab.json").read_text())
    assert rec["ids"] == sorted(ranked[:4]) and rec["counted_tokens"] == 350
    (d / "draft_vocab.json").unlink()
    np.save(tmp_path / "big.npy", np.array([3, 10]))
    np.save(tmp_path / "flat.npy", np.zeros((2, 2), np.int32))
    capsys.readouterr()
    for bad, msg in (("big.npy", "outside"), ("flat.npy", "flat"), ("none.npy", "unreadable")):
        assert main([str(d), "--size", "4", "--tokens-npy", str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err
        assert not (d / "draft_vocab.json").exists()


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "\n" not in err
    assert not (tmp_path / "missing").exists()


def test_decode_uses_the_file_and_full_ignores_it(tiny_demo, tmp_path):
    """decode.py with a drafter directory that has draft_vocab.json: the same output as
    --draft-vocab full and as autoregressive decoding."""
    import decode
    import specjax

    tgt = str(tiny_demo / "target")
    target = specjax.load_target(tgt, dtype="float32")
    d = save_random_drafter(tgt, str(tmp_path / "drafter"))
    save_draft_vocab(str(d), np.arange(target.cfg.vocab_size)[::-1], 50, "test")
    outs = {}
    for mode, hot in (("auto", True), ("full", False)):
        params = specjax.load_drafter(str(d), target, draft_vocab=mode).params
        assert ("draft_ids" in params) == hot
        if hot:
            assert params["head"].shape[0] == 50
    for mode in ("auto", "full"):
        s = tmp_path / f"{mode}.json"
        o = tmp_path / f"{mode}.jsonl"
        assert decode.main(["--target", tgt, "--drafter", str(d), "--prompts",
                            str(tiny_demo / "prompts.jsonl"), "--max-new-tokens", "12",
                            "--draft-vocab", mode, "--show", "0", "--summary", str(s),
                            "--gamma", "fixed",
                            "--output", str(o)]) == 0
        assert json.loads(s.read_text())["ar_identical"] is True
        outs[mode] = o.read_text()
    assert outs["auto"] == outs["full"]


@pytest.mark.slow  # a benchmark script; decode with a draft vocabulary is tested above
def test_benchmark_script_table(tiny_demo, tmp_path, capsys):
    """benchmarks/draft_vocab.py on the tiny demo (random eagle3, counts from a token
    stream): one row per size, outputs identical to AR, and exit 2 on bad input."""
    from benchmarks import draft_vocab as bench
    from specjax.models.config import ModelConfig

    tgt = str(tiny_demo / "target")
    d = save_random_drafter(tgt, str(tmp_path / "drafter"))
    V = ModelConfig.from_dir(tgt).vocab_size
    np.save(tmp_path / "s.npy", np.random.default_rng(0).integers(0, V, 5000).astype(np.uint16))
    base = ["--target", tgt, "--drafter", str(d), "--prompts-file",
            str(tiny_demo / "prompts.jsonl"), "--prompts", "2", "--max-new-tokens", "8"]
    out = tmp_path / "r.json"
    assert bench.main(base + ["--sizes", str(V), "40", "--tokens-npy", str(tmp_path / "s.npy"),
                              "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"| {V} | 100.0% |" in table and "| 40 |" in table
    rows_ = json.loads(out.read_text())["rows"]
    assert [r["size"] for r in rows_] == [V, 40]
    assert all(r["identical_to_ar"] is True for r in rows_)
    assert bench.main(base + ["--prompts-file", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--prompts-file" in err and "does not exist" in err and "\n" not in err
