"""Losslessness at XLA:CPU's default optimisation level.

tests/conftest.py compiles the whole suite at `--xla_backend_optimization_level=0`
(faster compiles), which users never run. This test runs this file as a script in a
subprocess with that flag stripped from XLA_FLAGS and jax's compilation cache off (the
script does not load conftest, so nothing puts the flag back), and the script checks:

- greedy identity: a learned drafter (kv: KVShot KV-only) with `LoopConfig(kernels="reference")`
  (decode.py's CPU default) emits exactly the autoregressive loop's tokens, on ragged
  prompts and budgets, with its drafts both accepted and rejected;
- one sampled distribution test of tests/drafters/test_lossless_drafters.py (the block drafter
  with context "both", token and block verification, 5 tokens over several rounds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAG = "--xla_backend_optimization_level"


def _greedy_identity(name="kv"):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from specjax.core.sampling import SamplingParams
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
    cfg = LoopConfig(max_length=width + 12, prompt_width=width, sampling=greedy,
                     kernels="reference")
    args = (jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(budgets), jax.random.key(0))
    ar = autoregressive_loop(g, params, cfg, *args)
    sp = speculative_loop(g, params, drafter, dparams, cfg, *args)
    np.testing.assert_array_equal(np.asarray(sp.lengths), lens + budgets)
    np.testing.assert_array_equal(np.asarray(ar.lengths), lens + budgets)
    for b in range(B):
        n = lens[b] + budgets[b]
        np.testing.assert_array_equal(np.asarray(sp.tokens)[b, :n], np.asarray(ar.tokens)[b, :n])
    rate = np.asarray(sp.accepted)[:, 0].sum() / np.asarray(sp.steps).sum()
    assert 0.05 < rate < 0.95, rate
    print(f"greedy identical to autoregressive ({name}, kernels=reference; draft 1 "
          f"accepted in {rate:.2f} of rounds)")


def main():
    assert FLAG not in os.environ.get("XLA_FLAGS", ""), os.environ.get("XLA_FLAGS")
    sys.path.insert(0, ROOT)  # the `tests` package
    t0 = time.time()
    _greedy_identity()
    t1 = time.time()
    from tests.drafters import test_lossless_drafters as tl

    tl._assert_lossless("block-both", "both", tl.PLAIN)
    print(f"sampled block-both lossless over {tl.N_NEW} tokens; "
          f"times: greedy {t1 - t0:.1f} s, sampled {time.time() - t1:.1f} s")


def test_lossless_at_default_optimisation_level():
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(FLAG))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env["SPECJAX_TEST_NO_CACHE"] = "1"
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    print(r.stdout)
    assert r.returncode == 0, out[-4000:]
    assert "greedy identical" in r.stdout and "sampled block-both lossless" in r.stdout, out


if __name__ == "__main__":
    main()
