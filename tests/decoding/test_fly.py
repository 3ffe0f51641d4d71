"""FLy loose verification (`--verify fly`, specjax.decoding.fly; LOSSY, opt-in): the
window-and-gate decisions against an independent loop over the authors' rule, the top-3
entropy against numpy, exact greedy output in the degenerate settings (gate closed, no
window fits), a constructed paraphrase that only FLy accepts, and decode.py's flag."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.core.sampling import SamplingParams
from specjax.decoding.fly import FlyVerify, fly_accept, top_k_entropy
from specjax.decoding.loop import LoopConfig


def _rule_by_loops(native, entropy, window, threshold):
    """The authors' rule position by position (AMD-AGI/FLy FLy.py, `enable_fly` and
    `rej_by_entropy`): flip a mismatch at i when i + 1 .. i + window - 1 all match and
    i < G - window; then reject every mismatch whose top-3 entropy is below threshold."""
    B, G = native.shape
    out = native.copy()
    for b in range(B):
        for i in range(G):
            if (not native[b, i] and window <= G and i < G - window
                    and all(native[b, i + d] for d in range(1, window))):
                out[b, i] = True
            if not native[b, i] and entropy[b, i] < threshold:
                out[b, i] = False
    return out


@pytest.mark.parametrize("G,window", [(7, 6), (7, 3), (8, 2), (4, 6), (5, 1), (15, 6)])
def test_window_and_gate_match_the_rule(G, window):
    rng = np.random.default_rng(G * 10 + window)
    native = rng.random((64, G)) < 0.75
    entropy = rng.random((64, G)) * 0.6
    got = np.asarray(fly_accept(jnp.asarray(native), jnp.asarray(entropy, jnp.float32),
                                window, 0.3))
    np.testing.assert_array_equal(got, _rule_by_loops(native, entropy, window, 0.3))


def test_top3_entropy_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)) * 3
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = -np.sort(-p, axis=-1)[:, :3]
    want = -(top * np.log(top)).sum(-1)
    got = np.asarray(top_k_entropy(jnp.asarray(p, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _probs(argmaxes, V=6, sure=False):
    """f32[1,len,V]: argmax at the given ids; flat (top-3 entropy ~1 nat) or peaked."""
    rows = []
    for a in argmaxes:
        row = np.full(V, 0.01 if sure else 0.15)
        row[a] = 1.0 - row.sum() + row[a]
        rows.append(row)
    return jnp.asarray(np.asarray(rows)[None], jnp.float32)


def test_fly_accepts_a_paraphrase_that_greedy_rejects():
    draft = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    p = _probs([5, 2, 3, 4, 0])  # the target disagrees at position 0 only, unsure there
    fly = FlyVerify(window=2, threshold=0.3)
    tau, nxt = fly(draft, None, p, None)
    assert (int(tau[0]), int(nxt[0])) == (4, 0)  # all four drafts, then the bonus
    tau, nxt = FlyVerify(window=2, threshold=math.inf)(draft, None, p, None)
    assert (int(tau[0]), int(nxt[0])) == (0, 5)  # gate closed: greedy's verdict
    tau, _ = fly(draft, None, _probs([5, 2, 3, 4, 0], sure=True), None)
    assert int(tau[0]) == 0  # the target is sure at position 0: rejected
    tau, _ = FlyVerify(window=5)(draft, None, p, None)
    assert int(tau[0]) == 0  # no window fits in G = 4


@pytest.mark.parametrize("fly", [FlyVerify(window=2, threshold=math.inf),
                                 FlyVerify(window=9, threshold=0.0)])
def test_degenerate_fly_is_greedy_in_the_loop(fly):
    """Gate closed (threshold inf) or no window inside G = 5: the loop's output is exactly
    the autoregressive greedy output."""
    from flax import nnx

    from specjax.decoding.loop import speculative_loop
    from tests.decoding.test_speculative_greedy import (
        BUDGETS,
        TP,
        make_drafter,
        models,
        prompts,
        rows,
        run_ar,
    )

    target, _ = models()
    g, p = nnx.split(target)
    drafter, dparams = make_drafter("draft_lm", 5)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, verify=fly)
    toks, lens = prompts()
    res = speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                           jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0))
    assert rows(res) == rows(run_ar(BUDGETS))


def test_fly_is_refused_when_sampling():
    with pytest.raises(ValueError, match="temperature 0"):
        LoopConfig(max_length=8, prompt_width=4, verify=FlyVerify(),
                   sampling=SamplingParams(1.0))
    with pytest.raises(ValueError, match="window"):
        FlyVerify(window=0)


def test_decode_verify_fly(tiny_demo, tmp_path, capsys):
    import decode
    from specjax.testing.tiny import save_random_drafter

    tgt = str(tiny_demo / "target")
    learned = save_random_drafter(tgt, str(tmp_path / "eagle3"))
    summary = tmp_path / "s.json"
    common = ["--target", tgt, "--prompts", str(tiny_demo / "prompts.jsonl"),
              "--max-new-tokens", "8", "--show", "0", "--compile-cache", "none",
              "--gamma", "fixed"]
    assert decode.main([*common, "--drafter", learned, "--verify", "fly",
                        "--fly-window", "2", "--summary", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert s["lossy"] is True and s["verify"] == "fly"
    assert s["fly"] == {"window": 2, "entropy_threshold": 0.3}
    assert set(s["ar_agreement"]) == {"prefix_tokens", "token_agreement", "identical_rows"}
    assert "LOSSY" in capsys.readouterr().out
    for args, needle in ((["--verify", "fly", "--temperature", "1"], "temperature 0"),
                         (["--fly-window", "3"], "go with --verify fly"),
                         (["--verify", "fly", "--num-drafts", "2"], "one chain"),
                         (["--verify", "fly", "--fly-window", "0"], "must be >= 1")):
        capsys.readouterr()
        assert decode.main([*common, "--drafter", learned, *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_benchmark_render_and_committed_doc():
    """benchmarks/fly.py's table says LOSSY; docs/long_context.md holds what
    `--render-only` makes of the committed JSON, when there is one."""
    import os

    from benchmarks import fly as fb

    rec = {"prompts": "bundled", "system": "fly W=3", "window": 3, "threshold": 0.3,
           "tau": 5.0, "alpha": [], "tokens_per_s": 1.0, "ar_tokens_per_s": 1.0,
           "speedup": 1.5, "prefix_tokens": 40.0, "token_agreement": 0.9,
           "identical_rows": 3, "rows": 4, "nll": 0.5, "nll_lossless": 0.4}
    res = {"runs": [rec], "prompts": 4, "new_tokens": 8, "gamma": 7, "git": "abc",
           "date": "d", "cores": 2, "weights": "w"}
    text = fb.render(res)
    assert "LOSSY" in text and "| bundled | fly W=3 | 5.00 | 1.50x | 3/4 | 40.0 | 90.0% |" in text
    if os.path.exists(fb.RESULTS):
        assert fb.render(json.load(open(fb.RESULTS))) in open(fb.DOC).read()
