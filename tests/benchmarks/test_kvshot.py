"""The KVShot study's configs and report (benchmarks/studies/kvshot/kvshot.py, kvshot_report.py): the
matrix is on equal terms, and the generated tables compute retention and gate columns
from the records they are given (checked against arithmetic done here)."""

from __future__ import annotations

import glob
import os

import pytest

from benchmarks.studies.kvshot import kvshot, kvshot_report
from specjax.train import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_study_configs_are_on_equal_terms():
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "study", "*.yaml")))
    names = [os.path.basename(p)[:-5] for p in paths]
    assert sorted(names) == sorted(kvshot.RUNS)
    cfgs = {n: load_config(p) for n, p in zip(names, paths, strict=True)}
    same = {(c.target, c.data.cache_dir, c.data.seq_len, c.data.seed, c.train.seed,
             c.train.steps, c.train.batch_size, c.train.grad_accum, c.drafter.gamma,
             c.optim.lr, c.train.eval_every, c.train.eval_batches) for c in cfgs.values()}
    assert len(same) == 1
    (_, _, T, _, _, steps, B, A, G, _, _, _), = same
    assert steps * B * A * T >= 1_000_000 and G == 7
    assert {n: c.drafter.num_layers for n, c in cfgs.items() if c.drafter.kind == "kv"} == \
        {"kv1": 1, "kv2": 2, "kv4": 4}
    assert {n: c.drafter.context for n, c in cfgs.items() if c.drafter.kind == "block"} == \
        {"block_hidden": "hidden", "block_kv": "kv", "block_both": "both"}
    assert all(c.objective == ("block" if c.drafter.kind == "block" else "ttt")
               for c in cfgs.values())
    # the hybrid's warm start is the study's own eagle3, trained first
    assert cfgs["hybrid_from_eagle3"].train.init_from == cfgs["eagle3"].export_dir
    assert kvshot.RUNS.index("eagle3") < kvshot.RUNS.index("hybrid_from_eagle3")
    assert all(c.run_dir == f"runs/study/{n}" for n, c in cfgs.items())


def test_train_rejects_unknown_runs(capsys):
    with pytest.raises(SystemExit) as e:
        kvshot.main(["train", "--only", "medusa"])
    assert e.value.code == 2


def _record(alpha, tau, gates=None):
    evals = [{"step": 64 * (i + 1), "tokens": 64 * (i + 1) * 2048, "val_loss": 1.0,
              "alpha": alpha, "tau": tau, **({"gate": g} if g is not None else {})}
             for i, g in enumerate(gates or [None])]
    acc = [a * 0.9 for a in alpha]
    return {"train": {"evals": evals, "params": 1_500_000, "tok_s": 2000.0,
                      "best": {"step": 64, "alpha": alpha, "tau": tau}},
            "eval": {"alpha": alpha, "acc": acc, "tau": tau, "val_loss": 1.0}}


def test_tables_from_records():
    a = [0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3]
    results = {"runs": {"kv2": _record(a, 2.1),
                        "hybrid": _record(a, 2.2, gates=[0.5, 0.2, 0.05])}}
    sim = kvshot_report.table_simulated(results)
    row = next(x for x in sim.splitlines() if x.startswith("| KV-only 2 layers"))
    # acc_0 0.54, acc_6 0.27: retention 50.0%; conditional alpha listed as given
    assert "| 0.540 | 0.270 | 50.0% | 0.60 0.50 0.50 0.50 0.50 0.50 0.30 | 2.10 |" in row
    assert "1.50M" in row
    gate = kvshot_report.table_gate(results).splitlines()
    assert gate[2].startswith("| 64 |") and "0.500" in gate[2] and "0.050" in gate[4]
    paper = kvshot_report.table_paper()
    assert "73.5%" in paper and "80.6%" in paper  # KVShot's retention: .469/.638, .495/.614


def test_redone_study_configs_are_on_equal_terms():
    """configs/study2/ (issue 29): the same regenerated data, held-out stream, budget, G and
    optimizer for every run; as many supervised positions per sequence for TTT (chains x G)
    as for block-wise runs (blocks x G); every context read at the same target depths."""
    from benchmarks.studies.kvshot import kvshot_runs

    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "study2", "*.yaml")))
    names = [os.path.basename(p)[:-5] for p in paths]
    assert sorted(names) == sorted(kvshot_runs.MATRIX)
    cfgs = {n: load_config(p) for n, p in zip(names, paths, strict=True)}
    same = {(c.target, c.data.tokens_npy, c.data.val_tokens_npy, c.data.seq_len,
             c.data.seed, c.train.steps, c.train.batch_size, c.train.grad_accum,
             c.drafter.gamma, c.optim.lr, c.optim.warmup_steps, c.train.eval_every,
             c.train.eval_batches) for c in cfgs.values()}
    assert len(same) == 1
    supervised = {n: (c.drafter.num_anchors if c.objective == "block"
                      else c.drafter.ttt_positions) for n, c in cfgs.items()}
    assert set(supervised.values()) == {64}, supervised
    from specjax.models.config import ModelConfig

    target = ModelConfig.from_dir(os.path.join(ROOT, "checkpoints", "demo", "target"))
    depths = set()
    for c in cfgs.values():
        d = c.drafter.for_target(target)
        depths |= {tuple(d.capture)} if d.capture else set()
        depths |= {tuple(d.kv_layers)} if d.kv_layers else set()
    assert len(depths) == 1, depths  # hidden depth d and KV layer d read the same stream
    for n, start in kvshot_runs.WARM_START.items():
        assert kvshot_runs.MATRIX.index(start) < kvshot_runs.MATRIX.index(n)


def test_matrix_jobs_seed_major_with_own_warm_start():
    from benchmarks.studies.kvshot import kvshot_runs

    jobs = kvshot.matrix_jobs(list(kvshot_runs.MATRIX), [0, 1])
    labels = [j[0] for j in jobs]
    assert labels[:len(kvshot_runs.MATRIX)] == [f"{n}-s0" for n in kvshot_runs.MATRIX]
    assert len(labels) == 2 * len(kvshot_runs.MATRIX)
    hyb = dict((j[0], j[1]) for j in jobs)["hybrid_from_eagle3-s1"]
    assert "train.seed=1" in hyb
    assert any(a.startswith("train.init_from=") and a.endswith(
        os.path.join("study2", "eagle3-s1", "drafter")) for a in hyb)
    with pytest.raises(SystemExit) as e:
        kvshot.main(["matrix", "--only", "hybrid_from_eagle3", "--seeds", "7"])
    assert e.value.code == 2
