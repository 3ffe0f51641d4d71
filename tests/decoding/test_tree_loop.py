"""Draft trees in the loop (issue 30): the tree-masked verify forward, the compaction of
the accepted path, greedy identity with autoregressive decoding for K drafts per step,
and decode.py --num-drafts. The exact-distribution tests of trees at T > 0 are in
tests/drafters/test_lossless_drafters.py (test_draft_trees_are_lossless); the tree rules alone in
tests/decoding/test_tree_verify.py."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import decode
from specjax.core.tree import DraftTree, ancestor_mask, chain_tree, tree_from_drafts
from specjax.decoding.loop import LoopConfig, compact_path, speculative_loop
from specjax.decoding.loop import step as loop_step
from specjax.models.kv_cache import KVCache
from tests.decoding import test_speculative_greedy as sg


def _random_tree(rs, B, N):
    parents = np.full((B, N), -1, np.int32)
    depths = np.zeros((B, N), np.int32)
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = rs.randint(0, i)
            depths[b, i] = depths[b, parents[b, i]] + 1
    valid = np.ones((B, N), bool)
    valid[0, -1] = False  # an unused node
    parents[0, -1], depths[0, -1] = -1, 0
    return DraftTree(tokens=jnp.asarray(rs.randint(0, sg.V, (B, N)), jnp.int32),
                     parents=jnp.asarray(parents), depths=jnp.asarray(depths),
                     valid=jnp.asarray(valid))


def test_ancestor_mask_against_a_walk():
    rs = np.random.RandomState(0)
    tree = _random_tree(rs, 3, 9)
    mask = np.asarray(ancestor_mask(tree, int(np.asarray(tree.depths).max())))
    parents, valid = np.asarray(tree.parents), np.asarray(tree.valid)
    for b in range(3):
        for i in range(9):
            want = np.zeros(9, bool)
            want[i] = True
            j = parents[b, i]
            while valid[b, i] and j >= 0:
                want[j] = True
                j = parents[b, j]
            np.testing.assert_array_equal(mask[b, i], want, err_msg=f"row {b} node {i}")
    chain = chain_tree(jnp.zeros((2,), jnp.int32), jnp.ones((2, 4), jnp.int32))
    np.testing.assert_array_equal(np.asarray(ancestor_mask(chain, 4))[0],
                                  np.tril(np.ones((5, 5), bool)))


def test_tree_forward_equals_each_path_as_a_chain():
    """The tree-masked forward gives every node the logits of its root-to-node path fed
    as a chain after the same prefix (an independent computation: the causal forward)."""
    target, _ = sg.models()
    rs = np.random.RandomState(1)
    B, P = 2, 6
    prompt = jnp.asarray(rs.randint(0, sg.V, (B, P)), jnp.int32)
    cache = target(prompt[:, :P - 1], jnp.broadcast_to(jnp.arange(P - 1), (B, P - 1)),
                   target.init_cache(B, 32)).cache
    tree = _random_tree(rs, B, 7)
    tree = tree.replace(tokens=tree.tokens.at[:, 0].set(prompt[:, P - 1]))
    G = int(np.asarray(tree.depths).max())
    out = target(tree.tokens, (P - 1) + tree.depths, cache, tree_mask=ancestor_mask(tree, G))
    parents, valid = np.asarray(tree.parents), np.asarray(tree.valid)
    for b in range(B):
        for i in range(7):
            if not valid[b, i]:
                continue
            path = [i]
            while parents[b, path[-1]] >= 0:
                path.append(parents[b, path[-1]])
            path = path[::-1]
            toks = tree.tokens[b:b + 1, jnp.asarray(path)]
            pos = jnp.arange(P - 1, P - 1 + len(path))[None]
            row = KVCache(cache.k[:, b:b + 1], cache.v[:, b:b + 1], cache.lengths[b:b + 1])
            ref = target(toks, pos, row).logits[0, -1]
            np.testing.assert_allclose(np.asarray(out.logits[b, i]), np.asarray(ref),
                                       atol=2e-5, rtol=1e-5)


def test_compact_path_moves_the_accepted_entries():
    rs = np.random.RandomState(2)
    L, B, K, S, H = 2, 3, 2, 16, 4
    k = rs.randn(L, B, K, S, H).astype(np.float32)
    v = rs.randn(L, B, K, S, H).astype(np.float32)
    base = np.array([3, 5, 1], np.int32)
    path = np.array([[0, 2, 5, 5], [0, 1, 3, 4], [0, 4, 6, 6]], np.int32)
    out = compact_path(KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(base)),
                       jnp.asarray(base), jnp.asarray(path))
    want_k, want_v = k.copy(), v.copy()
    for b in range(B):
        for j in range(4):
            want_k[:, b, :, base[b] + j] = k[:, b, :, base[b] + path[b, j]]
            want_v[:, b, :, base[b] + j] = v[:, b, :, base[b] + path[b, j]]
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)


def _tree_run(kind, K, G=3, budgets=sg.BUDGETS):
    target, _ = sg.models()
    g, p = nnx.split(target)
    drafter, dparams = sg.make_drafter(kind, G)
    cfg = LoopConfig(max_length=sg.TP + 24, prompt_width=sg.TP, num_drafts=K)
    toks, lens = sg.prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


@pytest.mark.parametrize("kind,K", [("draft_lm", 2),
                                    pytest.param("draft_lm", 4, marks=pytest.mark.slow),
                                    ("ngram", 3)])
def test_greedy_tree_equals_autoregressive(kind, K):
    res = _tree_run(kind, K)
    assert sg.rows(res) == sg.rows(sg.run_ar(sg.BUDGETS))
    if kind == "draft_lm":  # more drafts: at least as many accepted tokens as one chain
        chain = sg.run_spec(kind, 3, sg.BUDGETS)
        assert np.asarray(res.accepted).sum() >= np.asarray(chain.accepted).sum()


def test_without_compaction_greedy_output_breaks(monkeypatch):
    """Power: if the accepted path's K/V stay where the tree put them, later tokens
    attend to the wrong entries and the output leaves the autoregressive one."""
    monkeypatch.setattr(loop_step, "compact_path", lambda cache, base, path: cache)
    jax.clear_caches()
    try:
        res = _tree_run("draft_lm", 4)
        assert sg.rows(res) != sg.rows(sg.run_ar(sg.BUDGETS))
    finally:
        jax.clear_caches()


def test_tree_from_drafts_layout():
    drafts = jnp.arange(6, dtype=jnp.int32).reshape(1, 3, 2)
    tree = tree_from_drafts(jnp.array([7]), drafts)
    assert tree.num_nodes == 7
    np.testing.assert_array_equal(np.asarray(tree.parents[0]), [-1, 0, 1, 0, 3, 0, 5])
    np.testing.assert_array_equal(np.asarray(tree.depths[0]), [0, 1, 2, 1, 2, 1, 2])
    np.testing.assert_array_equal(np.asarray(tree.tokens[0]), [7, 0, 1, 2, 3, 4, 5])


@pytest.mark.timeout(180)
def test_decode_cli_num_drafts_equals_ar(tiny_demo, tmp_path, capsys):
    args = ["--target", tiny_demo / "target", "--drafter", tiny_demo / "draft", "--prompts",
            tiny_demo / "prompts.jsonl", "--max-new-tokens", 10, "--num-drafts", 3,
            "--gamma", 3, "--batch-size", 2, "--summary", tmp_path / "s.json",
            "--step-timing"]
    code = decode.main([str(a) for a in args])
    out = capsys.readouterr().out
    assert code == 0
    s = json.load(open(tmp_path / "s.json"))
    assert s["ar_identical"] is True
    assert s["num_drafts"] == 3 and s["nodes_per_step"] == 10
    assert "drafts x nodes/step" in out
    # three measured times (tests/decoding/test_partial_verify.py checks what each one
    # times), each positive, and the printed line shows the summary's two parts
    assert min(s["draft_ms"], s["verify_ms"], s["step_ms"]) > 0  # no order: noisy
    assert re.search(rf"draft / verify ms per step +{s['draft_ms']:.1f} / "
                     rf"{s['verify_ms']:.1f} \(outside the loop\)", out), out


@pytest.mark.parametrize("extra,expect", [
    (["--num-drafts", 0], "--num-drafts=0"),
    (["--num-drafts", 2, "--drafter", "none"], "--num-drafts needs a drafter"),
])
def test_decode_cli_bad_num_drafts(tiny_demo, tmp_path, capsys, extra, expect):
    args = ["--target", tiny_demo / "target", "--prompts", tiny_demo / "prompts.jsonl",
            "--drafter", tiny_demo / "draft", *extra]
    code = decode.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and expect in err and err.count("\n") == 1


def test_tree_loop_with_pallas_attention_equals_autoregressive():
    """kernels="pallas": the tree-masked verify forward runs the decode_attention kernel's
    tree mode (interpret mode on CPU) and the output stays the autoregressive one."""
    target, _ = sg.models()
    g, p = nnx.split(target)
    drafter, dparams = sg.make_drafter("draft_lm", 2)
    cfg = LoopConfig(max_length=sg.TP + 8, prompt_width=sg.TP, num_drafts=2, kernels="pallas")
    toks, lens = sg.prompts()
    budgets = [8, 5, 3, 1]
    res = speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                           jnp.asarray(budgets, jnp.int32), jax.random.key(0))
    assert sg.rows(res) == sg.rows(sg.run_ar(budgets))


@pytest.mark.parametrize("extra,expect", [
    (["--tree-topk", 2], "--tree-topk and --tree-nodes go together"),
    (["--tree-topk", 2, "--tree-nodes", 5, "--num-drafts", 2], "two kinds of tree"),
    (["--tree-topk", 2, "--tree-nodes", 5, "--temperature", 1], "--verify token"),
    (["--tree-topk", 2, "--tree-nodes", 5, "--drafter", "ngram"], "no dynamic draft tree"),
    (["--tree-nodes", 5], "--tree-nodes alone"),
    (["--drafter", "logitspec", "--temperature", 1], "pass --verify token"),
    (["--drafter", "logitspec", "--num-drafts", 2], "builds its own draft tree"),
])
def test_decode_cli_bad_tree_flags(tiny_demo, tmp_path, capsys, extra, expect):
    args = ["--target", tiny_demo / "target", "--prompts", tiny_demo / "prompts.jsonl",
            "--drafter", tiny_demo / "draft", "--summary", tmp_path / "s.json", *extra]
    code = decode.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and expect in err and err.count("\n") == 1, err
    assert not (tmp_path / "s.json").exists()


def test_decode_cli_logitspec_node_budget(tiny_demo, tmp_path, capsys):
    args = ["--target", tiny_demo / "target", "--prompts", tiny_demo / "prompts.jsonl",
            "--drafter", "logitspec", "--tree-nodes", 6, "--max-new-tokens", 8, "--gamma", "fixed",
            "--summary", tmp_path / "s.json"]
    assert decode.main([str(a) for a in args]) == 0
    s = json.load(open(tmp_path / "s.json"))
    assert s["nodes_per_step"] == 6 and s["ar_identical"] is True
