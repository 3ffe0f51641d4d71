"""Losslessness at XLA:CPU's default optimisation level.

tests/conftest.py compiles the whole suite at `--xla_backend_optimization_level=0` with
`--xla_cpu_use_fusion_emitters=false` (faster compiles), which users never run. This test
runs this file as a script in a subprocess with those flags stripped from XLA_FLAGS and jax's compilation cache off (the
script does not load conftest, so nothing puts the flag back), and the script checks:

- greedy identity: a learned drafter (kv: KVShot KV-only) with `LoopConfig(kernels="reference")`
  (decode.py's CPU default) emits exactly the autoregressive loop's tokens, on ragged
  prompts and budgets, with its drafts both accepted and rejected;
- one sampled distribution test of tests/drafters/test_lossless_drafters.py (the block drafter
  with context "both", token and block verification, 5 tokens over several rounds).

A second run of the script (`tree-adaptive`, its own test) checks greedy identity the same
way for the two other loops: a draft tree (`LoopConfig(num_drafts=2)`, two drafts of the kv
drafter per step verified as one tree, the accepted path compacted into the caches) and
the adaptive draft length (`GammaSchedule` with the auto policy, decode.py's `--gamma
auto`, on a cost table under which it both drafts and decodes autoregressively).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")  # conftest's
# the adaptive loop's cost table (ms per step at draft lengths 0, 1, 2)
ADAPTIVE_COSTS = (1.0, 1.6, 1.9)


def _greedy_identity(name="kv", num_drafts=1, costs=None):
    """kv (or `name`) against the autoregressive loop, greedy, kernels="reference":
    num_drafts > 1 verifies a draft tree per step; `costs` runs the adaptive schedule
    (auto policy over draft lengths 0..G, this cost table). Returns the acceptance of
    draft 1 per step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from specjax.core.sampling import SamplingParams
    from specjax.decoding import adaptive
    from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop
    from tests.drafters import test_lossless_drafters as tl

    greedy = SamplingParams(temperature=0.0)
    drafter, dparams = tl._drafter(name, greedy)
    g, params = nnx.split(tl._target())
    rng = np.random.default_rng(0)
    B, width = 8, 6
    lens = rng.integers(1, width + 1, B).astype(np.int32)
    toks = rng.integers(0, tl.V, (B, width)).astype(np.int32)
    budgets = rng.integers(4, 13, B).astype(np.int32)
    sched = None if costs is None else adaptive.GammaSchedule(
        adaptive.default_choices(drafter.gamma))
    cfg = LoopConfig(max_length=width + 12, prompt_width=width, sampling=greedy,
                     kernels="reference", num_drafts=num_drafts, schedule=sched)
    args = (jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(budgets), jax.random.key(0))
    ar = autoregressive_loop(g, params, cfg, *args)
    inputs = () if sched is None else (
        {sched.name: {"costs": jnp.asarray(costs, jnp.float32), "alpha0": None}},)
    sp = speculative_loop(g, params, drafter, dparams, cfg, *args, *inputs)
    np.testing.assert_array_equal(np.asarray(sp.lengths), lens + budgets)
    np.testing.assert_array_equal(np.asarray(ar.lengths), lens + budgets)
    for b in range(B):
        n = lens[b] + budgets[b]
        np.testing.assert_array_equal(np.asarray(sp.tokens)[b, :n], np.asarray(ar.tokens)[b, :n])
    if sched is not None:  # the auto policy both drafted and decoded autoregressively
        chosen = np.asarray(sp.ext["adaptive"]["chosen"])
        assert chosen[0] > 0 and chosen[1:].sum() > 0, chosen
        rate = np.asarray(sp.accepted)[:, 0].sum() / np.asarray(sp.reached)[:, 0].sum()
    else:
        rate = np.asarray(sp.accepted)[:, 0].sum() / np.asarray(sp.steps).sum()
    assert 0.05 < rate < 0.95, rate
    kind = ("adaptive, steps per length " + str(chosen.tolist()) if sched is not None
            else f"tree of {num_drafts} drafts" if num_drafts > 1 else "chain")
    print(f"greedy identical to autoregressive ({name}, kernels=reference, {kind}; draft 1 "
          f"accepted in {rate:.2f} of rounds)")
    return rate


def main(part="chain"):
    assert not any(f in os.environ.get("XLA_FLAGS", "") for f in FLAGS), os.environ.get(
        "XLA_FLAGS")
    sys.path.insert(0, ROOT)  # the `tests` package
    t0 = time.time()
    if part == "tree-adaptive":
        _greedy_identity(num_drafts=2)
        t1 = time.time()
        # AR steps cheap enough that a row whose drafts were just rejected decodes
        # autoregressively, and long drafts cheap enough to try at the prior
        _greedy_identity(costs=ADAPTIVE_COSTS)
        print(f"tree and adaptive loops identical; times: tree {t1 - t0:.1f} s, adaptive "
              f"{time.time() - t1:.1f} s")
        return
    _greedy_identity()
    t1 = time.time()
    from tests.drafters import test_lossless_drafters as tl

    tl._assert_lossless("block-both", "both", tl.PLAIN)
    print(f"sampled block-both lossless over {tl.N_NEW} tokens; "
          f"times: greedy {t1 - t0:.1f} s, sampled {time.time() - t1:.1f} s")


def _run_script(*args):
    """This file as a script at XLA's default optimisation level, no compilation cache."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(FLAGS))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env["SPECJAX_TEST_NO_CACHE"] = "1"
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=280)
    print(r.stdout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


@pytest.mark.timeout(300)
def test_lossless_at_default_optimisation_level():
    out = _run_script()
    assert "greedy identical" in out and "sampled block-both lossless" in out, out


@pytest.mark.slow  # the chain loops at the default level run in the default run (above)
@pytest.mark.timeout(300)
def test_tree_and_adaptive_loops_at_default_optimisation_level():
    out = _run_script("tree-adaptive")
    assert "(kv, kernels=reference, tree of 2 drafts;" in out, out
    assert "(kv, kernels=reference, adaptive, steps per length" in out, out
    assert "tree and adaptive loops identical" in out, out


if __name__ == "__main__":
    main(*sys.argv[1:])
