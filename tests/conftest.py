"""Shared fixtures. 8 simulated CPU devices are set before jax is imported, and the
compiler settings that make the suite fast (also inherited by the subprocesses it starts):

- XLA:CPU's LLVM backend at optimisation level 0: about 80% of the suite's time is
  compiling the many small programs of tiny models, and level 0 compiles them about 1.6x
  faster (tests/drafters/test_drafters_decode.py: 185 s -> 113 s); run time of the tiny programs
  hardly matters. Results are the same programs' (no fast-math), and every comparison in
  the suite is between programs compiled alike or against references with tolerances.
- XLA:CPU's older elemental emitters instead of its fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`): the same ops, compiled about 1.5x faster again
  (tests/decoding/test_distribution.py and tests/drafters/test_drafters.py cold: 122 s ->
  83 s, 2026-11-29).
Both are in TEST_XLA_FLAGS; tests/decoding/test_lossless_opt_level.py strips them and
reruns greedy identity and a sampled distribution test as users compile (XLA's defaults).
XLA aborts the process on a flag it does not know, and newer jaxlibs (0.12, Python 3.12's)
dropped the emitters flag: a flag is added only where a subprocess with it runs jax (one
probe per run; the answer is passed to xdist workers in SPECJAX_TEST_XLA_PROBED).
- jax's persistent compilation cache in `.jax_cache/` (gitignored): programs that the
  suite compiles more than once, and every program on a second run, load instead of
  compiling (the same file warm: 37 s). The cache key holds the program, the jax version
  and XLA_FLAGS, so a stale entry is never used; a half-written entry read by the other
  xdist worker fails to decompress and is compiled instead (jax warns). It grows by about
  90 MB per changed set of programs: delete it freely. SPECJAX_TEST_NO_CACHE=1 turns it off
(decode.py's default cache in ~/.cache/specjax/jax too).
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _known_xla_flags(flags) -> tuple[str, ...]:
    """The flags this jaxlib's XLA accepts (a subprocess runs jax with all of them, then
    without the ones it names as unknown)."""
    code = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    flags = list(flags)
    while flags:
        env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True)
        bad = [f for f in flags if r.returncode != 0 and f"Unknown flag in XLA_FLAGS: {f}"
               in r.stderr]
        if not bad:
            break
        flags = [f for f in flags if f not in bad]
    return tuple(flags)


if "SPECJAX_TEST_XLA_PROBED" not in os.environ:  # the controller probes, workers inherit
    _todo = [f for f in TEST_XLA_FLAGS
             if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    if _todo:
        os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                                         *_known_xla_flags(_todo))))
    os.environ["SPECJAX_TEST_XLA_PROBED"] = "1"
if os.environ.get("SPECJAX_TEST_NO_CACHE"):  # decode.py would use ~/.cache/specjax/jax
    os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
else:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory):
    """A random-weight target + draft LM + prompts directory (see specjax.testing.tiny)."""
    from specjax.testing.tiny import make_demo

    d = tmp_path_factory.mktemp("tiny")
    make_demo(str(d), vocab_size=300)
    return d


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop jax's compiled executables after each test module.

    XLA:CPU maps every compiled executable's code into the process; the whole suite in
    one process compiles thousands of programs and reaches the kernel's limit of 65,530
    memory mappings (vm.max_map_count), where the next compilation segfaults. Clearing
    the caches per module keeps the mapping count bounded by the largest module.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
