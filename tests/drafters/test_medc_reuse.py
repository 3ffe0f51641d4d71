"""medc's reuse of drafted hidden states (`--draft-reuse`, docs/medc.md): the drafts the
decoding path reads out of the previous step's chain equal the training path's (TTT
unroll) outputs at the positions that the shift maps them to, read with this step's
tokens; rows without reusable entries draft exactly as without reuse; the counts; the
loop's output stays the target's; clear errors for drafters that cannot reuse."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.drafter import LoopView
from specjax.core.sampling import SamplingParams
from specjax.decoding.adaptive import GammaSchedule
from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.drafters import make_drafter
from tests.decoding.test_speculative_greedy import TP, V, models, prompts
from tests.drafters.test_drafters import T1, net_for, reference_q

G = 4


def _setup():
    target, _ = models()
    dcfg, net = net_for("medc", None, scale=8.0)
    drafter, dparams = make_drafter(dcfg, net, target, gamma=G, sampling=T1)
    return target, net, drafter, dparams


def test_reused_drafts_are_the_previous_chain_read_with_new_tokens():
    target, net, plain, dparams = _setup()
    drafter = dataclasses.replace(plain, reuse=True)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, sampling=T1)
    toks, lens = prompts()
    key = jax.random.key(3)
    state, view = _prefill(target, cfg, toks, lens, jnp.full((4,), 20, jnp.int32), key, G,
                           drafter.capture)
    dstate = jax.jit(drafter.init)(dparams, view, key)
    tokens, lengths, cache = state.tokens, state.lengths, state.cache
    B = lengths.shape[0]
    propose, propose_plain = jax.jit(drafter.propose), jax.jit(plain.propose)
    update = jax.jit(drafter.update)
    counts = np.zeros(4, np.int64)
    reused_rows = 0
    prev = None  # (tokens, lengths, draft, accepted, reused rows) of the previous step
    for round_ in range(4):
        view = LoopView(tokens, lengths, cache, None, (lengths - 1)[:, None])
        draft, q, dstate = propose(dparams, dstate, view, jax.random.key(round_))
        draft, q = np.asarray(draft), np.asarray(q)
        fresh = np.asarray(reference_q(net, target, tokens, lengths, jnp.asarray(draft)))
        mine = np.zeros(B, np.int64)
        if prev is not None:
            mine = np.clip((G - 1) - (prev[3] + 1), 0, G - 1)  # previous entries per row
        # the first draft always comes from the target's features
        np.testing.assert_allclose(q[:, 0], fresh[:, 0], atol=2e-5, rtol=1e-4)
        for b in range(B):
            if mine[b] == 0:  # nothing to reuse: exactly the training path
                np.testing.assert_allclose(q[b], fresh[b], atol=2e-5, rtol=1e-4)
                continue
            if prev[4][b] > 0:  # the previous chain itself began from reused entries:
                continue  # the training path no longer describes it
            reused_rows += 1
            # Draft j+2 reads the previous step's entry at its position (the previous
            # chain's depth a+2+j) with this step's draft j+1. medc's chain reads no
            # token, so the training path on the previous step's rows with this step's
            # drafts written in at those positions gives exactly that readout.
            a = prev[3][b]
            old = prev[2].copy()
            old[b, a + 1:a + 1 + mine[b]] = draft[b, :mine[b]]
            want = np.asarray(reference_q(net, target, prev[0], prev[1], jnp.asarray(old)))
            np.testing.assert_allclose(q[b, 1:1 + mine[b]], want[b, a + 2:a + 2 + mine[b]],
                                       atol=2e-5, rtol=1e-4)
            # power: the plain drafter's proposal differs where reuse took effect
            _, q_plain, _ = propose_plain(dparams, dstate, view, jax.random.key(round_))
            assert np.abs(np.asarray(q_plain)[b, 1] - q[b, 1]).max() > 1e-3
        if prev is not None:
            counts += [mine.sum(), B * (G - 1), mine.min(), G - 1]
        else:
            counts += [0, B * (G - 1), 0, G - 1]
        np.testing.assert_array_equal(np.asarray(dstate.chain.counts), counts)
        # a verification with 0..G accepted drafts per row, then a correction token
        pos = (lengths - 1)[:, None] + jnp.arange(G + 1)[None, :]
        pending = jnp.take_along_axis(tokens, pos[:, :1], axis=1)
        out = target(jnp.concatenate([pending, draft], 1), pos, cache,
                     capture=drafter.capture)
        n_acc = np.asarray([(b + round_) % 3 for b in range(B)], np.int32)  # 0, 1, 2
        fix = (draft[:, 0] + 5) % V
        cand = np.concatenate([draft, np.zeros((B, 1), np.int32)], axis=1)
        off = np.arange(G + 1)[None, :]
        cand = np.where(off == n_acc[:, None], fix[:, None], cand)
        write = np.where(off <= n_acc[:, None], np.asarray(lengths)[:, None] + off,
                         tokens.shape[1])
        tokens = tokens.at[jnp.arange(B)[:, None], write].set(cand, mode="drop")
        lengths = lengths + n_acc + 1
        cache = out.cache.rewind(lengths - 1)
        dstate = update(dparams, dstate, LoopView(tokens, lengths, cache, out.hidden, pos),
                        jnp.asarray(n_acc))
        prev = (view.tokens, view.lengths, draft, n_acc, mine)
    assert reused_rows >= 4


def _loop(drafter, dparams, sched=None, batch=3, new=24):
    target, _ = models()
    g, params = nnx.split(target)
    cfg = LoopConfig(max_length=TP + new, prompt_width=TP, schedule=sched)
    toks, lens = prompts()
    args = (toks[:batch], lens[:batch], jnp.full((batch,), new, jnp.int32),
            jax.random.key(0))
    spec = speculative_loop(g, params, drafter, dparams, cfg, *args)
    ar = autoregressive_loop(g, params, cfg, *args)
    return spec, ar


@pytest.mark.parametrize("sched", [None, GammaSchedule((0, 2, G), policy="random")],
                         ids=["fixed", "random-schedule"])
def test_greedy_output_is_the_target_with_reuse(sched):
    _, _, plain, dparams = _setup()
    drafter = dataclasses.replace(plain, sampling=SamplingParams(), reuse=True)
    spec, ar = _loop(drafter, dparams, sched)
    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(ar.lengths))
    for b, n in enumerate(np.asarray(ar.lengths)):
        np.testing.assert_array_equal(np.asarray(spec.tokens)[b, :n], np.asarray(ar.tokens)[b, :n])
    reused, drafted, skipped, forwards = (int(x) for x in spec.drafter["reused"])
    assert 0 < reused < drafted and 0 <= skipped < forwards, spec.drafter
    if sched is not None:
        assert (np.asarray(spec.ext["adaptive"]["chosen"])[1:] > 0).all(), spec.ext  # both lengths ran


def test_decode_draft_reuse(tiny_demo, tmp_path, capsys):
    """decode.py --draft-reuse: a medc drafter keeps greedy output and reports what it
    reused; any other drafter gets a one-line error and exit code 2."""
    import json

    import decode
    from specjax.testing.tiny import save_random_drafter

    tgt = str(tiny_demo / "target")
    medc = save_random_drafter(tgt, str(tmp_path / "medc"), kind="medc", gamma=4)
    eagle3 = save_random_drafter(tgt, str(tmp_path / "eagle3"))
    summary = tmp_path / "s.json"
    common = ["--target", tgt, "--prompts", str(tiny_demo / "prompts.jsonl"),
              "--max-new-tokens", "8", "--show", "0", "--compile-cache", "none",
              "--gamma", "fixed"]
    assert decode.main([*common, "--drafter", medc, "--draft-reuse",
                        "--summary", str(summary)]) == 0
    s = json.loads(summary.read_text())
    r = s["draft_reuse"]
    assert s["ar_identical"] is True and r["states_drafted"] > 0, s
    assert 0 <= r["states_reused"] <= r["states_drafted"] and 0 <= r["fraction"] <= 1, r
    for args, needle in ((["--drafter", "ngram"], "only medc"),
                         (["--drafter", eagle3], "only medc"),
                         (["--drafter", str(tiny_demo / "draft")], "only medc"),
                         (["--drafter", medc, "--tree-topk", "2", "--tree-nodes", "5"],
                          "no --num-drafts or --tree-topk"),
                         (["--drafter", medc, "--num-drafts", "2"],
                          "no --num-drafts or --tree-topk")):
        capsys.readouterr()
        assert decode.main([*common, *args, "--draft-reuse"]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
