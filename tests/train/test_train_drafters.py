"""train.py / specjax.train for drafters (objectives ttt and block) against a frozen target:
mesh parity, bit-exact resume, SIGTERM, best-tau export and its loader, bad input.

All runs use configs/test_tiny_drafter.yaml (B 8, T 16, G 3) against a random tiny Qwen3
target (D 32, L 4, N 4, K 2, H 8, V 320) saved with `specjax.models.checkpoint.save_model`, on a
token stream of a few standard-library files under a 300-token BPE, on 8 simulated CPU
devices (tests/conftest.py).
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
from specjax.train.checkpointing import Checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "test_tiny_drafter.yaml")
STEPS = 5
# (objective, drafter settings) of the two drafters the runs train
KINDS = {"eagle3": ("ttt", ["drafter.kind=eagle3"]),
         "block": ("block", ["drafter.kind=block", "drafter.num_anchors=4"]),
         "block_selector": ("block", ["drafter.kind=block", "drafter.num_anchors=4",
                                      "drafter.selector_rank=8", "drafter.selector_top_k=4"])}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """{"tokens", "val", "tokenizer", "target", "small_target"}: a 300-token BPE, token
    streams of a few standard-library files, a random tiny target (V 320) saved with that
    tokenizer, and one whose vocabulary (256) is smaller than the tokenizer's."""
    from flax import nnx

    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config, write_token_corpus

    d = tmp_path_factory.mktemp("drafter_data")
    tok, paths = write_token_corpus(str(d))
    tok.save_pretrained(str(d / "tok"))
    shapes = dict(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64)
    target = Transformer(tiny_config(320, **shapes), rngs=nnx.Rngs(7))
    save_model(target, str(d / "target"), tokenizer=tok)
    small = Transformer(tiny_config(256, **shapes), rngs=nnx.Rngs(7))
    save_model(small, str(d / "small_target"))
    return {**paths, "tokenizer": str(d / "tok"), "target": str(d / "target"),
            "small_target": str(d / "small_target")}


