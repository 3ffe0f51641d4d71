"""`--draft-window W` (docs/long_context.md): a learned drafter reads only the last W
context positions. The windowed `Limit` against a float64 reference, on the short and
the chunked path (where the chunks below every query's window are not read at all); every
learned kind passes its window to its attention and keeps the loop's greedy output;
decode.py's flag and its errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import attend as attend_lib
from specjax.models.attention import cache_attention_stats


def _reference(q, k, v, pos, lo):
    """float64 attention of q [B,T,N,H] over k, v [B,K,S,H], slots lo..pos per query."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            seen = (np.arange(S) <= pos[b, t]) & (np.arange(S) >= lo[b, t])
            for n in range(N):
                kk, vv = k[b, n // (N // K)], v[b, n // (N // K)]
                s = kk @ q[b, t, n] / np.sqrt(H)
                s = np.where(seen, s, -np.inf)
                p = np.exp(s - s.max())
                out[b, t, n] = (p / p.sum()) @ vv
    return out.reshape(B, T, N * H)


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("window", [1, 5, 23, 1000])
def test_windowed_limit_matches_float64(monkeypatch, chunk, window):
    rng = np.random.default_rng(window)
    B, T, N, K, H, S = 2, 3, 4, 2, 16, 70
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = f(B, T, N, H), f(B, K, S, H), f(B, K, S, H)
    pos = jnp.asarray([[5, 6, 7], [40, 41, 60]], jnp.int32)
    if chunk is not None:
        monkeypatch.setattr(attend_lib, "ATTEND_CHUNK", chunk)
    got = attend_lib.attend(q, [(k, v, attend_lib.windowed(pos, window))])
    lo = np.maximum(np.asarray(pos) - window + 1, 0)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, np.asarray(pos), lo),
                               rtol=1e-4, atol=1e-5)


def test_chunks_below_every_window_are_not_read():
    """NaN in every slot of the chunks below the smallest window start: a chunk read and
    masked would still turn the output into NaN (0 * NaN), so a finite output equal to
    the reference shows the chunks were skipped."""
    rng = np.random.default_rng(0)
    B, Q, K, H, S, chunk = 2, 3, 2, 8, 96, 16
    q = jnp.asarray(rng.normal(size=(B, K, Q, H)), jnp.float32)
    k = rng.normal(size=(B, K, S, H))
    v = rng.normal(size=(B, K, S, H))
    pos = np.array([[70, 71, 72], [80, 81, 90]], np.int32)
    lo = pos - 20  # smallest start 50: chunks 0..2 (slots < 48) lie below every window
    k[:, :, :48], v[:, :, :48] = np.nan, np.nan
    m, l, acc = cache_attention_stats(q, jnp.asarray(k, jnp.float32),
                                      jnp.asarray(v, jnp.float32), jnp.asarray(pos),
                                      chunk=chunk, q_lo=jnp.asarray(lo))
    got = np.asarray(acc / l[..., None])  # [B,K,Q,H]
    assert np.isfinite(got).all()
    want = _reference(np.asarray(q).transpose(0, 2, 1, 3), np.nan_to_num(k),
                      np.nan_to_num(v), pos, lo).reshape(B, Q, K, H).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


KINDS = [("eagle3", None), ("kv", None), ("hybrid", None), ("block", "both")]


