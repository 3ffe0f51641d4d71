"""train.py / specjax.train: mesh parity, bit-exact resume, SIGTERM, config errors, HF export.

All runs use configs/test_tiny.yaml (D 32, L 2, V 320, B 8, T 16) on a token stream of
a few standard-library files under a 300-token BPE, on 8 simulated CPU devices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import train as train_cli
from specjax.errors import SpecjaxError
from specjax.train import load_config, train
from specjax.train import mesh as mesh_lib
from specjax.train.checkpointing import Checkpoints
from specjax.train.config import MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "test_tiny.yaml")
STEPS = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{"tokens", "val", "tokenizer"}: a BPE of 300 tokens and the token streams of
    a few standard-library files (EOS after each)."""
    from specjax.testing.tiny import write_token_corpus

    d = tmp_path_factory.mktemp("corpus")
    tok, paths = write_token_corpus(str(d))
    tok.save_pretrained(str(d / "tok"))
    return {**paths, "tokenizer": str(d / "tok")}


def tiny_args(corpus, mesh=(1, 1, 1), *extra):
    d, f, m = mesh
    return [f"data.tokens_npy={corpus['tokens']}", f"data.val_tokens_npy={corpus['val']}",
            f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.model={m}", *extra]


def tiny_cfg(corpus, run_dir, mesh=(1, 1, 1), *extra):
    return load_config(TINY, tiny_args(corpus, mesh, *extra), run_dir=str(run_dir))


def params_np(result):
    return {k: np.asarray(v) for k, v in jax.device_get(result.state.params).items()}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Memoised uninterrupted 5-step runs, keyed by (mesh, grad_accum)."""
    cache = {}

    def get(mesh, accum=1):
        key = (mesh, accum)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("run")
            cache[key] = train(tiny_cfg(corpus, run_dir, mesh, f"train.grad_accum={accum}",
                                        "export.enabled=false"), progress=False)
        return cache[key]

    return get


# ----------------------------------------------------------------------------- sharding

@pytest.mark.parametrize("mesh,accum", [((2, 2, 2), 1), ((8, 1, 1), 1), ((2, 2, 2), 2)])
def test_losses_match_single_device(runs, mesh, accum):
    ref = runs((1, 1, 1))
    got = runs(mesh, accum)
    assert sorted(ref.losses) == list(range(1, STEPS + 1))
    a = np.array([ref.losses[s] for s in sorted(ref.losses)])
    b = np.array([got.losses[s] for s in sorted(got.losses)])
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert a[-1] < a[0]  # it learns
    np.testing.assert_allclose(got.val_losses[STEPS], ref.val_losses[STEPS], rtol=1e-5)


def test_shardings_follow_the_rules(runs):
    res = runs((2, 2, 2))
    params = res.state.params
    assert params["q_proj"].get_value().sharding.spec == P(None, "model", "fsdp")  # [L,NH,D]
    assert params["down_proj"].get_value().sharding.spec == P(None, "fsdp", "model")
    assert params["embed"].get_value().sharding.spec == P("model", "fsdp")  # [V, D]
    assert params["input_norm"].get_value().sharding.spec == P(None, None)
    mu = res.state.opt_state[1][0].mu  # clip, then AdamW's scale_by_adam
    assert mu["gate_proj"].get_value().sharding.spec == P(None, "model", "fsdp")
    assert res.trainer.batch_sharding.spec == P(None, ("data", "fsdp"), None)
    # a dimension the mesh does not divide stays replicated
    mesh = mesh_lib.make_mesh(MeshConfig(1, 1, 8))
    assert mesh_lib.logical_spec(mesh, ("layers", "kv_heads", "embed"), (2, 12, 32)) == P(
        None, None, None)


# ----------------------------------------------------------------------------- resume

def test_resume_is_bit_exact(runs, corpus, tmp_path):
    ref = runs((2, 2, 2))
    # async saves every step: the next step donates the state while orbax writes it
    cfg = tiny_cfg(corpus, tmp_path / "run", (2, 2, 2), "export.enabled=false",
                   "train.async_checkpointing=true", "train.checkpoint_every=1")
    first = train(cfg, stop_at=3, progress=False)
    assert first.step == 3 and not first.preempted
    assert Checkpoints(str(tmp_path / "run" / "checkpoints"), 2).latest_step() == 3
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "3"]  # keep 2
    second = train(cfg, progress=False)
    assert sorted(second.losses) == [4, 5]
    for s in (4, 5):
        assert second.losses[s] == ref.losses[s], s  # bit for bit
    for s in (1, 2, 3):
        assert first.losses[s] == ref.losses[s], s
    want, got = params_np(ref), params_np(second)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_resume_on_another_mesh(runs, corpus, tmp_path, capsys):
    ref = runs((1, 1, 1))
    first = train(tiny_cfg(corpus, tmp_path / "run", (2, 2, 2), "export.enabled=false"),
                  stop_at=3, progress=False)
    assert "resuming with settings" not in capsys.readouterr().err
    second = train(tiny_cfg(corpus, tmp_path / "run", (1, 4, 2), "export.enabled=false"),
                   progress=False)
    # the resume says what changed (here only the mesh), in one warning line
    warned = [line for line in capsys.readouterr().err.splitlines()
              if "resuming with settings" in line]
    assert len(warned) == 1 and "mesh.data 2 -> 1" in warned[0], warned
    assert "mesh.fsdp 2 -> 4" in warned[0] and "train." not in warned[0], warned
    assert sorted(first.losses) == [1, 2, 3] and sorted(second.losses) == [4, 5]
    got = [{**first.losses, **second.losses}[s] for s in range(1, STEPS + 1)]
    np.testing.assert_allclose(got, [ref.losses[s] for s in range(1, STEPS + 1)], rtol=1e-5)
    assert second.state.params["embed"].get_value().sharding.spec == P("model", "fsdp")


def test_sigterm_checkpoints_and_exits_0(corpus, tmp_path):
    run_dir = tmp_path / "run"
    sets = tiny_args(corpus, (2, 2, 2), "train.steps=100000", "export.enabled=false")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "--run-dir",
           str(run_dir), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and any('"loss"' in line for line in open(metrics)):
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "preempted" in err
    lines = [json.loads(x) for x in open(metrics)]
    assert lines[-1]["event"] == "preempted"
    step = Checkpoints(str(run_dir / "checkpoints"), 2).latest_step()
    assert step is not None and step == lines[-1]["step"] >= 1
    assert not [d for d in os.listdir(run_dir / "checkpoints") if "tmp" in d]
    # the checkpoint loads: resuming runs exactly one more step from it
    cfg = tiny_cfg(corpus, run_dir, (2, 2, 2), "train.steps=100000", "export.enabled=false")
    res = train(cfg, stop_at=step + 1, progress=False)
    assert sorted(res.losses) == [step + 1] and np.isfinite(res.losses[step + 1])


# ----------------------------------------------------------------------------- errors

def _cli(args, capsys):
    code = train_cli.main(["--config", TINY, "--no-progress", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["--set", "train.stepz=3"], "unknown config key train.stepz"),
    (["--set", "bogus=1"], "unknown config key bogus"),
    (["--set", "train.steps=many"], "train.steps must be an integer"),
    (["--set", "mesh.data=3"], "does not divide the 8 devices"),
    (["--set", "mesh.data=4", "--set", "train.batch_size=6"], "not divisible by data*fsdp=4"),
    (["--set", "mesh.data=2", "--set", "mesh.fsdp=2", "--set", "train.grad_accum=4"],
     "not divisible by data*fsdp=4"),
    (["--set", "data.tokens_npy=/nonexistent/t.npy"], "data.tokens_npy /nonexistent/t.npy"),
    (["--set", "data.tokens_npy=[/nonexistent/t.npy]"], "data.tokens_npy /nonexistent/t.npy"),
    (["--set", "data.tokens_npy=[]"], "data.tokens_npy is an empty list"),
    (["--set", "data.tokens_npy=null", "--set", "data.val_tokens_npy=null",
      "--set", "data.corpus=stdlib", "--set", "data.corpus_root=/nonexistent"], "data.corpus_root /nonexistent"),
    (["--set", "objective=rl"], "objective='rl' is not implemented"),
    (["--set", "objective=ttt"], "objective=ttt trains a drafter and needs a drafter section"),
])
def test_bad_config_exits_2_with_one_line(corpus, tmp_path, capsys, extra, needle):
    sets = []
    for s in tiny_args(corpus, (8, 1, 1)):
        sets += ["--set", s]
    code, err = _cli(["--run-dir", str(tmp_path / "run"), *sets, *extra], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("train.py: error: "), err
    assert needle in err, err


def test_a_list_of_token_files_trains_on_their_concatenation(corpus, tmp_path):
    """data.tokens_npy as a list (u16 and i32 files): the rows are those of the single
    concatenated file, so the first training losses are the same."""
    from specjax.train.inputs import prepare_data

    tokens = np.load(corpus["tokens"])
    cut = [0, 1000, 1005, 4000, tokens.size]
    paths = []
    for i in range(4):
        paths.append(str(tmp_path / f"part{i}.npy"))
        np.save(paths[-1], tokens[cut[i]:cut[i + 1]].astype(np.int32 if i == 2 else np.uint16))
    listed = tiny_cfg(corpus, tmp_path / "a", (8, 1, 1), f"data.tokens_npy=[{','.join(paths)}]",
                      "train.steps=3")
    whole = tiny_cfg(corpus, tmp_path / "b", (8, 1, 1), "train.steps=3")
    assert listed.data.tokens_npy == tuple(paths) and whole.data.tokens_npy == (
        corpus["tokens"],)
    a, b = prepare_data(listed).train, prepare_data(whole).train
    for pos in (0, 16, 5 * b.num_sequences + 3):
        np.testing.assert_array_equal(a.batch(pos, 8)[0], b.batch(pos, 8)[0])
    la, lb = train(listed, progress=False).losses, train(whole, progress=False).losses
    np.testing.assert_allclose([la[s] for s in (1, 2, 3)], [lb[s] for s in (1, 2, 3)],
                               rtol=1e-6)


def test_unknown_key_in_yaml_file_via_subprocess(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(TINY).read().replace("  grad_accum: 1", "  grad_acum: 1"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                           str(bad)], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "unknown config key train.grad_acum" in proc.stderr


def test_config_roundtrip_and_overrides(tmp_path):
    cfg = load_config(TINY, ["optim.lr=3e-4", "model.eos_token_ids=[0, 2]",
                             "data.seq_len=32"], run_dir=str(tmp_path))
    assert cfg.optim.lr == 3e-4 and cfg.model.eos_token_ids == (0, 2)
    assert cfg.data.seq_len == 32 and cfg.run_dir == str(tmp_path)
    from specjax.train.config import dump_config

    dump_config(cfg, str(tmp_path / "c.yaml"))
    assert load_config(str(tmp_path / "c.yaml")) == cfg
    with pytest.raises(SpecjaxError, match="train.batch_size=6 is not divisible by "
                                           "train.grad_accum=4"):
        load_config(TINY, ["train.batch_size=6", "train.grad_accum=4"])
    for path in ("configs/demo_target.yaml", "configs/demo_draft.yaml"):
        c = load_config(os.path.join(ROOT, path))
        assert c.data.cache_dir == "runs/data/stdlib-bpe8192"
    target = load_config(os.path.join(ROOT, "configs/demo_target.yaml")).model
    assert 20e6 < target.num_params < 30e6


# ----------------------------------------------------------------------------- export

def test_export_loads_in_transformers(corpus, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from specjax.models.checkpoint import load_model

    cfg = tiny_cfg(corpus, tmp_path / "run", (2, 1, 2),
                   f"data.tokenizer_dir={corpus['tokenizer']}")
    res = train(cfg, progress=False)
    hf_dir = res.export_dir
    assert hf_dir == str(tmp_path / "run" / "hf")
    gen = json.load(open(os.path.join(hf_dir, "generation_config.json")))
    assert gen["eos_token_id"] == 0  # from the tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = np.asarray([tok.encode("def main():\n    return 42\n")], np.int32)
    T = ids.shape[1]
    trained = res.trainer.model(jax.device_get(res.state.params))
    positions = np.arange(T, dtype=np.int32)[None]
    want = np.asarray(trained(ids, positions, trained.init_cache(1, T)).logits)
    loaded = load_model(hf_dir)
    got = np.asarray(loaded(ids, positions, loaded.init_cache(1, T)).logits)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ref, want, atol=1e-4, rtol=1e-4)


def test_init_from_continues_an_exported_model(runs, corpus, tmp_path, capsys):
    first = train(tiny_cfg(corpus, tmp_path / "a", (1, 1, 1),
                           f"data.tokenizer_dir={corpus['tokenizer']}"), progress=False)
    cont = train(tiny_cfg(corpus, tmp_path / "b", (2, 1, 2), f"train.init_from={first.export_dir}",
                          "export.enabled=false", "train.steps=1"), progress=False)
    # The fresh state starts from the exported weights (f32 export: exactly) ...
    start = cont.trainer.load_init_params(first.export_dir)
    for k, v in params_np(first).items():
        np.testing.assert_array_equal(np.asarray(start[k].get_value()), v)
    # ... so its first loss is the trained model's loss, well below a random init's.
    assert cont.losses[1] < runs((1, 1, 1)).losses[1] - 0.3
    code = train_cli.main(["--config", TINY, "--run-dir", str(tmp_path / "c"),
                           *sum((["--set", a] for a in tiny_args(
                               corpus, (1, 1, 1), f"train.init_from={first.export_dir}",
                               "model.hidden_size=64")), [])])
    err = capsys.readouterr().err
    assert code == 2 and "holds another model" in err and len(err.strip().splitlines()) == 1


def test_plot_training_curves(tmp_path, capsys):
    from specjax.tools import plot as tool
    from specjax.train import plot

    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in [
        {"event": "start", "step": 0}, {"step": 1, "loss": 5.0, "tokens": 100},
        {"step": 2, "loss": 4.0, "tokens": 200}, {"step": 2, "val_loss": 4.5},
        {"step": 2, "val_loss": 4.4, "alpha": [0.5], "tau": 1.5}]) + "\n")
    got = plot.read_metrics(str(a))
    assert got["train"] == [(100, 5.0), (200, 4.0)]
    assert got["val"] == [(200, 4.5), (200, 4.4)] and got["tau"] == [(200, 1.5)]
    out = tmp_path / "c.png"
    assert tool.main([str(a), str(a), "--offset-tokens", "0", "200", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert tool.main([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "d.png")]) == 2
    assert "not a readable metrics.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "d.png").exists()


# ----------------------------------------------------------------------------- run dir faults

def test_unwritable_run_dir_is_one_line_exit_2(tmp_path, capsys):
    import train as train_cli

    for bad in ("/proc/x", str(tmp_path / "file" / "sub")):
        (tmp_path / "file").write_text("not a directory")
        code = train_cli.main(["--config", os.path.join(ROOT, "configs", "test_tiny.yaml"),
                               "--no-progress", "--run-dir", bad])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and "run_dir" in err and bad in err, err


def test_second_process_on_a_run_dir_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    from specjax.errors import SpecjaxError
    from specjax.train.run_dir import RunDirLock

    code = (f"import sys, time; sys.path.insert(0, {ROOT!r}); "
            "from specjax.train.run_dir import RunDirLock; "
            f"RunDirLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SpecjaxError, match=f"in use by another train.py \\(pid {holder.pid}\\)"):
            RunDirLock(str(tmp_path))
    finally:
        holder.kill()  # SIGKILL: the kernel drops the flock
        holder.wait()
    lock = RunDirLock(str(tmp_path))  # free again
    lock.release()


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(runs, corpus, tmp_path, capsys,
                                                              damage):
    """A crashed disk's leftovers in the newest checkpoint: resume from the one before,
    one warning line, and the run still ends bit-equal to an uninterrupted one."""
    ref = runs((2, 2, 2))
    cfg = tiny_cfg(corpus, tmp_path / "run", (2, 2, 2), "export.enabled=false",
                   "train.checkpoint_every=1", "train.keep_checkpoints=3")
    train(cfg, stop_at=3, progress=False)
    newest = tmp_path / "run" / "checkpoints" / "3"
    files = sorted(p for p in newest.rglob("*") if p.is_file() and p.stat().st_size > 0)
    assert files
    for p in files:
        if damage == "truncate":
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
        else:
            p.unlink()
    capsys.readouterr()
    second = train(cfg, progress=False)
    err = capsys.readouterr().err
    warnings = [x for x in err.splitlines() if "warning" in x]
    assert len(warnings) == 1 and "resuming from step 2" in warnings[0], err
    assert sorted(second.losses) == [3, 4, 5]  # step 3 is trained again
    for s in (3, 4, 5):
        assert second.losses[s] == ref.losses[s], s
    assert (tmp_path / "run" / "checkpoints" / "3.damaged").is_dir()


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(corpus, tmp_path):
    from specjax.errors import SpecjaxError

    cfg = tiny_cfg(corpus, tmp_path / "run", (1, 1, 1), "export.enabled=false",
                   "train.checkpoint_every=1", "train.keep_checkpoints=1")
    train(cfg, stop_at=1, progress=False)
    for p in (tmp_path / "run" / "checkpoints").rglob("*"):
        if p.is_file():
            p.write_bytes(b"")
    with pytest.raises(SpecjaxError, match="no checkpoint in .* can be restored"):
        train(cfg, progress=False)


def _files(path) -> dict:
    """{relative path: bytes (a file) or None (a directory)} of everything under `path`."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), path)] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), path)] = fh.read()
    return out


def _outside_vocab(directory) -> str:
    """A token stream with ids outside test_tiny's vocabulary (320): refused only once the
    data is opened, after the run dir is made."""
    path = os.path.join(directory, "big.npy")
    np.save(path, np.full(400, 999, np.int32))
    return path


def _sets(items):
    return [x for s in items for x in ("--set", s)]


@pytest.mark.parametrize("case,needle", [
    ("mesh", "does not divide the 8 devices"),
    ("missing_data", "data.tokens_npy /nonexistent/t.npy"),
    ("outside_vocab", "outside [0, 320)"),
    ("init_from", "nope"),
])
def test_failed_start_leaves_nothing_behind(corpus, tmp_path, capsys, case, needle):
    """A train.py that fails before its first step, whether its check comes before or
    after the run dir is made, leaves no run dir (nor the parents it made), no train.lock
    and no export directory parent: one line, exit 2, nothing else."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    extra = {"mesh": ["mesh.data=3"], "missing_data": ["data.tokens_npy=/nonexistent/t.npy"],
             "outside_vocab": [f"data.tokens_npy={_outside_vocab(inputs)}"],
             "init_from": [f"train.init_from={inputs / 'nope'}"]}[case]
    code, err = _cli(["--run-dir", str(tmp_path / "new" / "run"), *_sets(
        [*tiny_args(corpus, (8, 1, 1)), f"export.dir={tmp_path / 'exp' / 'sub' / 'hf'}",
         *extra])], capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert sorted(os.listdir(tmp_path)) == ["inputs"]


def test_failed_start_in_an_existing_dir_removes_only_what_it_added(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    code, err = _cli(["--run-dir", str(run_dir), *_sets(
        [*tiny_args(corpus, (8, 1, 1)), f"data.tokens_npy={_outside_vocab(tmp_path)}"])],
        capsys)
    assert code == 2 and err.count("\n") == 1 and "outside [0, 320)" in err, err
    assert _files(run_dir) == {"notes.txt": b"mine"}


def test_failed_resume_leaves_the_run_dir_as_it_was(corpus, tmp_path, capsys):
    """A resume refused for another model, for data outside the vocabulary, or because
    no checkpoint restores (here with a changed train.steps): every file of the run,
    config.yaml included, is as it was."""
    run_dir = tmp_path / "run"
    keep = [*tiny_args(corpus), "export.enabled=false", "train.checkpoint_every=1",
            "train.keep_checkpoints=1"]
    train(load_config(TINY, keep, run_dir=str(run_dir)), stop_at=1, progress=False)
    before = _files(run_dir)
    assert "config.yaml" in before and "train.lock" in before
    for extra, needle in ((["model.hidden_size=64"], "different model"),
                          ([f"data.tokens_npy={_outside_vocab(tmp_path)}"], "outside"),
                          (["train.steps=7"], "can be restored")):
        if needle == "can be restored":
            for p in (run_dir / "checkpoints").rglob("*"):
                if p.is_file():
                    p.write_bytes(b"")
            before = _files(run_dir)
        code, err = _cli(["--run-dir", str(run_dir), *_sets([*keep, *extra])], capsys)
        assert code == 2 and err.count("\n") == 1 and needle in err, err
        assert _files(run_dir) == before, needle


def _wait_for(proc, cond, timeout=120.0):
    """Polls cond() every millisecond until true; False if proc ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.001)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_sigkill_at_any_moment_resumes_to_the_same_parameters(corpus, tmp_path):
    """train.py SIGKILLed mid-step, while a checkpoint is being written and while the
    export is being written, then restarted each time: the exported weights equal an
    uninterrupted run's bit for bit, and no temporary directory is taken for a result."""
    from safetensors.numpy import load_file

    steps = 8
    extra = ("train.checkpoint_every=1", "train.async_checkpointing=true",
             f"train.steps={steps}", "train.keep_checkpoints=2")
    ref = train(tiny_cfg(corpus, tmp_path / "ref", (1, 1, 1), *extra), progress=False)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "--run-dir",
           str(run_dir), "--no-progress"]
    for s in tiny_args(corpus, (1, 1, 1), *extra):
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=ROOT)
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"

    def stepped(n):
        return lambda: metrics.exists() and sum('"loss"' in x for x in open(metrics)) >= n

    def ckpt_tmp():
        return ckpts.is_dir() and any("tmp" in d for d in os.listdir(ckpts))

    def export_tmp():
        return run_dir.is_dir() and any(d.startswith(".tmp-export") for d in
                                        os.listdir(run_dir))

    kills = 0
    for when in (stepped(2), ckpt_tmp, export_tmp):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            if _wait_for(proc, when):
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert kills >= 2  # the export window is short: it may finish first
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "done at step 8" in proc.stderr
    got = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
    want = load_file(os.path.join(ref.export_dir, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not [d for d in os.listdir(run_dir) if d.startswith(".tmp")]
