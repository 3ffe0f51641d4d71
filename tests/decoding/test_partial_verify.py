"""SpecPV partial verification (`--partial-verify`, specjax.decoding.partial; LOSSY,
opt-in): the block selection against a numpy loop over the paper code's rule, the mode
switch at the buffer's edge, partial attention equal to full attention when the retrieval
covers every block (logits, and greedy output in the loop), and a small budget that
really verifies partially."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding import partial as pv
from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop


def _select_by_loops(cfg, q, k, win_lo):
    """TanZhendong/SpecPV `refresh_retrieval`, one row, KV head and block at a time in
    float64: score = max(q.k_max, q.k_min), mean over queries, mean over the group's
    query heads; top blocks among sink_blocks <= j, (j + 1) * block <= win_lo, in order."""
    B, Q, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    R, n = N // K, S // cfg.block
    out = np.full((B, K, cfg.retrieval_blocks), -1)
    for b in range(B):
        for kh in range(K):
            scores = {}
            for j in range(cfg.sink_blocks, n):
                if (j + 1) * cfg.block > win_lo[b]:
                    continue
                blk = k[b, kh, j * cfg.block:(j + 1) * cfg.block].astype(np.float64)
                kmax, kmin = blk.max(0), blk.min(0)
                per_head = []
                for r in range(R):
                    qs = q[b, :, kh * R + r].astype(np.float64)
                    per_head.append(np.mean([max(x @ kmax, x @ kmin) for x in qs]))
                scores[j] = np.mean(per_head)
            best = sorted(scores, key=lambda j: -scores[j])[:cfg.retrieval_blocks]
            out[b, kh, :len(best)] = sorted(best)
    return out


@pytest.mark.parametrize("win_lo", [[40, 64], [9, 64], [0, 20]])
def test_block_selection_matches_the_rule(win_lo):
    cfg = pv.PartialVerify(budget=4 * 3 + 8 + 4 * 3, block=4, sink_blocks=3, window=8,
                           buffer=4)  # 3 retrieval blocks
    rng = np.random.default_rng(sum(win_lo))
    B, Q, N, K, S, H = 2, 5, 4, 2, 70, 8
    q = rng.normal(size=(B, Q, N, H)).astype(np.float32)
    k = rng.normal(size=(B, K, S, H)).astype(np.float32)
    got = np.asarray(pv.select_blocks(cfg, jnp.asarray(q), jnp.asarray(k),
                                      jnp.asarray(win_lo, jnp.int32)))
    np.testing.assert_array_equal(got, _select_by_loops(cfg, q, k, np.asarray(win_lo)))


def test_mode_switches_exactly_when_the_buffer_overflows():
    cfg = pv.PartialVerify(budget=64, block=4, sink_blocks=1, window=8, buffer=4)
    G = 3
    th = cfg.threshold_for(G)
    assert th == 64 + 4 and cfg.min_threshold(G) == 8 + 8 + 4 + 4

    def mode(base, verified, active=(True, True)):
        st = pv.init_state(cfg, 1, 2, 1).replace(verified=jnp.asarray(verified, jnp.int32))
        return int(pv.choose_mode(cfg, st, jnp.asarray(base, jnp.int32),
                                  jnp.asarray(active), G))

    assert mode([th - 1, 500], [0, 0]) == pv.PLAIN  # a row below the threshold
    assert mode([th - 1, 500], [0, 497], active=(False, True)) == pv.PARTIAL
    assert mode([th, th], [-(2 ** 30)] * 2) == pv.FULL  # no selection yet
    assert mode([th + cfg.buffer, th], [th, th]) == pv.PARTIAL  # buffer exactly full
    assert mode([th + cfg.buffer + 1, th], [th, th]) == pv.FULL  # one token over
    assert mode([th, th], [0, 0], active=(False, False)) == pv.PLAIN
    with pytest.raises(ValueError, match="no retrieval block"):
        pv.PartialVerify(budget=4 + 8, block=4, sink_blocks=1, window=8)


def _long_prompts(lengths, V, seed=0):
    rs = np.random.RandomState(seed)
    width = max(lengths)
    base = rs.randint(2, V, size=(len(lengths), 7))
    toks = np.tile(base, (1, -(-width // 7)))[:, :width]  # repetitive: drafts get accepted
    noise = rs.rand(*toks.shape) < 0.2
    toks = np.where(noise, rs.randint(2, V, size=toks.shape), toks).astype(np.int32)
    return jnp.asarray(toks), jnp.asarray(lengths, jnp.int32)


# block 4, one sink block, window 8, buffer 4: min threshold 24 at G = 3
COVER_ALL = pv.PartialVerify(budget=4 + 8 + 4 * 40, block=4, sink_blocks=1, window=8,
                             buffer=4, threshold=24)  # 40 retrieval blocks: every block
SMALL = pv.PartialVerify(budget=4 + 8 + 4 * 2, block=4, sink_blocks=1, window=8, buffer=4,
                         threshold=24)  # 2 retrieval blocks


def _run(partial, budgets=(40, 40, 25)):
    from tests.decoding.test_speculative_greedy import V, make_drafter, models

    target, _ = models()
    g, p = nnx.split(target)
    drafter, dparams = make_drafter("draft_lm", 3)
    toks, lens = _long_prompts([48, 33, 41], V)
    cfg = LoopConfig(max_length=48 + 40, prompt_width=48, partial=partial)
    b = jnp.asarray(budgets, jnp.int32)
    spec = speculative_loop(g, p, drafter, dparams, cfg, toks, lens, b, jax.random.key(0))
    ar = autoregressive_loop(g, p, LoopConfig(max_length=48 + 40, prompt_width=48), toks,
                             lens, b, jax.random.key(0))
    return spec, ar


def _rows(res):
    t, n = np.asarray(res.tokens), np.asarray(res.lengths)
    return [t[b, :n[b]].tolist() for b in range(t.shape[0])]


def test_partial_covering_every_block_is_exact_in_the_loop():
    spec, ar = _run(COVER_ALL)
    full, partial = (int(x) for x in spec.ext["partial"]["verified"])
    assert full >= 2 and partial >= 2, spec.ext["partial"]["verified"]  # both modes really ran
    assert _rows(spec) == _rows(ar)


def test_small_budget_verifies_partially_and_counts_steps():
    spec, _ = _run(SMALL)
    full, partial = (int(x) for x in spec.ext["partial"]["verified"])
    assert full >= 1 and partial >= 1
    # every step is plain, full or partial: the counts never exceed the loop's steps
    assert full + partial <= int(np.asarray(spec.steps).max())
    assert all(len(r) > 0 for r in _rows(spec))


def test_partial_logits_equal_full_logits_when_everything_is_covered():
    """One verify forward from the same cache: the partial step's logits (selection made
    by a full step) equal the plain forward's, to f32 rounding."""
    from tests.decoding.test_speculative_greedy import V, models

    target, _ = models()
    B, T0, G = 2, 44, 3
    toks, _ = _long_prompts([T0, T0], V, seed=3)
    cache = target.init_cache(B, T0 + 2 * (G + 1) + 8)
    pos = jnp.broadcast_to(jnp.arange(T0, dtype=jnp.int32), (B, T0))
    cache = target(toks, pos, cache).cache.rewind(jnp.full((B,), T0 - 1, jnp.int32))
    lengths = jnp.full((B,), T0, jnp.int32)  # pending token at slot T0 - 1
    chain = jnp.concatenate([toks[:, -1:], toks[:, 3:3 + G]], axis=1)
    active = jnp.ones((B,), bool)
    st = pv.init_state(COVER_ALL, target.cfg.num_layers, B, target.cfg.num_kv_heads)
    lf, _, cache_f, st = pv.verify_forward(target, COVER_ALL, st, toks, lengths, cache,
                                           chain, active, (), None)
    assert int(st.full) == 1
    plain = target(chain, (lengths - 1)[:, None] + jnp.arange(G + 1)[None], cache)
    np.testing.assert_allclose(np.asarray(lf), np.asarray(plain.logits), atol=2e-4)
    # the next step, from the full step's cache, is partial and still exact
    lengths2 = lengths + 2
    toks2 = jnp.concatenate([toks, chain[:, 1:3]], axis=1)
    cache_f = cache_f.rewind(lengths2 - 1)
    chain2 = jnp.concatenate([chain[:, 2:3], toks[:, 10:10 + G]], axis=1)
    lp, _, _, st2 = pv.verify_forward(target, COVER_ALL, st, toks2, lengths2, cache_f,
                                      chain2, active, (), None)
    assert int(st2.partial) == 1
    plain2 = target(chain2, (lengths2 - 1)[:, None] + jnp.arange(G + 1)[None], cache_f)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(plain2.logits), atol=2e-4)
    # with two retrieval blocks the same step differs (the power check of this test)
    st_small = pv.init_state(SMALL, target.cfg.num_layers, B, target.cfg.num_kv_heads)
    _, _, cache_s, st_small = pv.verify_forward(target, SMALL, st_small, toks, lengths,
                                                cache, chain, active, (), None)
    ls, _, _, _ = pv.verify_forward(target, SMALL, st_small, toks2, lengths2,
                                    cache_s.rewind(lengths2 - 1), chain2, active, (), None)
    assert np.abs(np.asarray(ls) - np.asarray(plain2.logits)).max() > 1e-3


