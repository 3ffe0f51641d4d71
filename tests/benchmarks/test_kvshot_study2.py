"""The redone KVShot study's report tooling (benchmarks/studies/kvshot/kvshot_study2.py and
its protocol.py): the crossed, paired bootstrap against answers computed here (exact small
cases, normal approximations on large synthetic data), the measure step end to end on a
tiny fake run, and the report with runs missing."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from benchmarks.lib import stats
from benchmarks.studies.kvshot import kvshot_study2 as k2
from benchmarks.studies.kvshot import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "test_tiny_drafter.yaml")


# ----------------------------------------------------------------------------- bootstrap

def mean_stat(t):
    return t["x"] / t["n"]


def test_bootstrap_exact_small_case():
    # one seed, prompts [0, 1]: a resample's mean is 0, 0.5 or 1 with probability 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% percentiles are 0 and 1
    x = np.array([[0.0, 1.0]])
    ci = stats.bootstrap_ci({"x": x, "n": np.ones_like(x)}, mean_stat, resamples=4000)
    assert ci["estimate"] == 0.5 and ci["lo"] == 0.0 and ci["hi"] == 1.0
    assert (ci["seeds"], ci["prompts"]) == (1, 2)
    const = np.full((3, 5), 2.0)
    ci = stats.bootstrap_ci({"x": const, "n": np.ones_like(const)}, mean_stat)
    assert ci["lo"] == ci["hi"] == ci["estimate"] == 2.0
    # a ratio of totals, not a mean of ratios: (1 + 3) / (1 + 1) = 2; with tau's offset 3
    ci = stats.bootstrap_ci({"a": np.array([[1.0, 3.0]]), "s": np.array([[1.0, 1.0]])},
                         stats.ratio("a", "s", 1.0))
    assert ci["estimate"] == 3.0


def test_bootstrap_matches_normal_approximation_over_prompts():
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 1.0, (1, 4000))
    ci = stats.bootstrap_ci({"x": x, "n": np.ones_like(x)}, mean_stat, resamples=2000)
    half = (ci["hi"] - ci["lo"]) / 2
    assert half == pytest.approx(1.96 / np.sqrt(4000), rel=0.12)
    assert ci["lo"] < x.mean() < ci["hi"]


def test_bootstrap_crossed_seeds_and_prompts():
    # x[s, p] = u_s + v_p: the grand mean has variance var(u)/S + var(v)/P. Resampling
    # prompts only would give the half width of the second term alone (0.16, not 0.23).
    rng = np.random.default_rng(2)
    S = P = 150
    x = rng.normal(0, 1, (S, 1)) + rng.normal(0, 1, (1, P))
    ci = stats.bootstrap_ci({"x": x, "n": np.ones_like(x)}, mean_stat, resamples=2000)
    half = (ci["hi"] - ci["lo"]) / 2
    expect = 1.96 * np.sqrt(x.mean(1).var() / S + x.mean(0).var() / P)
    assert half == pytest.approx(expect, rel=0.15)


def test_bootstrap_difference_is_paired():
    # two drafters that share large prompt effects and differ by 0.1: pairing removes the
    # shared part, so the difference's interval is narrow and excludes 0; an unpaired
    # bootstrap would give a half width near 1.96 * sqrt(2 / 400) = 0.14
    rng = np.random.default_rng(3)
    v = rng.normal(0, 1, (1, 400))
    a = v + 0.1 + rng.normal(0, 0.01, v.shape)
    b = v.copy()
    one = np.ones_like(v)
    ci = stats.bootstrap_ci({"a.x": a, "a.n": one, "b.x": b, "b.n": one},
                         stats.difference(mean_stat, mean_stat), resamples=2000)
    assert ci["estimate"] == pytest.approx((a - b).mean())
    assert 0.0 < ci["lo"] < 0.1 < ci["hi"] and ci["hi"] - ci["lo"] < 0.01


def test_bootstrap_rejects_ragged_arrays():
    with pytest.raises(ValueError):
        stats.bootstrap_ci({"x": np.ones((1, 3)), "n": np.ones((1, 4))}, mean_stat)


def test_verdict_reads_the_interval():
    d = {"estimate": 0.2, "lo": 0.1, "hi": 0.3, "seeds": 3}
    assert "support" in k2.verdict(d, "above")
    assert "contradict" in k2.verdict({**d, "estimate": -0.2, "lo": -0.3, "hi": -0.1}, "above")
    assert "does not decide" in k2.verdict({**d, "lo": -0.1}, "above")
    assert "one seed" in k2.verdict({**d, "seeds": 1}, "above")
    assert k2.MISSING in k2.verdict(None)


# ----------------------------------------------------------------------------- measure

@pytest.fixture(scope="module")
def fake_study(tmp_path_factory):
    """A tiny finished run eagle3-s0 (random-init export of the tiny drafter config against
    a random tiny target, held-out stream of EOS-separated documents) and an unfinished
    kv2-s0 (a run dir without export)."""
    from flax import nnx

    from benchmarks.studies.kvshot import kvshot_probes
    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config, write_token_corpus

    d = tmp_path_factory.mktemp("study2")
    tok, paths = write_token_corpus(str(d))
    target = Transformer(tiny_config(320, hidden_size=32, num_layers=4, num_heads=4,
                                     num_kv_heads=2, head_dim=8, intermediate_size=64),
                         rngs=nnx.Rngs(7))
    save_model(target, str(d / "target"), tokenizer=tok)
    rng = np.random.default_rng(0)
    docs = [np.r_[rng.integers(2, 300, 30 + 3 * i), 0] for i in range(12)]
    np.save(d / "val.npy", np.concatenate(docs).astype(np.uint16))
    configs = d / "configs"
    configs.mkdir()
    for name in ("eagle3", "kv2"):
        shutil.copy(TINY, configs / f"{name}.yaml")
    overrides = [f"target={d / 'target'}", f"data.tokens_npy={paths['tokens']}",
                 f"data.val_tokens_npy={d / 'val.npy'}", "mesh.data=1"]
    runs = d / "runs"
    cfg = protocol.load_config_for("eagle3", 0, runs_root=str(runs), config_dir=str(configs),
                             overrides=overrides)
    cfg, run = kvshot_probes.run_of_config(cfg)
    run.export(run.trainer.init_state(), 0, None)
    (runs / "kv2-s0").mkdir(parents=True)
    return {"runs": str(runs), "configs": str(configs), "overrides": overrides,
            "results": str(d / "results"), "dir": d}


SMALL = {"sim_start": 0, "sim_rows": 3, "prompts": 2, "prompt_tokens": 8, "new_tokens": 6}


@pytest.fixture(scope="module")
def measured(fake_study):
    f = fake_study
    done = protocol.measure(["eagle3", "kv2"], [0], runs_root=f["runs"], config_dir=f["configs"],
                      results_dir=f["results"], overrides=f["overrides"], sizes=SMALL,
                      settings=("t0", "t1_block"))
    return done


@pytest.mark.slow  # study tooling; the `measured` fixture trains and decodes
def test_measure_end_to_end_on_a_tiny_run(fake_study, measured):
    f = fake_study
    assert measured == ["eagle3-s0"]  # kv2-s0 is unfinished: skipped, never opened
    assert not os.path.exists(protocol.result_path("kv2", 0, f["results"]))
    with open(protocol.result_path("eagle3", 0, f["results"])) as fh:
        r = json.load(fh)
    G = 3
    sim = r["simulated"]
    assert len(sim["sequence_ids"]) == 3 and np.asarray(sim["accepted"]).shape == (3, G)
    assert sim["chains"] == [16 - G] * 3  # TTT evaluation: every anchor with G drafts inside
    acc = np.asarray(sim["accepted"])
    assert (np.diff(acc, axis=1) <= 0).all() and (acc[:, 0] <= 16 - G).all()
    assert set(r["decode"]) == {"t0", "t1_block"}
    t0 = r["decode"]["t0"]
    assert len(t0["steps"]) == 2 and all(t0["identical"])  # greedy: lossless
    for i in range(2):
        # the prefill commits one token, every verification step its accepted drafts plus
        # one (the last step's may run past the budget and be cut)
        made = 1 + t0["steps"][i] + sum(t0["accepted"][i])
        assert t0["new_tokens"][i] <= made <= t0["new_tokens"][i] + G
    assert r["prompt_ids"] and r["code"]["rev"] and r["weights"]["drafter_sha256"]
    # the simulated figures are the trainer's own: the same totals as its validation
    import jax

    from benchmarks.studies.kvshot import kvshot_probes

    cfg, run = kvshot_probes.run_of_config(protocol.load_config_for(
        "eagle3", 0, runs_root=f["runs"], config_dir=f["configs"], overrides=f["overrides"]))
    params = run.trainer.load_init_params(cfg.export_dir, cfg.target_dir)[0]
    rows, _ = run.data.val.batch(0, 3)  # the three sequences, as one batch (TTT: no key)
    _, st = run.trainer.loss_and_stats(params, jax.numpy.asarray(rows),
                                       run.trainer.target_params, jax.random.PRNGKey(0),
                                       evaluation=True)
    np.testing.assert_allclose(np.asarray(st["accepted"]), acc.sum(0))
    # a second measure skips the measured run
    assert protocol.measure(["eagle3"], [0], runs_root=f["runs"], config_dir=f["configs"],
                      results_dir=f["results"], overrides=f["overrides"], sizes=SMALL) == []


@pytest.mark.slow  # study tooling; the `measured` fixture trains and decodes
def test_report_renders_with_missing_runs(fake_study, measured, tmp_path):
    f = fake_study
    results = protocol.load_results(f["results"])
    assert list(results) == [("eagle3", 0)]
    doc = tmp_path / "kvshot2.md"
    text = k2.render(results, runs_root=f["runs"], doc=str(doc), img_dir=str(tmp_path))
    assert doc.read_text() == text
    assert "1 of 18 runs measured" in text
    for run in ("eagle3-s1", "kv2-s0", "block_kv-s2", "eagle3_more-s0"):
        assert run in text.split("Missing:")[1].split("\n")[0]
    assert k2.MISSING in text
    status, simulated, loop = [x for x in text.splitlines() if x.startswith("| kv2 (KV-only")]
    assert "not trained yet" in status  # kv2-s0 exists but has no export
    assert k2.MISSING in simulated and k2.MISSING in loop
    assert "(c) Block-wise" in text and "not yet measured" in text.split("(c) Block-wise")[1]
    assert os.path.isfile(tmp_path / "kvshot2_tau.png")
    # the tiny run's own figures are in the tables (one seed: marked ¹)
    status, simulated, loop = [x for x in text.splitlines() if x.startswith("| eagle3 (hidden")]
    assert "measured" in status and "¹" in simulated and "¹" in loop


def test_zero_kv_branch_zeroes_only_gate_d():
    from flax import nnx

    from specjax.drafters import DrafterConfig, build_network
    from specjax.testing.tiny import tiny_config

    tc = tiny_config(320, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=8, intermediate_size=64)
    params = nnx.state(build_network(DrafterConfig.for_target(tc, "hybrid", gamma=3),
                                     rngs=nnx.Rngs(0)), nnx.Param)
    out = protocol.zero_kv_branch({"net": params, "embed": np.ones(2)})
    flat_in = dict(nnx.to_flat_state(params))
    flat_out = dict(nnx.to_flat_state(out["net"]))
    assert np.abs(np.asarray(flat_in[("gate_d",)].get_value())).sum() > 0
    for key, var in flat_out.items():
        got = np.asarray(var.get_value())
        if key == ("gate_d",):
            assert not got.any()
        else:
            np.testing.assert_array_equal(got, np.asarray(flat_in[key].get_value()))
    eagle = nnx.state(build_network(DrafterConfig.for_target(tc, "eagle3", gamma=3),
                                    rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(ValueError):
        protocol.zero_kv_branch(eagle)


@pytest.mark.parametrize("kind,sets", [
    pytest.param("kv", ["drafter.kind=kv", "drafter.num_layers=2"], marks=pytest.mark.slow),
    pytest.param("block", ["objective=block", "drafter.kind=block", "drafter.context=kv",
                           "drafter.num_anchors=4"], marks=pytest.mark.slow),
])
def test_probes_on_tiny_kv_drafters(fake_study, kind, sets):
    """The query and gradient probes run on both drafters with a KV memory (TTT and
    block-wise) and give cosines in [-1, 1] and gradient shares in [0, 1]."""
    from benchmarks.studies.kvshot import kvshot_probes

    f = fake_study
    cfg = protocol.load_config_for("eagle3", 0, runs_root=str(f["dir"] / f"runs_{kind}"),
                             config_dir=f["configs"], overrides=[*f["overrides"], *sets])
    cfg, run = kvshot_probes.run_of_config(cfg)
    run.export(run.trainer.init_state(), 0, None)
    params = run.trainer.load_init_params(cfg.export_dir, cfg.target_dir)[0]
    got = protocol.probes(kind, cfg, run, params, {"query": 1, "grad": 2})
    q, g = got["query_cosine"], got["grad"]
    assert len(q["layers"]) == 2 and all(-1 <= x["trained"] <= 1 for x in q["layers"])
    assert ("trained_mask" in q["layers"][0]) == (kind == "block")
    for which in ("init", "trained"):
        parts = g[which]["parts"]
        assert all(0 <= parts[p]["fraction"] <= 1 for p in ("k_proj", "v_proj", "merge_k"))


@pytest.mark.slow  # study tooling on the fake study's trained runs
def test_decode_hybrid_with_its_kv_branch_zeroed(fake_study):
    """The in-loop ablation runs through the same compiled loop with gate_d zeroed; both
    variants stay lossless at T = 0."""
    from specjax.testing.tiny import save_random_drafter

    f = fake_study
    drafter = save_random_drafter(str(f["dir"] / "target"), str(f["dir"] / "hybrid"),
                                  kind="hybrid", gamma=3)
    prompts = protocol.held_out_prompts(str(f["dir"] / "val.npy"), 2, 8)
    got = protocol.decode(str(f["dir"] / "target"), drafter, prompts, 5, settings=("t0",),
                    ablate=True)
    assert set(got) == {"t0", "t0_nokv"}
    for rec in got.values():
        assert all(rec["identical"]) and len(rec["steps"]) == 2


@pytest.mark.slow  # study tooling; the `measured` fixture trains and decodes
def test_report_with_every_drafter_pairs_them(fake_study, measured, tmp_path):
    """Records for every drafter (the tiny run's, with accepted drafts changed per drafter):
    every claim gets an interval, and the paired difference's estimate is the difference
    of the two drafters' tau computed here."""
    import copy

    f = fake_study
    base = protocol.load_results(f["results"])["eagle3", 0]
    results = {}
    for i, name in enumerate(k2.MATRIX):
        for seed in (0, 1):
            r = copy.deepcopy(base)
            r["name"], r["seed"] = name, seed
            sim = r["simulated"]
            sim["accepted"] = [[min(c, a + i + seed) for a in row]
                               for row, c in zip(sim["accepted"], sim["chains"], strict=True)]
            if name == "hybrid_from_eagle3":
                r["simulated_nokv"] = copy.deepcopy(base["simulated"])
                sim["gate"], sim["gate_count"] = [1.0] * 3, [4.0] * 3
                for s in ("t0", "t1_block"):
                    r["decode"][protocol.ABLATED[s]] = copy.deepcopy(r["decode"][s])
            if name == "kv2":
                r["probes"] = {"grad": {"objective": "ttt", **{w: {"total": 2.0, "parts": {
                    p: {"norm": 1.0, "fraction": 0.5} for p in
                    ("k_proj", "v_proj", "merge_k", "merge_v", "q_proj")}}
                    for w in ("init", "trained")}}}
            results[name, seed] = r
    text = k2.render(results, runs_root=f["runs"], doc=None, img_dir=None)
    assert "12 of 18 runs measured" in text
    claims = text.split("## What the intervals allow")[1]
    assert k2.MISSING not in claims.replace("(b) Depth", "")
    assert "0.250" in text and "gate" in text  # the hybrid's gate mean 1/4

    def tau(name):
        acc = sum(sum(sum(row) for row in results[name, s]["simulated"]["accepted"])
                  for s in (0, 1))
        chains = sum(sum(results[name, s]["simulated"]["chains"]) for s in (0, 1))
        return 1 + acc / chains

    d = protocol.paired(results, "block_kv", "kv2", "tau_sim")
    assert d["seed_list"] == [0, 1] and d["seeds"] == 2
    assert d["estimate"] == pytest.approx(tau("block_kv") - tau("kv2"))
    assert d["lo"] <= d["estimate"] <= d["hi"]


# ----------------------------------------------------------------------------- committed doc

@pytest.mark.timeout(120)
def test_committed_doc_is_the_report_of_the_committed_results(monkeypatch, tmp_path):
    """docs/kvshot2.md is, byte for byte, what `kvshot_study2.py report` makes of the
    committed results (benchmarks/results/studies/kvshot/kvshot2_device/*.json, the runs'
    committed configs and provenance.json), so a figure edited by hand or a results file
    changed without re-rendering shows here. The report is written to a copy of docs/
    (the image links are relative to the doc); the plots are not drawn again (matplotlib
    output is not byte-stable): write_plots is replaced by the paths of the two images,
    which must be committed."""
    device = os.path.join(ROOT, "benchmarks", "results", "studies", "kvshot", "kvshot2_device")
    committed = open(k2.DOC).read()
    assert f"from {os.path.relpath(device, ROOT)}/*.json" in committed.splitlines()[2]
    names = [f"kvshot2_{n}.png" for n in ("tau", "alpha")]
    assert all(os.path.isfile(os.path.join(k2.IMG_DIR, n)) for n in names)
    doc, img_dir = tmp_path / "docs" / "kvshot2.md", tmp_path / "docs" / "img"
    drawn = []
    monkeypatch.setattr(k2, "write_plots", lambda results, where: drawn.append(where)
                        or [os.path.join(where, n) for n in names])
    results = protocol.load_results(device)
    assert len(results) == 18
    text = k2.render(results, runs_root=os.path.join(device, "runs"), doc=str(doc),
                     img_dir=str(img_dir), results_dir=device)
    assert drawn == [str(img_dir)] and doc.read_text() == text
    assert text == committed
