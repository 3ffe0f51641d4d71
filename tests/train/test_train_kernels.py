"""Training with the attention kernel (`train.kernels=pallas`, `train.py --kernels`).

- The drafter objectives (ttt: eagle3; block: block drafter with context both) and
  the lm objective train with `pallas_kernels.attention.packed_attention` (interpret
  mode on CPU) to the same losses, step by step, as with the jnp attention
  (`reference`), and the kernel really runs (a spy counts its traced calls: the frozen
  target's layers and the drafter's context sources).
- On a (2, 2, 2) mesh of simulated devices the kernel runs under shard_map (rows over
  data x fsdp, heads over model) to the single-device losses.
- `auto` resolves to reference on CPU; a bad value is a one-line error.
- The drafter objectives' train steps (ttt: eagle3, kv; block) lower for TPU and GPU
  with the kernels inside (jax.export, abstract shapes at tiny sizes): the forward, dq
  and dk/dv kernels all appear.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.train import kernels as kernels_lib
from specjax.train import load_config, train
from tests.train.test_train import corpus  # noqa: F401  (fixture)
from tests.train.test_train import tiny_cfg as lm_cfg
from tests.train.test_train_drafters import TINY, setup, tiny_args  # noqa: F401  (fixture)

STEPS = 3
SETS = {"eagle3": ["objective=ttt", "drafter.kind=eagle3"],
        "kv": ["objective=ttt", "drafter.kind=kv", "drafter.num_layers=2"],
        "block": ["objective=block", "drafter.kind=block", "drafter.context=both",
                  "drafter.num_anchors=4"]}


def _cfg(setup, run_dir, kind, kernels, mesh=(1, 1, 1)):  # noqa: F811
    args = tiny_args(setup, "eagle3", mesh) + SETS[kind] + [
        f"train.steps={STEPS}", f"train.kernels={kernels}", "export.enabled=false"]
    return load_config(TINY, args, run_dir=str(run_dir))


@pytest.fixture
def spy(monkeypatch):
    """Traced calls of packed_attention (the kernel path): "target" (from the frozen
    target's forward in specjax/models/model.py) or "drafter"."""
    import pallas_kernels.attention as attention

    calls = []
    real = attention.packed_attention

    def counted(q, k, v, limit, **kw):
        import inspect

        files = [f.filename for f in inspect.stack()[1:12]]
        calls.append("target" if any(f.endswith("model.py") for f in files) else "drafter")
        return real(q, k, v, limit, **kw)

    monkeypatch.setattr(attention, "packed_attention", counted)
    return calls


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("block", marks=pytest.mark.slow)])  # kv: as eagle3
def test_drafter_losses_with_kernel_equal_reference(setup, tmp_path, spy, kind):  # noqa: F811
    ref = train(_cfg(setup, tmp_path / "ref", kind, "reference"), progress=False)
    assert not spy
    got = train(_cfg(setup, tmp_path / "pallas", kind, "pallas"), progress=False)
    a = np.array([ref.losses[s] for s in sorted(ref.losses)])
    b = np.array([got.losses[s] for s in sorted(got.losses)])
    assert len(a) == STEPS
    np.testing.assert_allclose(b, a, rtol=2e-4)
    assert {"target", "drafter"} <= set(spy)  # the target's layers and the drafter's context


@pytest.mark.slow
def test_drafter_kernel_on_a_mesh_equals_one_device(setup, tmp_path, spy):  # noqa: F811
    one = train(_cfg(setup, tmp_path / "one", "eagle3", "pallas"), progress=False)
    mesh = train(_cfg(setup, tmp_path / "mesh", "eagle3", "pallas", (2, 2, 2)),
                 progress=False)
    a = np.array([one.losses[s] for s in sorted(one.losses)])
    b = np.array([mesh.losses[s] for s in sorted(mesh.losses)])
    np.testing.assert_allclose(b, a, rtol=2e-5)
    assert spy


def _lm_losses(corpus, tmp_path, kernels):  # noqa: F811
    """The per-step losses of a short lm run with train.kernels=kernels."""
    cfg = lm_cfg(corpus, tmp_path / kernels, (1, 1, 1), f"train.steps={STEPS}",
                 f"train.kernels={kernels}", "export.enabled=false")
    res = train(cfg, progress=False)
    return np.array([res.losses[s] for s in sorted(res.losses)])


def test_lm_objective_with_kernel_equals_reference(corpus, tmp_path, spy):  # noqa: F811
    a = _lm_losses(corpus, tmp_path, "reference")
    b = _lm_losses(corpus, tmp_path, "pallas")
    np.testing.assert_allclose(b, a, rtol=2e-4)
    assert spy


