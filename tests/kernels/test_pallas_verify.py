"""pallas_kernels.verify: the fused verification kernel and its jnp reference.

- The Pallas kernels (interpret mode; the TPU layout under the TPU interpreter with
  NaN-poisoned padding, and the GPU row layout) and the jnp reference return identical
  (tau, next) for the same key, on V not a multiple of the tile, G = 1, bf16 and f32.
- The rule itself is checked against independent references: greedy against
  `specjax.decoding.verify`, the sampled rules' law of (tau, next) against float64 enumeration
  (specjax.testing.distribution.exact_verdict), and through the real speculative loop against the
  target's exact distribution.
- Both layouts lower for TPU (Mosaic) and GPU (Triton) at Qwen3's vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.verify import pick_tile, verify_logits
from specjax.decoding.verify import verify_greedy
from specjax.export import export_for
from specjax.testing import distribution as du

# The TPU interpreter: out-of-bounds reads raise, uninitialised memory (the padding of a
# partial last tile) reads as NaN, so a lane past V that leaked into a result would show.
TPU_INTERPRET = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
IMPLS = {
    "reference": dict(impl="reference"),
    "pallas-tpu": dict(impl="pallas", backend="tpu", interpret=TPU_INTERPRET),
    "pallas-gpu-rows": dict(impl="pallas", backend="triton", interpret=True),
}


def _inputs(B, G, V, seed=0, dtype=jnp.float32, scale=2.0):
    rng = np.random.default_rng(seed)
    tl = rng.normal(size=(B, G + 1, V)) * scale
    dl = rng.normal(size=(B, G, V)) * scale
    x = rng.integers(0, V, (B, G))
    # Make some drafts plausible: the target's argmax at the first positions.
    x[: B // 2, 0] = tl[: B // 2, 0].argmax(-1)
    return (jnp.asarray(tl, dtype), jnp.asarray(dl, dtype), jnp.asarray(x, jnp.int32))


def _draft_kw(mode, dl, temperature):
    if mode == "probs":
        return {"draft_probs": jax.nn.softmax(dl.astype(jnp.float32) / temperature, axis=-1)}
    if mode == "logits":
        return {"draft_logits": dl}
    return {}


@functools.cache
def _jitted(rule, mode, impl_name, temperature, tile):
    kw = IMPLS[impl_name]

    def f(tl, x, key, **dkw):
        return verify_logits(tl, x, key, rule=rule, temperature=temperature, tile=tile,
                             **kw, **dkw)

    return jax.jit(f)


_RULE_MODES = [
    ("greedy", "onehot"), ("token", "probs"), ("token", "logits"), ("token", "onehot"),
    ("block", "probs"), ("block", "logits"), ("block", "onehot")]
_SHAPES = [
    (3, 4, 1000, 256, jnp.float32),  # V not a multiple of the tile
    (2, 1, 300, 128, jnp.bfloat16),  # G = 1, bf16 logits
    (2, 7, 256, 256, jnp.float32),  # one whole tile
]


# the default run: every rule and mode at the first shape, the other shapes on a diagonal
# (each rule and mode meets every shape in the slow run)
@pytest.mark.parametrize("rule,mode,B,G,V,tile,dtype", [
    pytest.param(*rm, *shape, marks=() if j == 0 or i % 3 == j else pytest.mark.slow)
    for j, shape in enumerate(_SHAPES) for i, rm in enumerate(_RULE_MODES)])
def test_kernels_equal_reference(rule, mode, B, G, V, tile, dtype):
    tl, dl, x = _inputs(B, G, V, dtype=dtype)
    results = {}
    for name in IMPLS:
        f = _jitted(rule, mode, name, 0.8, tile)
        outs = [f(tl, x, jax.random.key(k), **_draft_kw(mode, dl, 0.8)) for k in range(3)]
        results[name] = np.array([[np.asarray(o.num_accepted), np.asarray(o.next_token)]
                                  for o in outs])
    ref = results["reference"]
    assert (ref[:, 0] >= 0).all() and (ref[:, 0] <= G).all()
    assert ((ref[:, 1] >= 0) & (ref[:, 1] < V)).all()
    for name, res in results.items():
        np.testing.assert_array_equal(res, ref, err_msg=name)


def test_greedy_matches_specjax_verify():
    """Greedy is deterministic: against specjax.decoding.verify on probabilities, with ties."""
    B, G, V = 16, 5, 700
    rng = np.random.default_rng(3)
    tl = np.round(rng.normal(size=(B, G + 1, V)), 1)  # rounding makes ties likely
    x = tl[:, :G].argmax(-1)
    x[np.arange(B), rng.integers(0, G, B)] = rng.integers(0, V, B)  # one possible miss
    tl, x = jnp.asarray(tl, jnp.float32), jnp.asarray(x, jnp.int32)
    want = verify_greedy(x, None, jax.nn.one_hot(jnp.argmax(tl, -1), V), None)
    for kw in IMPLS.values():
        got = verify_logits(tl, x, jax.random.key(0), rule="greedy", tile=256, **kw)
        np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
        np.testing.assert_array_equal(np.asarray(got.next_token), np.asarray(want.next_token))


@pytest.mark.parametrize("rule", [pytest.param("token", marks=pytest.mark.slow), "block"])
def test_rows_that_accept_nothing_or_everything(rule):
    B, G, V = 4, 3, 500
    tl, dl, x = _inputs(B, G, V, seed=1)
    tl = np.array(tl)
    x = np.array(x)
    # Rows 0-1: the draft equals the target everywhere (q = p): everything is accepted.
    # Rows 2-3: the target gives the first draft token probability 0: nothing is.
    q = np.array(jax.nn.softmax(jnp.asarray(tl[:, :G]), -1))
    tl[2:, 0, x[2:, 0]] = -np.inf
    for name, kw in IMPLS.items():
        for k in range(4):
            v = verify_logits(jnp.asarray(tl), jnp.asarray(x), jax.random.key(k), rule=rule,
                              temperature=1.0, draft_probs=jnp.asarray(q), tile=256, **kw)
            tau, nxt = np.asarray(v.num_accepted), np.asarray(v.next_token)
            assert (tau[:2] == G).all(), (name, tau)
            assert (tau[2:] == 0).all(), (name, tau)
            assert (nxt[2:] != x[2:, 0]).all(), "a probability-0 token was emitted"


# ----------------------------------------------------------------------------- the law


N_LAW = 200_000
UVL = 5  # vocabulary of the exact-law tests


def _law_case(mode, G, seed=0):
    rng = np.random.default_rng(seed)
    T = 0.7
    tl = rng.normal(size=(G + 1, UVL)) * 1.5
    dl = rng.normal(size=(G, UVL)) * 1.5
    tl[1, 2] = -np.inf  # a token the target forbids at position 2
    p = du.np_filtered_probs(tl, T)
    q = du.np_filtered_probs(dl, T) if mode != "onehot" else None
    return T, tl, dl, p, q


@pytest.mark.parametrize("rule,mode,G", [
    ("token", "probs", 2), ("token", "onehot", 3), ("block", "probs", 3),
    ("block", "logits", 2), ("block", "onehot", 3)])
def test_verdict_law_matches_enumeration(rule, mode, G):
    """The empirical law of (tau, next) over N_LAW rows equals the exact law, computed in
    float64 from docs/design.md section 4 by enumerating the drafts (specjax/testing/distribution.py)."""
    T, tl, dl, p, q = _law_case(mode, G)
    rng = np.random.default_rng(1)
    if mode == "onehot":  # a deterministic drafter: always the same draft
        x = np.tile(np.array([0, 3, 1, 4][:G], np.int32), (N_LAW, 1))
        qd = np.eye(UVL)[x[0]]
        law = du.exact_verdict(rule, x[0], qd, p)
    else:
        x = np.stack([du.sample_rows(rng, np.tile(q[i], (N_LAW, 1))) for i in range(G)], 1)
        law = np.zeros((G + 1, UVL))
        for xt in du.all_tuples(G, UVL):
            weight = np.prod(q[np.arange(G), xt])
            if weight > 0:
                law += weight * du.exact_verdict(rule, xt, q, p)
    kw = {"probs": {"draft_probs": jnp.asarray(np.tile(q, (N_LAW, 1, 1)), jnp.float32)},
          "logits": {"draft_logits": jnp.asarray(np.tile(dl, (N_LAW, 1, 1)), jnp.float32)},
          "onehot": {}}[mode]
    tl_b = jnp.asarray(np.tile(tl, (N_LAW, 1, 1)), jnp.float32)
    v = jax.jit(lambda tl, x, k, **d: verify_logits(tl, x, k, rule=rule, temperature=T,
                                                    impl="reference", tile=128, **d))(
        tl_b, jnp.asarray(x), jax.random.key(7), **kw)
    tau, nxt = np.asarray(v.num_accepted), np.asarray(v.next_token)
    emp = np.bincount(tau * UVL + nxt, minlength=law.size) / N_LAW
    stat = du.tv(emp, law.reshape(-1))
    thresh = du.tv_null_quantile(law.reshape(-1), N_LAW, 0.999)
    print(f"\n[fused law] {rule}/{mode} G={G}: TV={stat:.4f} thresh={thresh:.4f}")
    assert abs(law.sum() - 1) < 1e-9
    assert (emp[law.reshape(-1) == 0] == 0).all(), "an impossible (tau, next) was emitted"
    assert stat < thresh, (stat, thresh)


def test_law_test_rejects_a_biased_rule():
    """Power: the same statistic flags token verification judged by block's law."""
    T, tl, dl, p, q = _law_case("probs", 3)
    rng = np.random.default_rng(1)
    x = np.stack([du.sample_rows(rng, np.tile(q[i], (N_LAW, 1))) for i in range(3)], 1)
    law = np.zeros((4, UVL))
    for xt in du.all_tuples(3, UVL):
        law += np.prod(q[np.arange(3), xt]) * du.exact_verdict("block", xt, q, p)
    v = verify_logits(jnp.asarray(np.tile(tl, (N_LAW, 1, 1)), jnp.float32), jnp.asarray(x),
                      jax.random.key(7), rule="token", temperature=T,
                      draft_probs=jnp.asarray(np.tile(q, (N_LAW, 1, 1)), jnp.float32),
                      tile=128)
    emp = np.bincount(np.asarray(v.num_accepted) * UVL + np.asarray(v.next_token),
                      minlength=law.size) / N_LAW
    assert du.tv(emp, law.reshape(-1)) > du.tv_null_quantile(law.reshape(-1), N_LAW, 0.999)