def tiny_args(setup, kind="eagle3", mesh=(1, 1, 1), *extra):
    objective, sets = KINDS[kind]
    d, f, m = mesh
    return [f"objective={objective}", *sets, f"target={setup['target']}",
            f"data.tokens_npy={setup['tokens']}", f"data.val_tokens_npy={setup['val']}",
            f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.model={m}", *extra]


def tiny_cfg(setup, run_dir, kind="eagle3", mesh=(1, 1, 1), *extra):
    return load_config(TINY, tiny_args(setup, kind, mesh, *extra), run_dir=str(run_dir))


def params_np(result):
    return {k: np.asarray(v) for k, v in jax.device_get(result.state.params).items()}


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """Memoised uninterrupted 5-step runs with validation at steps 2, 4 and 5, keyed by
    (kind, mesh)."""
    cache = {}

    def get(kind, mesh):
        if (kind, mesh) not in cache:
            run_dir = tmp_path_factory.mktemp("run")
            cache[kind, mesh] = train(tiny_cfg(setup, run_dir, kind, mesh,
                                               "train.eval_every=2"), progress=False)
        return cache[kind, mesh]

    return get


# ----------------------------------------------------------------------------- sharding

@pytest.mark.parametrize("kind,mesh", [  # the default run: each kind on one of the meshes
    pytest.param("eagle3", (2, 2, 2), id="eagle3-2x2x2"),
    pytest.param("eagle3", (8, 1, 1), id="eagle3-8x1x1", marks=pytest.mark.slow),
    pytest.param("block", (2, 2, 2), id="block-2x2x2", marks=pytest.mark.slow),
    pytest.param("block", (8, 1, 1), id="block-8x1x1"),
])
def test_losses_match_single_device(runs, kind, mesh):
    ref, got = runs(kind, (1, 1, 1)), runs(kind, mesh)
    assert sorted(ref.losses) == list(range(1, STEPS + 1))
    a = np.array([ref.losses[s] for s in sorted(ref.losses)])
    b = np.array([got.losses[s] for s in sorted(got.losses)])
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert a[-1] < a[0]  # it learns
    assert sorted(ref.val_metrics) == [2, 4, 5]
    for s in ref.val_metrics:
        want, have = ref.val_metrics[s], got.val_metrics[s]
        np.testing.assert_allclose(have["val_loss"], want["val_loss"], rtol=1e-5)
        assert len(want["alpha"]) == 3 and 1.0 <= want["tau"] <= 4.0
        # per-step accuracy: step 0 is alpha_0; a later step is at least the chain rate
        assert len(want["acc"]) == 3 and want["acc"][0] == pytest.approx(want["alpha"][0])
        chain = np.cumprod([a or 0.0 for a in want["alpha"]])
        assert all(c <= a + 1e-9 for c, a in zip(chain, want["acc"], strict=True))
        np.testing.assert_allclose(have["tau"], want["tau"], rtol=1e-5)


def test_drafter_and_target_are_sharded_by_the_rules(runs):
    res = runs("eagle3", (2, 2, 2))
    params = res.state.params
    # only the drafter's own weights are trained (the target's embedding / head are not)
    assert "embed" not in params and "lm_head" not in params and "fc" in params
    assert params["fc"].get_value().sharding.spec == P("fsdp", None)  # [D, C*D]
    assert params["q_proj"].get_value().sharding.spec == P(None, "model", "fsdp")  # [1,NH,2D]
    assert params["final_norm"].get_value().sharding.spec == P(None)
    mu = res.state.opt_state[1][0].mu
    assert mu["fc"].get_value().sharding.spec == P("fsdp", None)
    tp = res.trainer.target_params
    assert tp["embed"].get_value().sharding.spec == P("model", "fsdp")
    assert tp["q_proj"].get_value().sharding.spec == P(None, "model", "fsdp")


def test_param_axes_one_rule_per_rank():
    from specjax.train import mesh as mesh_lib

    assert mesh_lib.param_axes("final_norm", 1) == ("norm",)
    assert mesh_lib.param_axes("final_norm", 2) == ("layers", "norm")
    assert mesh_lib.param_axes("q_proj", 3) == ("layers", "heads", "embed")
    assert mesh_lib.param_axes("q_proj", 2) is None and mesh_lib.param_axes("nope", 1) is None
    for name in ("fc", "embed_norm", "hidden_norm", "merge_k", "merge_v", "cross_q",
                 "cross_q_norm", "cross_o", "cross_norm", "gate_w", "gate_b", "gate_d"):
        assert name in mesh_lib.PARAM_AXES, name


# ----------------------------------------------------------------------------- resume

@pytest.mark.slow
def test_resume_is_bit_exact(runs, setup, tmp_path):
    """block: the step key draws the anchors, so this also checks the RNG is restored."""
    ref = runs("block", (2, 2, 2))
    cfg = tiny_cfg(setup, tmp_path / "run", "block", (2, 2, 2), "train.eval_every=2",
                   "train.async_checkpointing=true", "train.checkpoint_every=1")
    first = train(cfg, stop_at=3, progress=False)
    assert first.step == 3 and not first.preempted and first.export_dir is None
    assert not os.path.exists(tmp_path / "run" / "drafter")  # no export before the end
    second = train(cfg, progress=False)
    assert sorted(second.losses) == [4, 5]
    for s in (1, 2, 3):
        assert first.losses[s] == ref.losses[s], s
    for s in (4, 5):
        assert second.losses[s] == ref.losses[s], s  # bit for bit
    want, got = params_np(ref), params_np(second)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the best-tau record survives the restart: the same export as uninterrupted
    assert second.best == ref.best
    # a run dir holds one drafter: another one is refused with one line
    other = tiny_cfg(setup, tmp_path / "run", "block", (2, 2, 2), "drafter.gamma=2",
                     "train.steps=6")
    with pytest.raises(SpecjaxError, match="holds checkpoints of another drafter") as e:
        train(other, progress=False)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # the lm objective's twin in test_train.py runs by default
def test_sigterm_checkpoints_and_exits_0(setup, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "--run-dir",
           str(run_dir), "--no-progress"]
    for s in tiny_args(setup, "eagle3", (2, 2, 2), "train.steps=100000"):
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
    assert not (run_dir / "drafter").exists()
    cfg = tiny_cfg(setup, run_dir, "eagle3", (2, 2, 2), "train.steps=100000")
    res = train(cfg, stop_at=step + 1, progress=False)
    assert sorted(res.losses) == [step + 1] and np.isfinite(res.losses[step + 1])


# ----------------------------------------------------------------------------- export

def test_export_is_the_best_tau_drafter_and_loads_back(runs, setup):
    from specjax.drafters import DrafterConfig
    from specjax.drafters.io import load_drafter
    from specjax.train.drafter_run import BEST_DIR

    res = runs("eagle3", (1, 1, 1))
    out = res.export_dir
    assert out == os.path.join(os.path.dirname(res.export_dir), "drafter")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    run_dir = os.path.dirname(out)
    assert not [d for d in os.listdir(run_dir) if d.startswith(".")]  # no temp dirs left
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["format"] == "specjax-drafter" and raw["kind"] == "eagle3" and raw["gamma"] == 3
    sha = __import__("hashlib").sha256(
        open(os.path.join(setup["target"], "config.json"), "rb").read()).hexdigest()
    assert raw["target"]["config_sha256"] == sha and raw["target"]["vocab_size"] == 320
    assert raw["target"]["path"] == setup["target"] and raw["target"]["num_params"] > 0
    # best tau, not the last: the record is the argmax over the validations
    vals = res.val_metrics
    best = max(vals, key=lambda s: (vals[s]["tau"], -vals[s]["val_loss"], -s))
    assert raw["train"]["step"] == best == res.best["step"]
    assert raw["train"]["tau"] == vals[best]["tau"]
    assert raw["train"]["alpha"] == vals[best]["alpha"]
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    val = [x for x in lines if "tau" in x and "event" not in x]
    assert [x["step"] for x in val] == [2, 4, 5] and all(len(x["alpha"]) == 3 for x in val)
    assert lines[-1]["event"] == "done" and lines[-1]["best_step"] == best
    # only the drafter's weights, exactly (f32 export); load_drafter round-trips them
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(tensors) == sorted(params_np(res)) and "embed" not in tensors
    dcfg, params, target = load_drafter(out)
    assert isinstance(dcfg, DrafterConfig) and dcfg.capture == (0, 2, 4)
    assert target == raw["target"]
    snap = load_drafter(os.path.join(run_dir, BEST_DIR))[1]
    for name, arr in tensors.items():
        np.testing.assert_array_equal(np.asarray(params[name].get_value()), arr)
        np.testing.assert_array_equal(np.asarray(snap[name].get_value()), arr)
    if best == STEPS:
        for name, arr in params_np(res).items():
            np.testing.assert_array_equal(tensors[name], arr, err_msg=name)


def test_export_takes_the_best_tau_not_the_last_state(setup, tmp_path, monkeypatch):
    """Validation taus 2.0, 3.0, 1.0 at steps 2, 4, 5 (the real stats, with tau replaced):
    the export holds the weights of step 4, not those of step 5."""
    from specjax.drafters.io import load_drafter
    from specjax.train.drafter_run import DrafterRun

    fake_tau, seen = {2: 2.0, 4: 3.0, 5: 1.0}, {}
    validate = DrafterRun.validate

    def spy(self, state):
        record = validate(self, state)
        step = int(jax.device_get(state.step))
        seen[step] = jax.tree.map(np.asarray, jax.device_get(state.params))
        return {**record, "tau": fake_tau[step]}

    monkeypatch.setattr(DrafterRun, "validate", spy)
    res = train(tiny_cfg(setup, tmp_path / "run", "eagle3", (1, 1, 1), "train.eval_every=2"),
                progress=False)
    assert sorted(seen) == [2, 4, 5] and res.best["step"] == 4 and res.best["tau"] == 3.0
    _, params, _ = load_drafter(res.export_dir)
    for name in params_np(res):
        np.testing.assert_array_equal(np.asarray(params[name].get_value()),
                                      np.asarray(seen[4][name].get_value()), err_msg=name)
    assert not np.array_equal(np.asarray(params["fc"].get_value()), params_np(res)["fc"])


def test_save_drafter_replaces_atomically_and_bf16(runs, setup, tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file

    from specjax.drafters.io import load_drafter, save_drafter

    res = runs("eagle3", (1, 1, 1))
    dcfg, params, _ = load_drafter(res.export_dir)
    out = tmp_path / "d"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    save_drafter(str(out), dcfg, params, setup["target"], dtype=ml_dtypes.bfloat16)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert all(t.dtype == ml_dtypes.bfloat16
               for t in load_file(str(out / "model.safetensors")).values())
    _, back, _ = load_drafter(str(out))
    for name in ("fc", "q_proj"):
        want = np.asarray(params[name].get_value()).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(back[name].get_value()),
                                      want.astype(np.float32))
    assert os.listdir(tmp_path) == ["d"]


def test_load_drafter_errors_are_one_line(runs, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from specjax.drafters.io import load_drafter

    src = runs("eagle3", (1, 1, 1)).export_dir

    def broken(name, edit):
        d = tmp_path / name
        shutil.copytree(src, d)
        edit(d)
        with pytest.raises(SpecjaxError) as e:
            load_drafter(str(d))
        assert "\n" not in str(e.value)
        return str(e.value)

    with pytest.raises(SpecjaxError, match="does not exist"):
        load_drafter(str(tmp_path / "nope"))
    assert "config.json is missing" in broken("a", lambda d: os.remove(d / "config.json"))
    assert "unreadable" in broken("b", lambda d: (d / "config.json").write_text("{oops"))
    assert "model.safetensors is missing" in broken(
        "c", lambda d: os.remove(d / "model.safetensors"))
    assert "not a readable safetensors" in broken(
        "d", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 20))

    def edit_tensors(d, fn):
        t = load_file(str(d / "model.safetensors"))
        fn(t)
        save_file(t, str(d / "model.safetensors"))

    def wrong_shape(t):
        t["fc"] = t["fc"][:, :-1].copy()

    assert "tensor fc has shape" in broken("e", lambda d: edit_tensors(d, wrong_shape))
    assert "tensor fc" in broken("f", lambda d: edit_tensors(d, lambda t: t.pop("fc")))
    assert "unexpected name" in broken(
        "g", lambda d: edit_tensors(d, lambda t: t.update(extra=np.zeros(2, np.float32))))


# ----------------------------------------------------------------------------- errors

def _cli(args, capsys):
    code = train_cli.main(["--config", TINY, "--no-progress", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["--set", "drafter.kind=medusa"], "drafter.kind='medusa' is unknown"),
    (["--set", "drafter.kind=block"], "use objective=block"),
    (["--set", "drafter.context=kv"], "drafter.context is a block drafter setting"),
    (["--set", "drafter=null"], "needs a drafter section"),
    (["--target", "/nonexistent/target"], "target /nonexistent/target does not exist"),
    (["--target", "{small_target}"], "has 300 tokens but target"),
    (["--target", "{small_target}", "--set", "data.tokenizer_dir=null"],
     "holds token ids outside [0, 256)"),
    (["--set", "data.tokenizer_dir={other_tok}"], "is not the one of target"),
], ids=["unknown-kind", "kind-vs-objective", "context-not-block", "no-drafter-section",
        "missing-target", "target-vocab-lt-tokenizer", "stream-outside-target-vocab",
        "other-tokenizer"])