def test_partial_is_refused_for_trees_and_schedules():
    from specjax.decoding.adaptive import GammaSchedule

    with pytest.raises(ValueError, match="one chain"):
        LoopConfig(max_length=8, prompt_width=4, partial=SMALL, num_drafts=2)
    with pytest.raises(ValueError, match="one chain"):
        LoopConfig(max_length=8, prompt_width=4, partial=SMALL,
                   schedule=GammaSchedule((0, 1, 3)))


def test_decode_partial_verify_flags(tiny_demo, tmp_path, capsys):
    import json

    import decode
    from specjax.testing.tiny import save_random_drafter

    tgt = str(tiny_demo / "target")
    learned = save_random_drafter(tgt, str(tmp_path / "eagle3"))
    summary = tmp_path / "s.json"
    common = ["--target", tgt, "--prompts", str(tiny_demo / "prompts.jsonl"),
              "--max-new-tokens", "8", "--show", "0", "--compile-cache", "none"]
    assert decode.main([*common, "--drafter", learned, "--partial-verify",
                        "--partial-budget", "200", "--summary", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert s["lossy"] is True and "gamma_schedule" not in s  # a fixed draft length
    pv_s = s["partial_verify"]
    assert pv_s["budget"] == 200 and pv_s["threshold"] == 220
    assert pv_s["full_steps"] == pv_s["partial_steps"] == 0  # the prompts are short
    assert "ar_agreement" in s and "LOSSY" in capsys.readouterr().out
    for args, needle in ((["--partial-budget", "300"], "goes with --partial-verify"),
                         (["--partial-verify", "--num-drafts", "2"], "one chain"),
                         (["--partial-verify", "--gamma", "auto"], "no --gamma auto"),
                         (["--partial-verify", "--partial-budget", "100"], "no retrieval")):
        capsys.readouterr()
        assert decode.main([*common, "--drafter", learned, *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_long_context_benchmark_render_and_committed_doc():
    """benchmarks/long_context.py's tables say LOSSY where they must; docs/long_context.md
    holds what `--render-only` makes of the committed JSON, when there is one."""
    import json
    import os

    from benchmarks import long_context as lc

    res = {"git": "abc", "date": "d", "cores": 2,
           "quality": {"rows": 1, "row_tokens": 32768, "buckets": [0, 256, 32768],
                       "targets": {"long": {"path": "p", "nll": [1.5, 1.25]}}},
           "speed": {"new_tokens": 8, "runs": [
               {"context": 4096, "system": "AR", "decode_tokens_per_s": 10.0,
                "speedup": 1.0, "identical": True},
               {"context": 4096, "system": "eagle3 partial 1024", "decode_tokens_per_s": 30.0,
                "speedup": 3.0, "identical": False, "tau": 4.5, "full_steps": 2,
                "partial_steps": 5, "prefix_tokens": 6.0, "nll": 0.5,
                "nll_lossless": 0.75}]}}
    q = lc.render_quality(res)
    assert "| long (`p`) | 1.500 | 1.250 |" in q
    res["quality"]["control_by_context"] = {"git": "abc", "nll": {
        "2048": {"long": 1.0}, "8192": {"long": 1.125}}}
    q = lc.render_quality(res)
    assert "--control-contexts 2048 8192" in q
    assert "| long | 1.000 | 1.125 | 1.250 |" in q  # the last column: the full context
    s = lc.render_speed(res)
    assert "LOSSY" in s
    assert ("| 4096 | eagle3 partial 1024 | 30.0 | 3.00x | 4.50 | - | 2 / 5 | NO | 6 | "
            "0.500 (0.750) |") in s
    assert "git abc, d;" in s
    # --merge: a later run of one context keeps the other contexts' rows and their stamps
    old = {**res["speed"], "git": "abc", "date": "d", "contexts": [4096]}
    new = {"new_tokens": 8, "git": "xyz", "date": "e", "contexts": [32000], "runs": [
        {"context": 32000, "system": "AR", "decode_tokens_per_s": 5.0, "speedup": 1.0,
         "identical": True}]}
    merged = lc.merge_speed(old, new)
    assert [r["context"] for r in merged["runs"]] == [4096, 4096, 32000]
    assert merged["contexts"] == [4096, 32000]
    m = lc.render_speed({**res, "speed": merged})
    assert "L = 4096: git abc, d; L = 32000: git xyz, e" in m
    assert lc.merge_speed(merged, {**new, "git": "q"})["runs"][-1]["git"] == "q"  # replaced
    # --systems: a later run of some systems at a context replaces only those rows
    part = {"new_tokens": 8, "git": "w", "date": "f", "contexts": [4096], "runs": [
        {"context": 4096, "system": "AR", "decode_tokens_per_s": 11.0, "speedup": 1.0,
         "identical": True},
        {"context": 4096, "system": "eagle3 W=256", "decode_tokens_per_s": 20.0,
         "speedup": 1.8, "identical": True, "tau": 3.0, "draft_ms": 2.5,
         "verify_ms": 9.0}]}
    both = lc.merge_speed(merged, part)
    assert "| 4096 | eagle3 W=256 | 20.0 | 1.80x | 3.00 | 2.5 / 9.0 | - | yes |" in \
        lc.render_speed({**res, "speed": both})
    both["runs"][1]["timing"] = {"git": "t", "date": "g"}  # --timing-only stamps its rows
    assert "(`Engine.step_timing`; git t, g (`--timing-only`))" in \
        lc.render_speed({**res, "speed": both})
    assert [(r["context"], r["system"], r["git"]) for r in both["runs"]] == [
        (4096, "AR", "w"), (4096, "eagle3 W=256", "w"), (4096, "eagle3 partial 1024", "abc"),
        (32000, "AR", "xyz")]
    assert ("L = 4096 (AR, eagle3 W=256): git w, f; L = 4096 (eagle3 partial 1024): "
            "git abc, d; L = 32000: git xyz, e") in lc.render_speed({**res, "speed": both})
    assert lc.system_settings(["window", "partial"], [1024, 4096]) == [
        ("eagle3", None, 256), ("eagle3", 1024, None), ("eagle3", 4096, None)]
    with pytest.raises(ValueError, match="unknown systems"):
        lc.system_settings(["fast"], [1024])
    if os.path.exists(lc.RESULTS):
        committed = json.load(open(lc.RESULTS))
        doc = open(lc.DOC).read()
        if "quality" in committed:
            assert lc.render_quality(committed) in doc
        if "speed" in committed:
            assert lc.render_speed(committed) in doc


@pytest.mark.parametrize("system", ["AR", "draft_lm", "draft_lm partial"])
def test_run_phases_equals_run(system):
    """`Engine.run_phases` (prefill and decode as two programs, timed apart; what
    benchmarks/long_context.py measures with) produces `run`'s output and counts."""
    from specjax.decoding.engine import Engine
    from tests.decoding.test_speculative_greedy import V, make_drafter, models

    target, _ = models()
    toks, lens = _long_prompts([48, 33], V)
    prompts = [np.asarray(toks[b, :int(lens[b])]).tolist() for b in range(2)]
    kw = dict(max_length=48 + 30, prompt_width=48, batch_size=2)
    if system != "AR":
        drafter, dparams = make_drafter("draft_lm", 3)
        kw.update(drafter=drafter, drafter_params=dparams,
                  partial=SMALL if "partial" in system else None)
    eng = Engine(target, **kw)
    ref = eng.run(prompts, 30, jax.random.key(3))
    out, prefill_s, decode_s = eng.run_phases(prompts, 30, jax.random.key(3))
    assert out.outputs == ref.outputs and prefill_s > 0 and decode_s > 0
    assert out.wall_s == pytest.approx(prefill_s + decode_s)
    np.testing.assert_array_equal(out.steps, ref.steps)
    np.testing.assert_array_equal(out.accepted, ref.accepted)
    if "partial" in system:
        np.testing.assert_array_equal(out.verified, ref.verified)
        assert int(out.verified[1]) >= 1  # partial steps ran
    again, _, _ = eng.run_phases(prompts, 30, jax.random.key(3))  # donated state: reusable
    assert again.outputs == ref.outputs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_drafts", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_step_timing_donates_a_copy_and_leaves_the_engine_usable(num_drafts):
    """`Engine.step_timing` times the proposal, the verify part and the whole step (the
    last two on a donated copy of the state); called twice it measures again, and the
    engine still decodes. Every part is a measured time: positive."""
    from specjax.decoding.engine import Engine
    from tests.decoding.test_speculative_greedy import V, make_drafter, models

    target, _ = models()
    toks, lens = _long_prompts([30], V)
    prompt = np.asarray(toks[0, :30]).tolist()
    drafter, dparams = make_drafter("draft_lm", 3)
    eng = Engine(target, drafter=drafter, drafter_params=dparams, max_length=60,
                 prompt_width=32, batch_size=1, num_drafts=num_drafts)
    for _ in range(2):
        t = eng.step_timing([prompt], 20, jax.random.key(0), repeats=2)
        assert set(t) == {"draft_ms", "verify_ms", "step_ms"}
        assert min(t.values()) > 0  # no order between them: tiny, noisy programs
    assert len(eng.run([prompt], 20, jax.random.key(0)).outputs[0]) == 20


@pytest.mark.timeout(120)
def test_step_timing_measures_each_part(monkeypatch):
    """Each figure of `step_timing` is the wall time of its own part, verify_ms included
    (measured, not the whole step less the draft part, which printed negative on a
    noisy machine): host callbacks put known sleeps into the parts. Quiet: the proposal
    sleeps 40 ms and the rest of the step 80 ms, so draft_ms is 40 ms and not 120,
    verify_ms 80 and not 120, step_ms 120, and draft_ms + verify_ms agrees with it.
    Noisy: the proposal sleeps 100 ms when it runs alone and not at all inside the whole
    step (the machine slow whenever the draft part was timed), so step_ms - draft_ms
    would be -20 ms; verify_ms is still the verify part's 80 ms."""
    import time

    from specjax.decoding import timing
    from specjax.decoding.engine import Engine
    from specjax.decoding.loop.step import Phases
    from tests.decoding.test_speculative_greedy import V, make_drafter, models

    def slept(fn, seconds):
        def wrapped(p, d, s, *rest):
            out = fn(p, d, s, *rest)
            jax.debug.callback(lambda _: time.sleep(seconds), s.lengths)
            return out
        return wrapped

    real = timing.step_phases
    target, _ = models()
    toks, _ = _long_prompts([30], V)
    prompt = np.asarray(toks[0, :30]).tolist()
    drafter, dparams = make_drafter("draft_lm", 3)
    eng = Engine(target, drafter=drafter, drafter_params=dparams, max_length=60,
                 prompt_width=32, batch_size=1)
    for noisy in (False, True):
        def phases(*a, noisy=noisy, **k):
            ph = real(*a, **k)
            alone = slept(ph.propose, 0.1 if noisy else 0.04)
            inside = slept(ph.propose, 0.0 if noisy else 0.04)
            finish = slept(ph.finish, 0.08)

            class Slept(Phases):
                def step(self, p, d, s):
                    return self.finish(p, d, s, inside(p, d, s))

            return Slept(ph.start, alone, finish)

        monkeypatch.setattr(timing, "step_phases", phases)
        t = {k: v / 1e3 for k, v in eng.step_timing([prompt], 20, jax.random.key(0),
                                                      repeats=3).items()}
        slack = 0.035  # the tiny programs themselves, and the load of a shared machine
        assert 0.08 <= t["verify_ms"] < 0.08 + slack, t
        if noisy:
            assert t["draft_ms"] >= 0.1 and 0.08 <= t["step_ms"] < 0.08 + slack, t
        else:
            assert 0.04 <= t["draft_ms"] < 0.04 + slack, t
            assert 0.12 <= t["step_ms"] < 0.12 + slack, t
            assert abs(t["draft_ms"] + t["verify_ms"] - t["step_ms"]) < slack, t