# ----------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "triton")])
def test_lowers_for_tpu_and_gpu_at_qwen3_vocab(platform, backend):
    """Qwen3's V = 151,936 (18.5 tiles of 8192), G = 7, bf16 logits: every rule and
    draft mode lowers (Mosaic tpu_custom_call / Triton), checked without the hardware."""
    B, G, V = 2, 7, 151_936
    spec = jax.ShapeDtypeStruct
    args = (spec((B, G + 1, V), jnp.bfloat16), spec((B, G), jnp.int32),
            spec((B, G, V), jnp.float32))
    marker = "tpu_custom_call" if platform == "tpu" else "triton"
    for rule, mode in [("greedy", "onehot"), ("token", "probs"), ("block", "probs"),
                       ("block", "onehot")]:
        def f(tl, x, dp, rule=rule, mode=mode):
            kw = {"draft_probs": dp} if mode == "probs" else {}
            return verify_logits(tl, x, jax.random.key(0), rule=rule, impl="pallas",
                                 interpret=False, backend=backend, **kw)

        assert marker in export_for(jax.jit(f), platform, *args).mlir_module(), (rule, mode)


def test_bad_arguments_raise():
    tl, dl, x = _inputs(2, 3, 300)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="rule"):
        verify_logits(tl, x, key, rule="typical")
    with pytest.raises(ValueError, match="impl"):
        verify_logits(tl, x, key, impl="cuda")
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_logits(tl, x[:, :2], key)
    with pytest.raises(ValueError, match="not both"):
        verify_logits(tl, x, key, draft_probs=dl, draft_logits=dl)
    with pytest.raises(ValueError, match="multiple of 128"):
        pick_tile(300, 100)
    with pytest.raises(ValueError, match="power of two"):
        pick_tile(3000, 384, backend="triton")
    assert pick_tile(300) == 384 and pick_tile(100) == 128 and pick_tile(151_936) == 8192
    assert pick_tile(300, backend="triton") == 512