def test_bad_input_exits_2_with_one_line(setup, tmp_path, capsys, extra, needle):
    from specjax.models.tokenizer import train_bpe
    from specjax.testing.tiny import stdlib_texts

    if any("{other_tok}" in x for x in extra):
        train_bpe(stdlib_texts(3), 300).save_pretrained(str(tmp_path / "other_tok"))
    fill = dict(setup, other_tok=str(tmp_path / "other_tok"))
    sets = []
    for s in tiny_args(setup, "eagle3", (8, 1, 1), f"data.tokenizer_dir={setup['tokenizer']}"):
        sets += ["--set", s]
    extra = [x.format(**fill) for x in extra]
    code, err = _cli(["--run-dir", str(tmp_path / "run"), *sets, *extra], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("train.py: error: "), err
    assert needle in err, err


def test_drafter_configs_validate(tmp_path):
    for kind in ("eagle3", "kv", "hybrid", "block"):
        cfg = load_config(os.path.join(ROOT, "configs", "drafters", f"{kind}.yaml"),
                          target=str(tmp_path))
        assert cfg.drafter.kind == kind and cfg.target == str(tmp_path) and cfg.model is None
        assert cfg.export_dir == os.path.join(cfg.run_dir, "drafter")
        assert (cfg.train.batch_size, cfg.data.seq_len, cfg.train.eval_every) == (8, 256, 250)
        assert cfg.data.cache_dir == "runs/data/stdlib-bpe8192"
    block = load_config(os.path.join(ROOT, "configs", "drafters", "block.yaml"))
    assert block.objective == "block" and block.drafter.context == "hidden"
    assert block.target_dir == "checkpoints/demo/target"
    lm = os.path.join(ROOT, "configs", "test_tiny.yaml")
    with pytest.raises(SpecjaxError, match="target is a drafter-training setting"):
        load_config(lm, target=str(tmp_path))
    with pytest.raises(SpecjaxError, match="remove the model section"):
        load_config(lm, ["objective=ttt", "drafter.kind=eagle3"])


# ----------------------------------------------------------------------------- init_from

def _fresh_params(cfg):
    """The starting parameters a run of `cfg` would take (host numpy, by dotted name)."""
    import jax.numpy as jnp
    from flax import nnx

    from specjax.train import mesh as mesh_lib
    from specjax.train.drafter_run import DrafterRun
    from specjax.train.optim import make_optimizer

    tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    run = DrafterRun(cfg, mesh_lib.make_mesh(cfg.mesh), tx, schedule, jnp.float32)
    state = run.fresh_state()
    return {".".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
            for p, v in nnx.to_flat_state(state.params)}, run.start_info


def test_init_from_starts_a_hybrid_from_a_trained_eagle3(runs, setup, tmp_path):
    """KVShot's hybrid-from-EAGLE-3 start: every eagle3 tensor is loaded exactly, the
    hybrid's own tensors (cross-attention, gate, merge maps) keep the random init."""
    from safetensors.numpy import load_file

    src = runs("eagle3", (1, 1, 1)).export_dir
    theirs = load_file(os.path.join(src, "model.safetensors"))
    base = tiny_args(setup, "eagle3", (1, 1, 1), "drafter.kind=hybrid")
    random_init, _ = _fresh_params(load_config(TINY, base, run_dir=str(tmp_path / "a")))
    got, info = _fresh_params(load_config(TINY, base + [f"train.init_from={src}"],
                                          run_dir=str(tmp_path / "b")))
    assert info["init_from"] == src
    assert sorted(got) == sorted(random_init) and set(theirs) < set(got)
    for name, arr in got.items():
        want = theirs.get(name, random_init[name])
        np.testing.assert_array_equal(arr, want, err_msg=name)
    assert not np.array_equal(theirs["fc"], random_init["fc"])  # the load did something
    # and the run trains from there
    res = train(load_config(TINY, base + [f"train.init_from={src}", "train.steps=2"],
                            run_dir=str(tmp_path / "c")), progress=False)
    assert np.isfinite(res.losses[2])


def test_init_from_errors_are_one_line(runs, setup, tmp_path, capsys):
    src = runs("eagle3", (1, 1, 1)).export_dir
    block = runs("block", (1, 1, 1)).export_dir
    cases = [(["drafter.kind=kv", "drafter.num_layers=1"], src, "has no counterpart in a kv"),
             (["drafter.kind=hybrid"], block, "tensor down_proj has shape (2, 32, 64)"),
             (["drafter.kind=eagle3", "drafter.intermediate_size=48"], src, "has shape"),
             (["drafter.kind=eagle3"], str(tmp_path / "nowhere"), "nowhere"),
             (["drafter.kind=eagle3", f"target={setup['small_target']}",
               "data.tokenizer_dir=null", "data.tokens_npy=" + str(tmp_path / "t.npy"),
               "data.val_tokens_npy=" + str(tmp_path / "t.npy")], src, "not against target")]
    np.save(tmp_path / "t.npy", np.arange(200, dtype=np.uint16) % 250)
    for i, (extra, path, needle) in enumerate(cases):
        sets = []
        for s in tiny_args(setup, "eagle3", (1, 1, 1), *extra, f"train.init_from={path}"):
            sets += ["--set", s]
        code, err = _cli(["--run-dir", str(tmp_path / f"r{i}"), *sets], capsys)
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith("train.py: error: "), err
        assert needle in err, err
        assert not (tmp_path / f"r{i}" / "drafter").exists()


def test_init_from_other_target_when_asked(runs, setup, tmp_path):
    """train.init_from_other_target re-fits a drafter to other target weights of the same
    shapes (a target trained on further); without it the same start is refused."""
    from specjax.models.checkpoint import load_model, save_model

    src = runs("eagle3", (1, 1, 1)).export_dir
    other = str(tmp_path / "other_target")
    model = load_model(setup["target"])
    model.embed.set_value(model.embed[...] * 1.01)  # the same shapes, other weights
    save_model(model, other)
    base = tiny_args(setup, "eagle3", (1, 1, 1), f"target={other}",
                     f"train.init_from={src}", "train.steps=2")
    with pytest.raises(SpecjaxError, match="not against target"):
        train(load_config(TINY, base, run_dir=str(tmp_path / "refused")), progress=False)
    res = train(load_config(TINY, base + ["train.init_from_other_target=true"],
                            run_dir=str(tmp_path / "refit")), progress=False)
    assert np.isfinite(res.losses[2])


def test_block_with_path_selector_trains_exports_and_loads(runs):
    """DFlash2's path selector trains with the block (its loss falls), is exported with the
    selector's weights and config, and loads back as the same network."""
    from safetensors.numpy import load_file

    from specjax.drafters.io import load_drafter

    res = runs("block_selector", (1, 1, 1))
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert losses[-1] < losses[0]
    raw = json.load(open(os.path.join(res.export_dir, "config.json")))
    assert raw["selector_rank"] == 8 and raw["selector_top_k"] == 4
    tensors = load_file(os.path.join(res.export_dir, "model.safetensors"))
    assert tensors["sel_pred"].shape == (320, 8) and tensors["sel_proj"].shape == (32, 8)
    dcfg, params, _ = load_drafter(res.export_dir)
    assert dcfg.selector_rank == 8
    np.testing.assert_array_equal(np.asarray(params["sel_succ"].get_value()),
                                  tensors["sel_succ"])
