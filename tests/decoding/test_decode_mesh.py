"""Decoding on a device mesh (specjax.decoding.sharding, Engine(mesh=...), decode.py --mesh) on 8
simulated CPU devices: greedy output equals one device for meshes (8,1), (2,4), (1,8)
with autoregressive, n-gram and learned drafters; the weights and the KV cache really are
split (and heads are never cut); sampling is reproducible for a seed and mesh."""

import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.decoding.engine import Engine
from specjax.decoding.sharding import cache_sharding, decode_mesh, parse_mesh
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models.model import Transformer
from specjax.testing.tiny import tiny_config

MESHES = ["data=8,model=1", "data=2,model=4", "data=1,model=8"]
G = 3


@functools.cache
def target():
    # N 8, K 4: model=4 splits both; model=8 splits query heads, replicates KV heads.
    cfg = tiny_config(vocab_size=256, num_heads=8, num_kv_heads=4, head_dim=16,
                      hidden_size=128, intermediate_size=256, num_layers=2)
    return Transformer(cfg, rngs=nnx.Rngs(3))


def prompts():
    rng = np.random.RandomState(0)
    lens = [5, 9, 1, 12, 7, 3, 16, 10]
    return [rng.randint(2, 256, size=n).tolist() for n in lens]


def drafter_for(kind):
    t = target()
    if kind == "none":
        return None, None
    if kind == "ngram":
        return NgramDrafter(G, t.cfg.vocab_size), ()
    dcfg = DrafterConfig.for_target(t.cfg, kind, gamma=G,
                                    mask_token_id=1 if kind == "block" else None)
    return make_drafter(dcfg, build_network(dcfg, rngs=nnx.Rngs(1)), t, gamma=G)


def run(kind, mesh_spec, sampling=SamplingParams(), seed=0):
    drafter, dparams = drafter_for(kind)
    mesh = decode_mesh(mesh_spec) if mesh_spec else None
    eng = Engine(target(), drafter=drafter, drafter_params=dparams, sampling=sampling,
                 max_length=48, prompt_width=16, batch_size=8, eos_token_ids=(0,),
                 mesh=mesh)
    return eng, eng.run(prompts(), max_new_tokens=24, key=jax.random.key(seed)).outputs


@functools.cache
def one_device(kind):
    return run(kind, None)[1]


# the default run: every kind on the mixed mesh, the pure data and model meshes once each
# (all twelve in the slow run)
@pytest.mark.parametrize("kind,mesh", [
    pytest.param(kind, mesh, marks=() if j == 1 or i == (0 if j == 0 else 2)
                 else pytest.mark.slow)
    for i, kind in enumerate(["none", "ngram", "eagle3", "block"])
    for j, mesh in enumerate(MESHES)])
def test_greedy_output_equals_one_device(kind, mesh):
    want = one_device(kind)
    _, got = run(kind, mesh)
    assert got == want
    assert all(len(o) > 0 for o in got)


def test_weights_and_cache_are_split_by_the_rules():
    eng, _ = run("ngram", "data=2,model=4")
    specs = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(eng.params):
        name = jax.tree_util.keystr(path).split("'")[1]
        specs.setdefault(name, leaf.sharding.spec)
    # unstacked per-layer weights [out, in]: heads / F over model, D replicated
    assert specs["q_proj"] == jax.sharding.PartitionSpec("model", None)
    assert specs["k_proj"] == jax.sharding.PartitionSpec("model", None)  # K 4 % 4 == 0
    assert specs["gate_proj"] == jax.sharding.PartitionSpec("model", None)
    assert specs["down_proj"] == jax.sharding.PartitionSpec(None, "model")
    assert specs["embed"] == jax.sharding.PartitionSpec("model", None)  # V over model
    want = jax.sharding.PartitionSpec(None, "data", "model", None, None)
    assert eng.cfg.cache_sharding.spec == want
    # the compiled loop exchanges partial sums over the model axis
    assert "all-reduce" in eng.compiled.as_text()


