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