@pytest.mark.parametrize("kind,context", KINDS)
def test_windowed_drafters_keep_greedy_output(monkeypatch, kind, context):
    """Every learned kind with a window of 2 passes windowed sources to its attention
    (recorded while tracing) and still decodes exactly the autoregressive output, on the
    chunked path too (ATTEND_CHUNK 8)."""
    from specjax.decoding.loop import LoopConfig, speculative_loop
    from specjax.drafters import block, hybrid, kv, make_drafter
    from specjax.drafters.eagle3 import drafter as e3_drafter
    from specjax.drafters.eagle3 import propose as e3_propose
    from specjax.drafters.eagle3 import trees as e3_trees
    from tests.decoding.test_speculative_greedy import BUDGETS, TP, models, prompts, rows, run_ar
    from tests.drafters.test_drafters_decode import drafter_net

    seen = []

    def spy(real):
        def wrapped(q, sources, *a, **kw):
            seen.extend(m.lo is not None for _, _, m in sources
                        if isinstance(m, attend_lib.Limit))
            return real(q, sources, *a, **kw)
        return wrapped

    for mod in (e3_drafter, e3_propose, e3_trees, hybrid, kv, block):  # every `attend` caller
        monkeypatch.setattr(mod, "attend", spy(mod.attend))
    monkeypatch.setattr(attend_lib, "ATTEND_CHUNK", 8)
    jax.clear_caches()  # retrace: the spy and the chunk act at trace time
    try:
        target, _ = models()
        dcfg, net = drafter_net(kind, context)
        drafter, dparams = make_drafter(dcfg, net, target, gamma=3)
        drafter = dataclasses.replace(drafter, window=2)
        g, p = nnx.split(target)
        cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)
        toks, lens = prompts()
        sp = speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                              jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0))
        assert rows(sp) == rows(run_ar(BUDGETS))
        assert seen and all(seen), seen  # every context source went through the window
    finally:
        jax.clear_caches()


def test_decode_draft_window(tiny_demo, tmp_path, capsys):
    import decode
    from tests.decoding.test_library_api import save_random_drafter

    tgt = str(tiny_demo / "target")
    learned = save_random_drafter(tgt, str(tmp_path / "eagle3"))
    summary = tmp_path / "s.json"
    common = ["--target", tgt, "--prompts", str(tiny_demo / "prompts.jsonl"),
              "--max-new-tokens", "8", "--show", "0", "--compile-cache", "none",
              "--gamma", "fixed"]
    assert decode.main([*common, "--drafter", learned, "--draft-window", "3",
                        "--summary", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert s["draft_window"] == 3 and s["ar_identical"] is True
    for args, needle in ((["--drafter", "ngram", "--draft-window", "3"], "only learned"),
                         (["--drafter", str(tiny_demo / "draft"), "--draft-window", "3"],
                          "only learned"),
                         (["--drafter", learned, "--draft-window", "0"], "must be >= 1")):
        capsys.readouterr()
        assert decode.main([*common, *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_benchmark_render_and_committed_doc(tmp_path):
    """benchmarks/draft_window.py renders its record; docs/long_context.md's table is what
    `--render-only` makes of the committed JSON, when there is one (a figure edited by
    hand fails)."""
    import os

    from benchmarks import draft_window as dw

    rec = {"drafter": "eagle3", "context": 256, "window": None, "gamma": 7, "tau": 5.5,
           "alpha": [0.9, None], "tokens_per_s": 10.0, "ar_tokens_per_s": 5.0,
           "speedup": 2.0, "identical": True, "compile_s": 1.0, "draft_ms": 3.0,
           "verify_ms": 9.0, "step_ms": 12.0}
    res = {"runs": [rec, dict(rec, window=16, tau=4.0)], "prompts": 2, "new_tokens": 8,
           "git": "abc", "date": "d", "cores": 2, "machine": "x", "jax": "0.10.2",
           "weights": ["w"]}
    text = dw.render(res)
    assert "| eagle3 | 256 | all | 5.50 | 0.90 - | 2.00x | 3.00 | 9.00 | yes |" in text
    assert "| eagle3 | 256 | 16 | 4.00 |" in text
    doc = tmp_path / "d.md"
    doc.write_text("# x\n\n<!-- draft_window:results -->\nold\n<!-- /draft_window:results -->\n")
    dw.write_doc(res, str(doc))
    assert "old" not in doc.read_text() and text in doc.read_text()
    if os.path.exists(dw.RESULTS):
        res = json.load(open(dw.RESULTS))
        assert dw.render(res) in open(dw.DOC).read()
        assert all(r["identical"] for r in res["runs"])
