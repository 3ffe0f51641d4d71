"""The unrolled layer loop (per-layer arrays, fast on XLA:CPU) computes what the scan does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.model import decoding_params
from specjax.testing.models import peaked_model
from specjax.testing.tiny import tiny_config


@pytest.mark.parametrize("family,bias", [("qwen3", False), ("llama", True)])
def test_unrolled_equals_scan(family, bias):
    cfg = tiny_config(vocab_size=64, family=family, hidden_size=32, num_layers=3, head_dim=8,
                      intermediate_size=48, attention_bias=bias)
    model = peaked_model(cfg, seed=3, scale=4.0)
    graphdef, state = nnx.split(model)
    unrolled = decoding_params(state, "unroll")
    assert isinstance(unrolled["q_proj"].get_value(), tuple)
    assert not isinstance(state["q_proj"].get_value(), tuple)  # the model keeps its layout

    @jax.jit
    def fwd(st, toks, pos):
        m = nnx.merge(graphdef, st)
        out = m(toks, pos, m.init_cache(2, 16), capture=(0, 2, 3))
        return out.logits, out.hidden, out.cache.k
    toks = jax.random.randint(jax.random.key(0), (2, 6), 0, 64)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    a, b = fwd(state, toks, pos), fwd(unrolled, toks, pos)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_bad_layer_loop():
    with pytest.raises(ValueError, match="layer_loop"):
        decoding_params({}, "loop")


def test_cache_free_forward_equals_cached():
    """Training's cache-free causal forward computes what the cached forward computes."""
    cfg = tiny_config(vocab_size=64, hidden_size=32, num_layers=2, head_dim=8,
                      intermediate_size=48)
    model = peaked_model(cfg, seed=5, scale=4.0)
    toks = jax.random.randint(jax.random.key(1), (2, 7), 0, 64)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    cached = model(toks, pos, model.init_cache(2, 7), capture=(1,))
    free = model(toks, pos, None, capture=(1,))
    assert free.cache is None
    np.testing.assert_allclose(np.asarray(free.logits), np.asarray(cached.logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(free.hidden), np.asarray(cached.hidden), atol=1e-5)