# chunks 1 (21 chunks, 32 s on 2 cores) and 5 are slow; 8 and 40 cover several chunks and
# one partial chunk by default
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(5, marks=pytest.mark.slow), 8, 40])
def test_chunked_attention_equals_the_reference(chunk):
    """"chunked" (any limit) and its causal form against packed_attention_reference:
    outputs, lse and gradients, with a query that sees nothing and a T that is not a
    multiple of the chunk."""
    import jax.numpy as jnp

    from pallas_kernels.attention.packed_reference import packed_attention_reference

    B, T, N, K, H = 2, 21, 4, 2, 8
    ks = jax.random.split(jax.random.key(chunk), 3)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k = jax.random.normal(ks[1], (B, K, T, H))
    v = jax.random.normal(ks[2], (B, K, T, H))
    causal = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
    general = causal.at[0, 3].set(0).at[1, 7].set(2)
    for fn, limit in ((kernels_lib.chunked_attention, general),
                      (kernels_lib.causal_chunked_attention, causal.at[1, 7].set(2))):
        def loss(f, q, k, v, limit=limit):
            o, lse = f(q, k, v, limit)
            return (o ** 2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

        got = fn(q, k, v, limit, chunk=chunk)
        want = packed_attention_reference(q, k, v, limit)
        np.testing.assert_allclose(got[0], want[0], atol=1e-5)
        np.testing.assert_array_equal(np.isfinite(got[1]), np.isfinite(want[1]))
        np.testing.assert_allclose(np.where(np.isfinite(want[1]), got[1], 0),
                                   np.where(np.isfinite(want[1]), want[1], 0), atol=1e-5)
        mine = functools.partial(fn, chunk=chunk)
        g1 = jax.grad(functools.partial(loss, mine), argnums=(0, 1, 2))(q, k, v)
        g2 = jax.grad(functools.partial(loss, packed_attention_reference),
                      argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(g1, g2, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5)


def test_lm_objective_with_chunked_attention_equals_reference(corpus, tmp_path):  # noqa: F811
    a = _lm_losses(corpus, tmp_path, "reference")
    b = _lm_losses(corpus, tmp_path, "chunked")
    np.testing.assert_allclose(b, a, rtol=2e-4)


def test_auto_and_bad_values():
    assert kernels_lib.resolve("auto", "cpu") == "reference"
    assert kernels_lib.resolve("auto", "tpu") == "pallas"
    assert kernels_lib.resolve("auto", "gpu") == "pallas"
    with pytest.raises(SpecjaxError, match="train.kernels"):
        kernels_lib.resolve("fast")
    with pytest.raises(SpecjaxError, match="train.kernels"):
        load_config(TINY, ["train.kernels=fast"])


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "triton")])
@pytest.mark.parametrize("kind", ["eagle3", "kv", "block"])
def test_train_step_lowers_with_kernels(setup, tmp_path, platform, backend, kind):  # noqa: F811
    """The jitted drafter train step (target forward, drafter loss, backward, AdamW) with
    the packed kernel for `platform`, exported from abstract shapes, against a tiny target
    with head_dim 16 (Triton's dots need 16 at least)."""
    from flax import nnx

    from specjax.models.checkpoint import load_tokenizer, save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config

    target = Transformer(tiny_config(320, hidden_size=64, num_layers=4, num_heads=4,
                                     num_kv_heads=2, head_dim=16, intermediate_size=64),
                         rngs=nnx.Rngs(7))
    save_model(target, str(tmp_path / "t16"), tokenizer=load_tokenizer(setup["tokenizer"]))
    setup = {**setup, "target": str(tmp_path / "t16")}
    import jax.numpy as jnp

    from specjax.train import kernels as klib
    from specjax.train import mesh as mesh_lib
    from specjax.train.drafter_run import DrafterRun
    from specjax.train.optim import make_optimizer

    cfg = _cfg(setup, tmp_path / "x", kind, "pallas")
    real = klib.packed_attention_fn
    mp = pytest.MonkeyPatch()
    mp.setattr(klib, "packed_attention_fn",
               lambda mesh=None, **kw: real(mesh, backend=backend, interpret=False))
    try:
        mesh = mesh_lib.make_mesh(cfg.mesh)
        tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
        tr = DrafterRun(cfg, mesh, tx, schedule, jnp.float32).trainer
    finally:
        mp.undo()
    from specjax.export import export_for

    # abstract shapes without the CPU mesh's shardings (one device: nothing to place)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    state = jax.tree.map(spec, tr.abstract_state)
    batch = jax.ShapeDtypeStruct((1, 8, 17), np.int32)
    step = jax.jit(tr._drafter_step)
    exp = export_for(step, platform, state, batch, jax.tree.map(spec, tr.target_params))
    text = exp.mlir_module()
    needle = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    # the target's 4 layers and the drafter forward, plus the drafter's backward kernels
    assert text.count(needle) >= 7, text.count(needle)
    for name in ("packed_attention_fwd", "packed_attention_dq", "packed_attention_dkv"):
        assert name in text, name