def test_heads_are_replicated_not_cut_when_the_model_axis_does_not_divide_them():
    eng, _ = run("none", "data=1,model=8")
    leaves = dict((jax.tree_util.keystr(p).split("'")[1], x)
                  for p, x in jax.tree_util.tree_leaves_with_path(eng.params))
    assert leaves["q_proj"].sharding.spec == jax.sharding.PartitionSpec("model", None)  # N 8
    assert leaves["k_proj"].sharding.is_fully_replicated  # K 4 on 8: vLLM-style replication
    mesh = decode_mesh("data=1,model=8")
    assert cache_sharding(mesh, (2, 8, 4, 64, 16), 8).is_fully_replicated


@pytest.mark.parametrize("mesh", ["data=2,model=4"])
def test_sampling_is_reproducible_for_a_seed_and_mesh(mesh):
    sp = SamplingParams(temperature=1.0)
    _, a = run("eagle3", mesh, sampling=sp, seed=5)
    _, b = run("eagle3", mesh, sampling=sp, seed=5)
    _, c = run("eagle3", mesh, sampling=sp, seed=6)
    assert a == b and a != c


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == parse_mesh(" model=4 , data=2 ")
    for bad in ("data=0", "model=x", "data=2,data=2", "pipe=2", ""):
        with pytest.raises(Exception, match="--mesh"):
            parse_mesh(bad)


@pytest.mark.parametrize("extra,needle", [
    (["--mesh", "data=3,model=4"], "needs 12 devices"),
    (["--mesh", "data=4,model=2", "--batch-size", "2"], "does not split"),
    (["--mesh", "tensor=2"], "--mesh"),
])
def test_decode_cli_mesh_errors_are_one_line_exit_2(tiny_demo, tmp_path, capsys, extra, needle):
    import decode

    out = tmp_path / "out.jsonl"
    code = decode.main(["--target", str(tiny_demo / "target"), "--drafter", "ngram",
                        "--prompts", str(tiny_demo / "prompts.jsonl"), "--max-new-tokens", "4",
                        "--output", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err
    assert not out.exists()


def test_decode_cli_mesh_runs_and_reports(tiny_demo, tmp_path):
    import decode

    summary = tmp_path / "s.json"
    code = decode.main(["--target", str(tiny_demo / "target"), "--drafter", "ngram",
                        "--prompts", str(tiny_demo / "prompts.jsonl"), "--max-new-tokens", "8",
                        "--batch-size", "4", "--mesh", "data=2,model=4", "--show", "0",
                        "--gamma", "fixed",
                        "--summary", str(summary)])
    s = json.loads(summary.read_text())
    assert code == 0 and s["mesh"] == {"data": 2, "fsdp": 1, "model": 4}
    assert s["ar_identical"] is True


@pytest.mark.parametrize("mesh", MESHES)
def test_memory_planner_matches_the_engines_shards(mesh):
    """specjax.plan's per-device decoding figures (from config.json alone) equal the bytes
    the Engine actually places on device 0 (weights, and the KV cache by its sharding)."""
    from specjax import plan

    eng, _ = run("none", mesh)
    cfg, dev = target().cfg, jax.devices()[0]
    params = {k: v for k, v in eng.params.items() if k != "inv_freq"}  # not a weight
    placed = sum(s.data.nbytes for leaf in jax.tree.leaves(params)
                 for s in leaf.addressable_shards if s.device == dev)
    sizes = parse_mesh(mesh)
    want = plan.decode_plan(cfg, plan._Mesh(sizes.data, sizes.fsdp, sizes.model), batch=8,
                            max_length=48, dtype=jax.numpy.float32, gamma=0)
    assert want["target weights"] == placed
    S = 48 + 0 + 1
    cache = jax.device_put(jax.numpy.zeros((2, 8, 4, S, 16)), eng.cfg.cache_sharding)
    local = sum(s.data.nbytes for s in cache.addressable_shards if s.device == dev)
    assert want["KV cache"] == 2 * local
