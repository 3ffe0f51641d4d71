"""specjax.plan: per-device bytes from configs alone, checked against what jax actually
allocates (sharded arrays on 8 simulated CPU devices, a real KV cache) and against
arithmetic done here; the command line and its one-line errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax import plan
from specjax.testing import hf_configs
from specjax.testing.tiny import tiny_config
from specjax.tools import plan as tool


def _measured_per_device(abstract, mesh_sizes, dtype):
    """Bytes on device 0 after device_put with the training rules' shardings."""
    from specjax.train import mesh as mesh_lib

    mesh = jax.make_mesh(mesh_sizes, mesh_lib.MESH_AXES,
                         axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:int(np.prod(mesh_sizes))])
    arrays = jax.tree.map(lambda a: jnp.zeros(a.shape, dtype), abstract)
    placed = jax.device_put(arrays, mesh_lib.tree_shardings(mesh, arrays))
    dev = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(placed)
               for s in leaf.addressable_shards if s.device == dev)


@pytest.mark.parametrize("sizes", [(1, 1, 1), (2, 1, 4), (1, 2, 4), (1, 1, 8), (8, 1, 1)])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_param_bytes_match_jax_sharding(sizes, kv_heads):
    cfg = tiny_config(320, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=kv_heads,
                      head_dim=8, intermediate_size=96)
    abstract = plan.abstract_target(cfg)
    want = _measured_per_device(abstract, sizes, jnp.bfloat16)
    assert plan.params_bytes_per_device(abstract, plan._Mesh(*sizes), jnp.bfloat16) == want
    from specjax.drafters import DrafterConfig

    for kind in ("eagle3", "kv", "hybrid", "block"):
        d = plan.abstract_drafter(DrafterConfig.for_target(cfg, kind, gamma=3))
        assert plan.params_bytes_per_device(d, plan._Mesh(*sizes), jnp.float32) == \
            _measured_per_device(d, sizes, jnp.float32), kind


def test_one_device_figures_are_the_real_allocations():
    from specjax.models.kv_cache import KVCache
    from specjax.models.model import Transformer

    cfg = tiny_config(320, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=96)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.split(model, nnx.Param, ...)[1]
    got = sum(x.nbytes for x in jax.tree.leaves(params))
    assert plan.weight_bytes(cfg, jnp.float32) == got == cfg.num_params * 4
    cache = KVCache.init(3, 5, 77, 2, 16, jnp.float32)
    assert plan.kv_cache_bytes(3, 5, 2, 77, 16, jnp.float32) == cache.k.nbytes + cache.v.nbytes
    parts = plan.decode_plan(cfg, plan._Mesh(), batch=5, max_length=69, dtype=jnp.float32,
                             gamma=7)
    assert parts["KV cache"] == cache.k.nbytes + cache.v.nbytes  # S = 69 + 7 + 1
    assert parts["target weights"] == got


def test_qwen3_8b_on_8_devices(tmp_path):
    from specjax.models.config import ModelConfig

    cfg = ModelConfig.from_dir(hf_configs.write("Qwen3-8B", str(tmp_path)))
    assert abs(cfg.num_params - 8.19e9) < 0.01e9  # the published size
    parts = plan.decode_plan(cfg, plan._Mesh(model=8), batch=8, max_length=8192,
                             dtype=jnp.bfloat16)
    # every matrix divides by 8: the weights are 1/8 of the model, plus replicated norms
    assert abs(parts["target weights"] - cfg.num_params * 2 / 8) < 2e6
    # K = 8 KV heads over model 8, B 8 rows unsplit: one head per device
    assert parts["KV cache"] == 2 * 36 * 8 * 1 * (8192 + 8) * 128 * 2


def test_cli(tmp_path, capsys):
    d = hf_configs.write("Llama-3.1-70B", str(tmp_path / "llama"))
    code = tool.main(["--config", f"{d}/config.json", "--drafter", "block:kv", "--mesh",
                      "data=1,fsdp=4,model=8", "--train-batch", "64", "--device-memory-gb",
                      "95"])
    out = capsys.readouterr().out
    assert code == 0 and "70.55B parameters" in out and "| **decoding** |" in out
    assert "training (block" in out and "fits" in out
    for bad, needle in ((["--mesh", "data=0"], "--mesh"), (["--batch", "0"], "--batch"),
                        (["--drafter", "medusa"], "medusa")):
        code = tool.main(["--config", d, *bad])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and needle in err, err
    (tmp_path / "bad").mkdir()
    json.dump({"model_type": "gpt2"}, open(tmp_path / "bad" / "config.json", "w"))
    assert tool.main(["--config", str(tmp_path / "bad")]) == 2
