"""The exact mode (issue 54, part 2): batch-invariant target forwards
(specjax/models/invariant.py, the forward's `invariant_rows`, `LoopConfig(exact=True)`,
decode.py --exact).

- The core claim, at the forward: a verify forward of T tokens gives every token the
  bits (hidden states at every depth, logits, the K/V it writes) that T one-token
  forwards give it, in bf16 and f32; without the mode the same comparison differs on this
  CPU (the test's power: the construction is what makes them equal).
- In the compiled loop: greedy speculative output equals autoregressive output, both
  exact, in bf16 (the oracle drafter accepting every draft, and n-gram), with ragged rows.
- decode.py --exact on a bf16 target: identical to AR, the summary says which guarantee
  the run had; refusals (trees, the attention kernels) are one line.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import decode
from specjax.core.sampling import SamplingParams
from specjax.decoding.engine import Engine
from specjax.decoding.fly import FlyVerify
from specjax.decoding.loop import LoopConfig
from specjax.decoding.options import DecodeConfig
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import SpecjaxError
from specjax.models import invariant
from specjax.models.model import Transformer, decoding_params
from specjax.testing.oracle import OracleDrafter
from specjax.testing.tiny import tiny_config

pytestmark = pytest.mark.timeout(600)

V = 1024


@functools.cache
def _target(dtype):
    cfg = tiny_config(V, num_layers=4, hidden_size=256, intermediate_size=512)
    return Transformer(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _one_vs_block(dtype, exact: bool):
    """(one-token forwards, one T-token forward) over the same prefilled cache:
    hidden [C,B,T,D], logits [B,T,V], cache k [L,B,K,S,H] of each."""
    B, P, T, S = 3, 20, 6, 2 * invariant.CHUNK
    g, params = nnx.split(_target(dtype))
    params = decoding_params(params, "unroll")
    toks = jnp.asarray(np.random.default_rng(1).integers(2, V, (B, P + T)), jnp.int32)
    depths = (1, 2, 3, 4)

    @jax.jit
    def prefill(params):
        m = nnx.merge(g, params)
        return m(toks[:, :P], jnp.broadcast_to(jnp.arange(P), (B, P)), m.init_cache(B, S)).cache

    @jax.jit
    def forward(params, cache, tk, pos):
        out = nnx.merge(g, params)(tk, pos, cache, capture=depths,
                                   invariant_rows=invariant.ROWS if exact else None)
        return out.hidden, out.logits, out.cache

    cache = prefill(params)
    block = forward(params, cache, toks[:, P:], jnp.broadcast_to(P + jnp.arange(T), (B, T)))
    hs, ls, c = [], [], cache
    for i in range(T):
        h, lg, c = forward(params, c, toks[:, P + i:P + i + 1], jnp.full((B, 1), P + i))
        hs.append(h)
        ls.append(lg)
    one = (jnp.concatenate(hs, axis=2), jnp.concatenate(ls, axis=1), c.k)
    return one, (block[0], block[1], block[2].k)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verify_forward_rows_equal_one_token_forwards_bit_for_bit(dtype):
    one, block = _one_vs_block(dtype, exact=True)
    for name, a, b in zip(("hidden", "logits", "cache"), one, block, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    # power: without the mode the same forwards round differently here
    one, block = _one_vs_block(dtype, exact=False)
    assert not np.array_equal(np.asarray(one[1]), np.asarray(block[1]))


def test_attention_needs_whole_chunks():
    k = jnp.zeros((1, 1, invariant.CHUNK + 8, 8))
    from specjax.models.attention import cache_attention

    with pytest.raises(ValueError, match="multiple of"):
        cache_attention(jnp.zeros((1, 1, 2, 8)), k, k, jnp.zeros((1, 2), jnp.int32), rows=8)


def test_exact_loop_speculative_equals_autoregressive_in_bf16():
    target, B, TP, NEW = _target("bfloat16"), 3, 8, 40
    rs = np.random.default_rng(0)
    prompts = [rs.integers(2, V, TP - b).tolist() for b in range(B)]  # ragged rows
    kw = dict(sampling=SamplingParams(temperature=0.0), max_length=TP + NEW,
              prompt_width=TP, batch_size=B, exact=True)
    ar = Engine(target, **kw)
    assert ar.cfg.exact and ar.cfg.kernels == "reference"  # CPU's auto, jnp attention
    want = ar.run(prompts, NEW, jax.random.key(0)).outputs
    d, p = OracleDrafter.create(prompts, want, gamma=5, acceptance=1.0, vocab_size=V)
    got = Engine(target, drafter=d, drafter_params=p, **kw).run(prompts, NEW,
                                                                jax.random.key(1))
    assert got.outputs == want and np.asarray(got.accepted).sum() > 0
    ngram = Engine(target, drafter=NgramDrafter(4, V), drafter_params=(), **kw)
    assert ngram.run(prompts, NEW, jax.random.key(2)).outputs == want


def test_refusals():
    with pytest.raises(ValueError, match="exact=True takes the jnp attention"):
        LoopConfig(max_length=8, prompt_width=4, kernels="attention", exact=True)
    with pytest.raises(ValueError, match="lossy"):
        LoopConfig(max_length=8, prompt_width=4, verify=FlyVerify(), exact=True)
    with pytest.raises(ValueError, match="invariant_rows takes the jnp attention"):
        _target("float32")(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
                           _target("float32").init_cache(1, 64), invariant_rows=8,
                           attention=lambda *a: None)
    for kw, match in ((dict(num_drafts=2), "--exact verifies one chain"),
                      (dict(kernels="pallas"), "--exact takes the jnp attention"),
                      (dict(verify="fly"), "--exact .* lossy")):
        with pytest.raises(SpecjaxError, match=match):
            DecodeConfig(exact=True, **kw)


def test_decode_exact_bf16_is_identical_and_says_so(tiny_demo, tmp_path, capsys):
    summary = tmp_path / "s.json"
    args = ["--target", tiny_demo / "target", "--drafter", tiny_demo / "draft", "--prompts",
            tiny_demo / "prompts.jsonl", "--max-new-tokens", 12, "--gamma", 3,
            "--compile-cache", "none", "--dtype", "bfloat16", "--exact", "--show", 0,
            "--summary", summary]
    assert decode.main([str(a) for a in args]) == 0
    out = capsys.readouterr()
    assert "not guaranteed" not in out.err
    assert "bit-identical by construction" in out.out
    s = json.loads(summary.read_text())
    assert s["exact"] is True and s["ar_identical"] is True
    assert s["ar_identity"] == "bit-identical (--exact)" and s["ar_identity_guaranteed"]
