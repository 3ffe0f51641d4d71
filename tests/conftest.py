"""Shared fixtures. 8 simulated CPU devices are set before jax is imported."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
