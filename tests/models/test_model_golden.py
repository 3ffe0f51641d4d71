"""Golden tests: specjax's Transformer against transformers (torch, f32) on tiny random models.

Three configurations cover both families and the shape corners that matter:
  qwen3: tied embeddings, per-head q/k RMSNorm, head_dim H != D/N (D 48, N 4, H 16), GQA 2:1.
  llama: untied LM head, llama3 RoPE scaling (all three frequency bands hit), GQA 4:1.
  qwen3_yarn: qwen3 with YaRN RoPE scaling (its frequency ramp and attention factor).

Weights are re-drawn at O(1) scale (norm weights too) so that every parameter moves the
logits well above the 1e-4 tolerance. Every forward runs through one cached `jax.jit`
per shape (nnx.split once, nnx.merge inside), as the hot loops do.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from specjax.models.checkpoint import load_model  # noqa: E402
from specjax.models.layers import rms_norm  # noqa: E402
from specjax.testing.hf_models import random_hf_model  # noqa: E402

ATOL = 1e-4
VOCAB = 128
SEQ = 40  # long enough that the llama3-scaled low frequencies rotate visibly

CONFIGS = {
    "qwen3": dict(
        cls="Qwen3Config",
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, max_position_embeddings=128,
    ),
    "llama": dict(
        cls="LlamaConfig",
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, intermediate_size=192, rms_norm_eps=1e-5,
        # H 16, theta 5e5: wavelengths 6.3 (< 16: kept), 32 (16..64: smoothed), 167+ (/8).
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False, max_position_embeddings=256,
    ),
    "qwen3_yarn": dict(
        cls="Qwen3Config",
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
        # H 16, theta 1e3, original 1024: beta_fast (32 turns) falls at dim 1.9 and
        # beta_slow (1 turn) at 5.9, so dim 0-1 keep their frequency, 2-5 are on the ramp
        # and 6-7 are divided by 8; attention factor 0.1 ln 8 + 1 = 1.208 on cos and sin.
        rope_parameters={"rope_type": "yarn", "rope_theta": 1_000.0, "factor": 8.0,
                         "original_max_position_embeddings": 1024},
        tie_word_embeddings=True, max_position_embeddings=8192,
    ),
}


def make_hf_model(family: str, seed: int = 0):
    """A tiny random transformers model in f32 eval mode with O(1)-scale weights."""
    model = random_hf_model(CONFIGS[family], seed)
    return model



def hf_forward(hf, tokens):
    """(logits f32[B,T,V], hidden_states list of f32[B,T,D]) from transformers."""
    with torch.no_grad():
        out = hf(torch.as_tensor(np.asarray(tokens), dtype=torch.long), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def jit_forward(model):
    """A jitted `model(tokens, positions, cache, capture=..., logits_at=...)`."""
    graphdef, state = nnx.split(model)

    def fwd(state, tokens, positions, cache, logits_at, capture):
        m = nnx.merge(graphdef, state)
        return m(tokens, positions, cache, capture=capture, logits_at=logits_at)

    fwd_jit = jax.jit(fwd, static_argnums=(5,))

    def call(tokens, positions, cache, *, capture=(), logits_at=None):
        tokens = jnp.asarray(np.asarray(tokens), jnp.int32)
        positions = jnp.asarray(np.asarray(positions), jnp.int32)
        if logits_at is not None:
            logits_at = jnp.asarray(np.asarray(logits_at), jnp.int32)
        return fwd_jit(state, tokens, positions, cache, logits_at, tuple(capture))

    return call


def assert_close(actual, expected, atol=ATOL, what=""):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def golden(request, tmp_path_factory):
    family = request.param
    hf = make_hf_model(family)
    path = tmp_path_factory.mktemp(f"golden-{family}")
    hf.save_pretrained(path)
    model = load_model(str(path), dtype=jnp.float32)
    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, VOCAB, size=(2, SEQ))
    ref_logits, ref_hidden = hf_forward(hf, tokens)
    # Sanity on the fixture itself: logits must be O(1) so 1e-4 is a real bound.
    assert np.std(ref_logits) > 0.3
    return SimpleNamespace(family=family, hf=hf, path=path, model=model, cfg=model.cfg,
                           fwd=jit_forward(model), tokens=tokens, ref_logits=ref_logits,
                           ref_hidden=ref_hidden, rng=rng)


def test_config_matches_hf(golden):
    c, hc = golden.cfg, golden.hf.config
    assert c.family == golden.family.split("_")[0]
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (VOCAB, hc.hidden_size, 3)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert c.tie_word_embeddings == hc.tie_word_embeddings
    assert c.rms_norm_eps == hc.rms_norm_eps
    if c.family == "qwen3":
        assert c.head_dim * c.num_heads != c.hidden_size
    assert (golden.model.lm_head is None) == c.tie_word_embeddings


def test_rope_inv_freq_matches_hf(golden):
    hf_inv = golden.hf.model.rotary_emb.inv_freq.numpy()
    ours = np.asarray(golden.model.inv_freq[...])
    np.testing.assert_allclose(ours, hf_inv, rtol=1e-6, atol=0)
    if golden.family == "llama":
        # The scaling must actually change some frequencies (and keep the highest one).
        c = golden.cfg
        plain = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim))
        assert ours[0] == pytest.approx(plain[0], rel=1e-6)
        assert np.sum(np.abs(ours / plain - 1) > 1e-3) >= 2
        assert ours[-1] == pytest.approx(plain[-1] / 8.0, rel=1e-6)
    if golden.family == "qwen3_yarn":
        c = golden.cfg
        plain = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim))
        ratio = ours / plain
        assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / 8.0)
        assert np.sum((ratio < 0.99) & (ratio > 1 / 8.0 + 1e-3)) >= 2  # the ramp
    # YaRN's attention factor on cos and sin (1 without YaRN)
    assert golden.cfg.attention_scaling == pytest.approx(
        golden.hf.model.rotary_emb.attention_scaling, rel=1e-12)
    assert (golden.cfg.attention_scaling != 1.0) == (golden.family == "qwen3_yarn")


def test_prefill(golden):
    B, T = golden.tokens.shape
    positions = np.broadcast_to(np.arange(T), (B, T))
    out = golden.fwd(golden.tokens, positions, golden.model.init_cache(B, SEQ + 8))
    assert out.logits.dtype == jnp.float32
    assert out.hidden is None
    assert_close(out.logits, golden.ref_logits, what="prefill logits")
    np.testing.assert_array_equal(out.cache.lengths, [T, T])


@pytest.mark.parametrize("attention", ["jnp", "chunked"])
def test_cache_free_forward_at_pose_positions(golden, attention):
    """The training forward (no cache) at PoSE's skip-wise positions, on the jnp mask
    path and with the chunked training attention, against transformers given the same
    position_ids (the positions reach RoPE; the mask stays causal by index)."""
    from specjax.train.kernels import causal_chunked_attention
    from specjax.train.step import pose_positions

    B, T = golden.tokens.shape
    # positions below 256 (f32 RoPE angles of larger ones differ beyond ATOL)
    positions = np.asarray(pose_positions(jax.random.key(5), B, T,
                                          min(golden.cfg.max_position_embeddings, 256)))
    assert (positions[:, -1] >= T).all()  # both rows skip (seed chosen so)
    fn = None if attention == "jnp" else (lambda q, k, v, lim: causal_chunked_attention(
        q, k, v, lim, chunk=16))
    graphdef, state = nnx.split(golden.model)
    logits = jax.jit(lambda st, t, p: nnx.merge(graphdef, st)(t, p, None, self_attention=fn)
                     .logits)(state, jnp.asarray(golden.tokens, jnp.int32),
                              jnp.asarray(positions, jnp.int32))
    with torch.no_grad():
        ref = golden.hf(torch.as_tensor(golden.tokens, dtype=torch.long),
                        position_ids=torch.as_tensor(positions, dtype=torch.long)).logits.numpy()
    assert np.abs(ref - golden.ref_logits).max() > 1e-2  # the skip changes the logits
    assert_close(logits, ref, what=f"pose positions ({attention})")


def test_prefill_logits_at(golden):
    B, T = golden.tokens.shape
    positions = np.broadcast_to(np.arange(T), (B, T))
    at = np.array([[0, 17, T - 1], [T - 1, 3, 3]])
    out = golden.fwd(golden.tokens, positions, golden.model.init_cache(B, T), logits_at=at)
    expected = np.take_along_axis(golden.ref_logits, at[:, :, None], axis=1)
    assert_close(out.logits, expected, what="logits_at")


def test_token_by_token_decode(golden):
    B, T = golden.tokens.shape
    P = 6
    cache = golden.model.init_cache(B, SEQ + 8)
    out = golden.fwd(golden.tokens[:, :P], np.broadcast_to(np.arange(P), (B, P)), cache)
    assert_close(out.logits, golden.ref_logits[:, :P], what="prefix")
    cache = out.cache
    for p in range(P, T):
        out = golden.fwd(golden.tokens[:, p:p + 1], np.full((B, 1), p), cache)
        assert_close(out.logits[:, 0], golden.ref_logits[:, p], what=f"decode step at {p}")
        cache = out.cache
        np.testing.assert_array_equal(cache.lengths, [p + 1] * B)


def test_multi_token_appends(golden):
    B, T = golden.tokens.shape
    cache = golden.model.init_cache(B, SEQ + 8)
    start, chunks = 0, [5, 3, 4, 4, 3, 4, 3, 4, 3, 4, 3]
    assert sum(chunks) == T
    for n in chunks:
        pos = np.broadcast_to(np.arange(start, start + n), (B, n))
        out = golden.fwd(golden.tokens[:, start:start + n], pos, cache)
        assert_close(out.logits, golden.ref_logits[:, start:start + n],
                     what=f"chunk {start}:{start + n}")
        cache = out.cache
        start += n


def test_rewind_and_overwrite(golden):
    """Speculative rejection: stale K/V past the accepted prefix must be overwritten."""
    B, _ = golden.tokens.shape
    P = 20
    cache = golden.model.init_cache(B, SEQ + 8)
    out = golden.fwd(golden.tokens[:, :P], np.broadcast_to(np.arange(P), (B, P)), cache)
    # A 4-token draft at P..P+3 whose first token is right and the rest wrong ...
    draft = golden.tokens[:, P:P + 4].copy()
    draft[:, 1:] = (draft[:, 1:] + 1 + np.arange(3)) % VOCAB
    out = golden.fwd(draft, np.broadcast_to(np.arange(P, P + 4), (B, 4)), out.cache)
    assert_close(out.logits[:, 0], golden.ref_logits[:, P], what="draft first token")
    assert np.max(np.abs(np.asarray(out.logits[:, 2:]) - golden.ref_logits[:, P + 2:P + 4])) > 1e-2
    # ... so one is accepted: rewind to P+1 and feed the true tokens over the stale slots.
    cache = out.cache.rewind(jnp.full((B,), P + 1))
    out = golden.fwd(golden.tokens[:, P + 1:P + 5],
                     np.broadcast_to(np.arange(P + 1, P + 5), (B, 4)), cache)
    assert_close(out.logits, golden.ref_logits[:, P + 1:P + 5], what="after rewind")


def test_ragged_batch(golden):
    """Right-padded rows of different lengths, then per-row decoding at different positions."""
    rng = np.random.default_rng(7)
    lengths = [SEQ, 23, 9]
    steps, chunk = 5, 3
    B, T = len(lengths), SEQ
    seqs = [rng.integers(0, VOCAB, size=n + steps + chunk) for n in lengths]
    refs = [hf_forward(golden.hf, s[None])[0][0] for s in seqs]
    # Padding is random garbage (not a pad id) so that a leak would show.
    tokens = rng.integers(0, VOCAB, size=(B, T))
    for b, n in enumerate(lengths):
        tokens[b, :n] = seqs[b][:n]
    cache = golden.model.init_cache(B, SEQ + steps + chunk + 3)
    out = golden.fwd(tokens, np.broadcast_to(np.arange(T), (B, T)), cache)
    for b, n in enumerate(lengths):
        assert_close(out.logits[b, :n], refs[b][:n], what=f"ragged prefill row {b}")
    cache = out.cache.rewind(jnp.asarray(lengths))
    for i in range(steps):
        pos = np.array([[n + i] for n in lengths])
        tok = np.array([[seqs[b][n + i]] for b, n in enumerate(lengths)])
        out = golden.fwd(tok, pos, cache)
        for b, n in enumerate(lengths):
            assert_close(out.logits[b, 0], refs[b][n + i], what=f"ragged decode row {b} step {i}")
        cache = out.cache
        np.testing.assert_array_equal(cache.lengths, np.asarray(lengths) + i + 1)
    # A multi-token append, every row at its own position.
    pos = np.array([np.arange(n + steps, n + steps + chunk) for n in lengths])
    tok = np.array([seqs[b][n + steps:n + steps + chunk] for b, n in enumerate(lengths)])
    out = golden.fwd(tok, pos, cache)
    for b, n in enumerate(lengths):
        assert_close(out.logits[b], refs[b][n + steps:n + steps + chunk],
                     what=f"ragged append row {b}")


def test_hidden_capture_prefill(golden):
    B, T = golden.tokens.shape
    L = golden.cfg.num_layers
    depths = (0, 1, L - 1, L)
    out = golden.fwd(golden.tokens, np.broadcast_to(np.arange(T), (B, T)),
                     golden.model.init_cache(B, T), capture=depths)
    assert out.hidden.shape == (len(depths), B, T, golden.cfg.hidden_size)
    for i, d in enumerate(depths[:-1]):
        assert_close(out.hidden[i], golden.ref_hidden[d], what=f"hidden depth {d}")
    # HF's last hidden state is after the final norm; ours (depth L) is before it.
    normed = rms_norm(out.hidden[-1], golden.model.final_norm[...], golden.cfg.rms_norm_eps)
    assert_close(normed, golden.ref_hidden[L], what="hidden depth L (normed)")
    # Depths are distinct tensors (the capture really is per depth).
    assert np.max(np.abs(np.asarray(out.hidden[1] - out.hidden[0]))) > 1e-2
    assert_close(out.logits, golden.ref_logits, what="logits with capture")


def test_hidden_capture_order_and_decode(golden):
    B, T = golden.tokens.shape
    L = golden.cfg.num_layers
    P = 30
    cache = golden.model.init_cache(B, T)
    out = golden.fwd(golden.tokens[:, :P], np.broadcast_to(np.arange(P), (B, P)), cache)
    depths = (L - 1, 0, 1)  # returned in the order asked
    out = golden.fwd(golden.tokens[:, P:P + 2], np.broadcast_to(np.arange(P, P + 2), (B, 2)),
                     out.cache, capture=depths)
    for i, d in enumerate(depths):
        assert_close(out.hidden[i], golden.ref_hidden[d][:, P:P + 2],
                     what=f"cached hidden depth {d}")
