"""DSpark heads (SpecForge `DSparkDraftModel`, `specforge/modeling/draft/dspark.py`) and
DSpark's two heads as block drafter options (`specjax.drafters.markov`).

A tiny random head written in SpecForge's format (config.json with `dflash_config:
{projector_type: "dspark", markov_rank, markov_head_type, enable_confidence_head,
confidence_head_with_markov}`, the Markov and confidence tensors under SpecForge's names)
is loaded by specjax and checked at every draft slot against a float64 torch forward
written here from the producer's code: the DFlash backbone (SpecForge's
`Qwen3DFlashAttention` / `DFlashDraftModel.forward` compute what z-lab's do, so
`tests.drafters.test_dflash2.reference` serves), the anchor slot drafting too (SpecForge's
trainer labels slot k with the token at anchor + k + 1), the Markov heads' logits along a
given chain (`VanillaMarkovHead` / `GatedMarkovHead` / `RNNMarkovHead.sample_block_tokens`,
predecessor of the first draft the anchor token), the greedy chain, and the confidence
head (`predict_confidence`). Also: greedy decoding identical to autoregressive decoding,
sampled decoding exact in distribution with a power check, train.py training the heads,
the export back to SpecForge's layout, and one-line errors."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.drafters import DrafterConfig, build_network, make_drafter, markov
from specjax.drafters.external import detect_layout, load_external, read_external
from specjax.errors import SpecjaxError
from tests.decoding.test_speculative_greedy import BUDGETS, PROMPT_LENS, TP, prompts, rows
from tests.drafters.test_dflash2 import reference, train_setup  # noqa: F401 (a fixture)
from tests.drafters.test_external_drafters import (
    CFG4,
    DFLASH_IDS,
    MASK,
    D,
    V,
    _rand,
    ar_rows,
    dflash_tensors,
    target,
    write_dir,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(600)

RANK, BLOCK = 8, 4  # markov_rank; block_size (G = 4 drafts with the anchor slot drafting)

# SpecForge's state-dict names of DSpark's heads (nn.Embedding / nn.Linear weights)
MARKOV_NAMES = {"vanilla": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}}
MARKOV_NAMES["gated"] = MARKOV_NAMES["vanilla"] | {"markov_head.gate_proj.weight",
                                                   "markov_head.gate_proj.bias"}
MARKOV_NAMES["rnn"] = MARKOV_NAMES["vanilla"] | {"markov_head.joint_proj.weight",
                                                 "markov_head.joint_proj.bias"}
CONF_NAMES = {"confidence_head.proj.weight", "confidence_head.proj.bias"}


# ----------------------------------------------------------------------------- writer

def head(kind="vanilla", with_markov=True, confidence=True, anchor=None, legacy=False,
         seed=0, rank=RANK):
    """(tensors, config) of a tiny DSpark head in SpecForge's format (qwen3-8b-dspark.json's
    keys). anchor: None (no `sample_from_anchor` key: DSpark's default, the anchor slot
    drafts) or a value to write; legacy: the heads under early checkpoints'
    `logit_head.` prefix."""
    t, cfg = dflash_tensors(seed)
    rs = np.random.RandomState(seed + 200)
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["dflash_config"].update(projector_type="dspark", attention_mode="gqa",
                                markov_rank=rank, markov_head_type=kind,
                                enable_confidence_head=confidence,
                                confidence_head_with_markov=with_markov,
                                confidence_head_alpha=1.0)
    if anchor is not None:
        cfg["dflash_config"]["sample_from_anchor"] = anchor
    if rank:
        t["markov_head.markov_w1.weight"] = _rand(rs, V, rank, scale=1.0)
        t["markov_head.markov_w2.weight"] = _rand(rs, V, rank, scale=0.6)
    if kind == "gated" and rank:
        t["markov_head.gate_proj.weight"] = _rand(rs, rank, D + rank, scale=0.5)
        t["markov_head.gate_proj.bias"] = _rand(rs, rank, scale=0.5)
    if kind == "rnn" and rank:
        t["markov_head.joint_proj.weight"] = _rand(rs, 3 * rank, 2 * rank + D, scale=0.5)
        t["markov_head.joint_proj.bias"] = _rand(rs, 3 * rank, scale=0.5)
    if confidence:
        t["confidence_head.proj.weight"] = _rand(rs, 1, D + (rank if with_markov else 0))
        t["confidence_head.proj.bias"] = _rand(rs, 1)
    if legacy:
        t = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
             for k, v in t.items()}
    return t, cfg


# ----------------------------------------------------------------------------- reference

def _t(x):
    return torch.as_tensor(np.asarray(x, np.float64))


def reference_heads(t, cfg, hidden, base, pending, chain=None):
    """SpecForge's Markov head along a chain, float64: `sample_block_tokens` (its
    `apply_step_logits` per position, the rnn state carried along the block) with the
    predecessor of position 0 the anchor (pending) token and of position k the chain's
    token k-1, and `predict_confidence` on those predecessors.

    hidden [G,D], base [G,V]: the backbone's final-normed outputs and logits at the G
    draft slots. chain: the tokens to condition on (None: the greedy chain, each position's
    argmax). Returns (corrected logits [G,V], confidence logits [G], chain, smallest gap
    between a position's best and second-best corrected logit)."""
    dc = cfg["dflash_config"]
    kind, R = dc["markov_head_type"], dc["markov_rank"]
    T = {k.removeprefix("logit_head."): _t(v) for k, v in t.items()}
    w1, w2 = T["markov_head.markov_w1.weight"], T["markov_head.markov_w2.weight"]
    state = torch.zeros(R, dtype=torch.float64)
    prev, out, prevs, picked, gap = pending, [], [], [], np.inf
    for k in range(base.shape[0]):
        e = w1[prev]  # nn.Embedding
        if kind == "vanilla":  # project_bias(get_prev_embeddings)
            bias = e @ w2.T
        elif kind == "gated":  # project_bias(sigmoid(gate_proj([h ; e])) * e)
            gate = torch.sigmoid(torch.cat([hidden[k], e]) @ T["markov_head.gate_proj.weight"].T
                                 + T["markov_head.gate_proj.bias"])
            bias = (gate * e) @ w2.T
        else:  # _rnn_step: joint_proj([state ; e ; h]).chunk(3) -> gate, candidate, output
            z = torch.cat([state, e, hidden[k]]) @ T["markov_head.joint_proj.weight"].T + \
                T["markov_head.joint_proj.bias"]
            g, c, o = z.chunk(3)
            g = torch.sigmoid(g)
            state = g * state + (1.0 - g) * torch.tanh(c)
            bias = torch.tanh(o) @ w2.T
        step = base[k] + bias
        out.append(step)
        prevs.append(prev)
        top2 = torch.topk(step, 2).values
        gap = min(gap, float(top2[0] - top2[1]))
        prev = int(torch.argmax(step)) if chain is None else int(chain[k])
        picked.append(prev)
    conf = None
    if "confidence_head.proj.weight" in T:
        x = hidden
        if dc.get("confidence_head_with_markov"):
            x = torch.cat([hidden, w1[torch.as_tensor(prevs)]], -1)
        conf = (x @ T["confidence_head.proj.weight"].T + T["confidence_head.proj.bias"])[:, 0]
    return torch.stack(out), conf, picked, gap


# ----------------------------------------------------------------------------- specjax side

@functools.cache
def _runner(drafter):
    """Prefill, init, the block forward's G draft slots, the Markov head's logits along a
    given chain, a greedy propose and the confidence along the chain, jitted once."""
    g, _ = nnx.split(target())
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)
    G = drafter.gamma

    @jax.jit
    def run(p, dparams, toks, lens, chain):
        _, view = _prefill(nnx.merge(g, p), cfg, toks, lens, jnp.full((4,), 8, jnp.int32),
                           jax.random.key(0), G, drafter.capture)
        state = drafter.init(dparams, view, jax.random.key(1))
        net = drafter.net(dparams)
        out, logits = drafter.block_outputs(dparams, state, view)
        h = net.final_hidden(out)
        res = dict(hidden=h, logits=logits, tokens=view.tokens, feats=view.hidden)
        if net.markov() is not None:
            res["corrected"] = markov.block_logits(net.markov(), logits, h,
                                                   markov.predecessors(view.pending, chain))
        res["draft"], res["q"], _ = drafter.propose(dparams, state, view, jax.random.key(2))
        if drafter.has_confidence:
            res["conf"] = drafter.confidence(dparams, state, view, chain)
        return res

    return run


def run_head(drafter, dparams, chain):
    p = nnx.split(target())[1]
    return jax.tree.map(np.asarray, _runner(drafter)(p, dparams, *prompts(),
                                                     jnp.asarray(chain, jnp.int32)))


def chains(G, seed=0):
    return np.random.RandomState(seed).randint(0, V, (len(PROMPT_LENS), G))


def check_against_reference(t, cfg, got, chain, anchor=True):
    """Every draft slot of every row against the torch reference: hidden states, the
    backbone's logits, the Markov-corrected logits along `chain`, the greedy chain and
    the confidence. Returns the number of greedy picks the Markov head moved off the
    backbone's argmax."""
    embed, lm_head = np.asarray(target().embed[...]), np.asarray(target().lm_head[...])
    feats = got["feats"].astype(np.float64)  # [C,B,TP,D]
    first = 0 if anchor else 1
    moved = 0
    for b, n in enumerate(PROMPT_LENS):
        pending = int(got["tokens"][b, n])
        hidden, logits = reference(t, cfg, np.concatenate(list(feats[:, b, :n]), -1), pending,
                                   int(n), embed, lm_head)
        hidden, logits = hidden[first:], logits[first:]  # the draft slots
        np.testing.assert_allclose(got["hidden"][b], hidden.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["logits"][b], logits.numpy(), rtol=1e-4, atol=2e-4)
        conf = None
        if cfg["dflash_config"]["markov_rank"]:
            corrected, conf, _, _ = reference_heads(t, cfg, hidden, logits, pending, chain[b])
            np.testing.assert_allclose(got["corrected"][b], corrected.numpy(), rtol=1e-4,
                                       atol=2e-4)
            _, _, path, gap = reference_heads(t, cfg, hidden, logits, pending)
            assert gap > 1e-3, gap  # no near-tie that float32 could flip
            assert got["draft"][b].tolist() == path
            moved += int((np.argmax(logits.numpy(), -1) != np.array(path)).sum())
        if "conf" in got:
            assert conf is not None  # this test's confidence heads come with a Markov head
            np.testing.assert_allclose(got["conf"][b], torch.sigmoid(conf).numpy(), rtol=1e-4,
                                       atol=1e-5)
    return moved


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn", "dflash-layout"])
def test_head_matches_torch_reference_at_every_draft_slot(variant, tmp_path):
    """vanilla: SpecForge's qwen3-8b-dspark.json settings (confidence with Markov); gated:
    the confidence head on h_k alone; rnn: the recurrent head; dflash-layout:
    `sample_from_anchor: false` (block_size - 1 drafts from the mask slots) with the heads
    under early checkpoints' `logit_head.` names."""
    kind = "vanilla" if variant == "dflash-layout" else variant
    anchor = False if variant == "dflash-layout" else None
    t, cfg = head(kind, with_markov=variant != "gated", anchor=anchor,
                  legacy=variant == "dflash-layout")
    path = write_dir(tmp_path / variant, t, cfg)
    assert detect_layout(str(path)) == "dflash"
    drafter, dparams = load_external(str(path), target())
    dcfg = drafter.cfg
    G = BLOCK if anchor is None else BLOCK - 1
    assert drafter.gamma == G and dcfg.capture == tuple(i + 1 for i in DFLASH_IDS)
    assert (dcfg.markov_rank, dcfg.markov_head_type, dcfg.confidence_head,
            dcfg.confidence_head_with_markov, dcfg.sample_from_anchor) == (
        RANK, kind, True, variant != "gated", anchor is None)
    chain = chains(G)
    got = run_head(drafter, dparams, chain)
    moved = check_against_reference(t, cfg, got, chain, anchor=anchor is None)
    assert moved > 0  # the Markov head changed some greedy picks: the check has teeth
    q = got["q"]  # greedy: one-hot at the drafts
    np.testing.assert_array_equal(q.argmax(-1), got["draft"])
    np.testing.assert_array_equal(q.max(-1), np.ones_like(q.max(-1)))


def test_training_path_equals_decoding_path(tmp_path):
    """The packed training block of the anchor at the pending position (`BlockNet.blocks`
    in DSpark's layout, the Markov head teacher-forced by the tokens that follow) computes
    what decoding computes along the same chain: corrected logits and confidence."""
    drafter, dparams = load_external(str(write_dir(tmp_path / "h", *head("rnn"))), target())
    G = drafter.gamma
    chain = chains(G, seed=2)
    got = run_head(drafter, dparams, chain)
    net, tgt = drafter.net(dparams), target()
    B, W = len(PROMPT_LENS), TP + 1 + G
    rows_ = np.zeros((B, W), np.int32)
    for b, n in enumerate(PROMPT_LENS):  # committed tokens, the pending one, the chain
        rows_[b, :n + 1 + G] = np.concatenate([got["tokens"][b, :n + 1], chain[b]])
    rows_ = jnp.asarray(rows_)
    pos = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    out = tgt(rows_, pos, None, capture=drafter.cfg.capture, capture_kv=())
    inv = dparams["inv_freq"]  # the head's own RoPE (its rope_theta), not the target's
    anchors = jnp.asarray(PROMPT_LENS)[:, None]  # the pending token's position
    ctx = net.contexts(out.hidden, None, pos, inv)
    blk = net.blocks(ctx, anchors, rows_, dparams["embed"], inv, G)[:, 0]
    assert blk.shape[1] == G  # DSpark's layout: G slots, all drafting
    h = net.final_hidden(blk)
    at = anchors + jnp.arange(G)
    prev = jnp.take_along_axis(rows_, at, axis=1)  # the data token before each slot
    corrected = markov.block_logits(net.markov(), net.logits(blk, dparams["head"]), h, prev)
    np.testing.assert_allclose(np.asarray(corrected), got["corrected"], rtol=1e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(net.confidence_logits(h, prev))),
                               got["conf"], rtol=1e-4, atol=1e-5)


def test_backbone_alone_and_the_anchor_slot(tmp_path):
    """markov_rank 0 and no confidence head: a DSpark-layout DFlash backbone (SpecForge's
    `build_markov_head` returns None); its G = block_size drafts are the argmax of all G
    slots, the anchor slot's included, and the plain DFlash reading of the same tensors
    (projector_type dflash: block_size - 1 drafts from slots 1..) differs by that slot."""
    t, cfg = head(rank=0, confidence=False, with_markov=False)
    drafter, dparams = load_external(str(write_dir(tmp_path / "b", t, cfg)), target())
    assert drafter.gamma == BLOCK and not drafter.has_confidence
    assert drafter.cfg.markov_rank == 0 and drafter.cfg.sample_from_anchor
    got = run_head(drafter, dparams, chains(BLOCK))
    check_against_reference(t, cfg, got, chains(BLOCK))
    np.testing.assert_array_equal(got["draft"], got["logits"].argmax(-1))
    cfg2 = {**cfg, "architectures": ["DFlashDraftModel"],
            "dflash_config": {**cfg["dflash_config"], "projector_type": "dflash"}}
    d2, p2 = load_external(str(write_dir(tmp_path / "d", t, cfg2)), target())
    assert d2.gamma == BLOCK - 1 and not d2.cfg.sample_from_anchor
    got2 = run_head(d2, p2, chains(BLOCK - 1))
    # the same backbone: DFlash's mask slots 1..3 see a block one slot longer
    assert got2["logits"].shape[1] == BLOCK - 1
    with pytest.raises(ValueError, match="no confidence head"):
        drafter.confidence(dparams, None, None, None)


# ----------------------------------------------------------------------------- loop

@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_greedy_equals_autoregressive(kind, tmp_path):
    """Greedy speculative decoding with a DSpark head loaded from its directory is
    autoregressive decoding token for token."""
    tgt = target()
    drafter, dparams = load_external(str(write_dir(tmp_path / "h", *head(kind))), tgt)
    g, p = nnx.split(tgt)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)
    toks, lens = prompts()
    sp = speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                          jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0))
    assert rows(sp) == ar_rows()
    assert (np.asarray(sp.lengths) - PROMPT_LENS).tolist() == BUDGETS


def test_chain_and_tree_options_are_refused(tmp_path):
    drafter, dparams = load_external(str(write_dir(tmp_path / "h", *head())), target())
    with pytest.raises(ValueError, match="Markov head drafts one chain"):
        drafter.propose_tree_topk(dparams, None, None, None, 2, 4)


# ----------------------------------------------------------------------------- distribution

@functools.cache
def _dspark_learned(gamma: int, kind: str):
    """A random (scaled, so opinionated) DSpark-layout block drafter with a Markov head
    of rank 4 on the 6-token target of tests/decoding/test_distribution.py."""
    from specjax.testing import distribution as du
    from tests.decoding.test_distribution import PAD, PLAIN, _models

    dcfg = DrafterConfig.for_target(du.CFG, "block", gamma=gamma, mask_token_id=PAD)
    dcfg = dataclasses.replace(dcfg, markov_rank=4, markov_head_type=kind,
                               sample_from_anchor=True, confidence_head=True,
                               confidence_head_with_markov=True)
    net = build_network(dcfg, rngs=nnx.Rngs(7))
    state = nnx.state(net, nnx.Param)
    nnx.update(net, jax.tree.map(lambda x: x * 25.0 if x.ndim >= 2 and x.shape[-1] != x.shape[-2]
                                 else x, state))
    # W2 starts at 0 (a new head ranks as the block does): give the head an opinion
    net.markov_w2.set_value(jax.random.normal(jax.random.key(5), net.markov_w2.shape) * 2.0)
    return make_drafter(dcfg, net, _models()[0], gamma=gamma, sampling=PLAIN)


def _sampled(verify, kind="vanilla", gamma=3):
    from tests.decoding.test_distribution import (
        BATCH,
        N_NEW,
        PAD,
        PLAIN,
        PROMPT,
        PROMPT_WIDTH,
        _models,
    )

    _, _, graphdef, params = _models()
    drafter, dparams = _dspark_learned(gamma, kind)
    lc = LoopConfig(max_length=len(PROMPT) + N_NEW, prompt_width=PROMPT_WIDTH, sampling=PLAIN,
                    verify=verify)
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    res = speculative_loop(graphdef, params, drafter, dparams, lc,
                           jnp.asarray(np.tile(prompt, (BATCH, 1))),
                           jnp.full((BATCH,), len(PROMPT), jnp.int32),
                           jnp.full((BATCH,), N_NEW, jnp.int32), jax.random.key(0))
    Tp = len(PROMPT)
    assert (np.asarray(res.lengths) == Tp + N_NEW).all()
    return np.asarray(res.tokens)[:, Tp:Tp + N_NEW], np.asarray(res.accepted)


@pytest.mark.parametrize("verify,kind", [("token", "vanilla"), ("block", "rnn")])
def test_markov_sampling_is_lossless(verify, kind):
    """Above temperature 0 the Markov head samples each draft from its corrected logits
    given the token drafted before it; that distribution is the q returned, so the output
    follows the target's exact distribution (float64 enumeration)."""
    from tests.drafters.test_drafters_distribution import _assert_lossless

    _assert_lossless(*_sampled(verify, kind), f"dspark {kind} {verify}")


def test_markov_with_the_uncorrected_q_fails(monkeypatch):
    """Power check: reporting the block's own (uncorrected) distribution as q while the
    drafts come from the corrected logits must be caught by the same test."""
    from specjax.core.sampling import filtered_probs
    from tests.drafters.test_drafters_distribution import _assert_lossless

    real = markov.draft_chain

    def wrong(head, h, logits, first, key, sampling, constraint=None):
        draft, _ = real(head, h, logits, first, key, sampling, constraint)
        return draft, filtered_probs(logits, sampling)

    monkeypatch.setattr(markov, "draft_chain", wrong)
    with pytest.raises(AssertionError):
        _assert_lossless(*_sampled("token", "vanilla", gamma=2), "dspark wrong q")


# ----------------------------------------------------------------------------- training

def test_dspark_drafter_trains_with_train_py(train_setup, tmp_path):  # noqa: F811
    """train.py's block objective trains a DSpark-layout drafter with a Markov head and a
    confidence head: the loss falls within 5 steps, both heads moved off their init, and
    the exported drafter directory records the options and loads back."""
    import os

    from specjax.drafters.io import load_drafter
    from specjax.train import load_config, train

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "test_tiny_drafter.yaml")
    args = ["objective=block", "drafter.kind=block", "drafter.num_anchors=4",
            "drafter.markov_rank=8", "drafter.markov_head_type=gated",
            "drafter.confidence_head=true", "drafter.confidence_head_with_markov=true",
            "drafter.sample_from_anchor=true", "drafter.confidence_alpha=1.0",
            f"target={train_setup['target']}", f"data.tokens_npy={train_setup['tokens']}",
            "mesh.data=1", "mesh.fsdp=1", "mesh.model=1"]
    res = train(load_config(tiny, args, run_dir=str(tmp_path / "run")), progress=False)
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    dcfg, params, _ = load_drafter(res.export_dir)
    assert (dcfg.markov_rank, dcfg.markov_head_type, dcfg.confidence_head,
            dcfg.confidence_head_with_markov, dcfg.sample_from_anchor) == (
        8, "gated", True, True, True)
    w2 = np.asarray(params["markov_w2"].get_value())
    assert w2.shape == (320, 8) and np.abs(w2).max() > 0  # it started at zero
    assert np.abs(np.asarray(params["conf_bias"].get_value())).max() > 0  # so did this


def test_confidence_loss_is_the_producers(train_setup):  # noqa: F811
    """The block objective with a confidence head adds alpha x BCE(c_k, 1 - TV(p, q_k))
    under the block's weights and normaliser: with the head's logit fixed at 0 (proj and
    bias zero), BCE(0, y) = log 2 whatever the target y, so loss(alpha) - loss(0) =
    alpha log 2 exactly. A new Markov head (W2 = 0) leaves the block loss as it is
    without one."""
    from specjax.models.checkpoint import load_model
    from specjax.train.objectives import Frozen
    from specjax.train.objectives.block import block_loss

    tgt = load_model(train_setup["target"])
    rs = np.random.RandomState(0)
    rows_ = jnp.asarray(rs.randint(0, 320, (2, 17)), jnp.int32)
    base = DrafterConfig.for_target(tgt.cfg, "block", gamma=3)
    plain = build_network(base, rngs=nnx.Rngs(0))
    dcfg = dataclasses.replace(base, markov_rank=4, confidence_head=True,
                               confidence_head_with_markov=True)
    net = build_network(dcfg, rngs=nnx.Rngs(0))
    nnx.update(net, nnx.state(plain, nnx.Param))  # the same backbone
    net.conf_proj.set_value(jnp.zeros_like(net.conf_proj[...]))
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    out = tgt(rows_[:, :16], pos, None, capture=base.capture, capture_kv=())
    frozen = Frozen.from_target(tgt)
    key = jax.random.key(3)
    args = dict(num_anchors=4, gamma=3)
    l_plain = block_loss(plain, out, rows_, frozen, key, **args)[0]
    l0 = block_loss(net, out, rows_, frozen, key, confidence_alpha=0.0, **args)[0]
    l1 = block_loss(net, out, rows_, frozen, key, confidence_alpha=0.5, **args)[0]
    np.testing.assert_allclose(float(l0), float(l_plain), rtol=1e-6)
    np.testing.assert_allclose(float(l1 - l0), 0.5 * np.log(2.0), rtol=1e-5)


# ----------------------------------------------------------------------------- export

def _specjax_dspark(kind="rnn", seed=4, anchor=True):
    dcfg = dataclasses.replace(
        DrafterConfig.for_target(CFG4, "block", gamma=BLOCK, mask_token_id=MASK),
        capture=tuple(i + 1 for i in DFLASH_IDS), markov_rank=RANK, markov_head_type=kind,
        confidence_head=True, confidence_head_with_markov=True, sample_from_anchor=anchor)
    net = build_network(dcfg, rngs=nnx.Rngs(seed))
    rs = np.random.RandomState(seed)
    for name in ("markov_w1", "markov_w2", "markov_joint", "markov_joint_bias", "conf_proj",
                 "conf_bias"):
        if hasattr(net, name):
            p = getattr(net, name)
            p.set_value(jnp.asarray(rs.standard_normal(p.shape), p.dtype))
    return dcfg, net


def test_export_writes_dspark_and_reads_back(tmp_path):
    """A specjax DSpark-layout drafter exported with `convert --to dflash` is SpecForge's
    DSparkDraftModel directory (its tensor names and dflash_config keys); the torch
    reference over the exported files and specjax's reading of them agree with the
    source drafter."""
    from safetensors.numpy import load_file

    from specjax.drafters.io import save_drafter
    from specjax.models.checkpoint import save_model
    from specjax.tools import convert

    target_dir = tmp_path / "target"
    save_model(target(), str(target_dir))
    dcfg, net = _specjax_dspark()
    src, dst = tmp_path / "specjax", tmp_path / "dspark"
    save_drafter(str(src), dcfg, nnx.split(net, nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", "dflash", str(src), str(dst), "--dtype", "float32"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    t = load_file(str(dst / "model.safetensors"))
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["block_size"] == BLOCK
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in ("projector_type", "markov_rank", "markov_head_type",
                               "enable_confidence_head", "confidence_head_with_markov")} == {
        "projector_type": "dspark", "markov_rank": RANK, "markov_head_type": "rnn",
        "enable_confidence_head": True, "confidence_head_with_markov": True}
    want = set(head("rnn")[0])
    assert set(t) == want
    d0, p0 = make_drafter(dcfg, net, target(), gamma=BLOCK)
    d1, p1 = load_external(str(dst), target())
    assert d1.cfg == dcfg
    chain = chains(BLOCK, seed=1)
    g0, g1 = run_head(d0, p0, chain), run_head(d1, p1, chain)
    for k in ("logits", "corrected", "conf"):
        np.testing.assert_allclose(g1[k], g0[k], atol=1e-5)
    check_against_reference(t, cfg, g0, chain)


def test_export_refuses_markov_in_the_dflash_layout(tmp_path, capsys):
    from specjax.drafters.io import save_drafter
    from specjax.models.checkpoint import save_model
    from specjax.tools import convert

    target_dir = tmp_path / "target"
    save_model(target(), str(target_dir))
    dcfg, net = _specjax_dspark(kind="vanilla", anchor=False)
    src = tmp_path / "specjax"
    save_drafter(str(src), dcfg, nnx.split(net, nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", "dflash", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample_from_anchor" in err[0], err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- errors

def test_config_options_round_trip_and_errors():
    """DSpark's options are absent from config.json when off (older drafter directories
    stay byte-identical), round-trip when on, and are validated in one line."""
    base = DrafterConfig.for_target(CFG4, "block", gamma=3, mask_token_id=MASK)
    raw = base.to_json_dict()
    assert not {"markov_rank", "markov_head_type", "confidence_head",
                "confidence_head_with_markov", "sample_from_anchor"} & set(raw)
    on = dataclasses.replace(base, markov_rank=4, markov_head_type="gated",
                             confidence_head=True, confidence_head_with_markov=True,
                             sample_from_anchor=True)
    raw = json.loads(json.dumps(on.to_json_dict()))
    assert DrafterConfig.from_json_dict(raw) == on
    for change, needle in [(dict(markov_rank=-1), "markov_rank=-1"),
                           (dict(markov_rank=4, markov_head_type="lstm"), "'lstm'"),
                           (dict(confidence_head=True, confidence_head_with_markov=True),
                            "needs confidence_head and markov_rank"),
                           (dict(markov_rank=4, selector_rank=4, selector_top_k=2),
                            "both condition a position"),
                           (dict(confidence_head=1), "confidence_head=1")]:
        with pytest.raises(SpecjaxError, match=needle) as e:
            dataclasses.replace(base, **change)
        assert "\n" not in str(e.value)
    with pytest.raises(SpecjaxError, match="block drafter setting"):
        dataclasses.replace(DrafterConfig.for_target(CFG4, "eagle3"), markov_rank=2)


def _edit(t, cfg, what):
    dc = cfg["dflash_config"]
    if what == "head type":
        dc["markov_head_type"] = "lstm"
    elif what == "with_markov, rank 0":
        dc["markov_rank"] = 0
    elif what == "prefixed":
        cfg["dspark_block_size"] = 7
    elif what == "conv":
        dc.update(conv_kernel_size=2, conv_group_size=8)
    elif what == "softcap":
        dc["final_logit_softcapping"] = 10.0
    elif what == "sliding":
        cfg.update(use_sliding_window=True, sliding_window=8, is_causal=False,
                   layer_types=["sliding_attention", "full_attention"])
    elif what == "drop w2":
        del t["markov_head.markov_w2.weight"]
    elif what == "conf shape":
        t["confidence_head.proj.weight"] = t["confidence_head.proj.weight"][:, :D]
    elif what == "projector":
        dc["projector_type"] = "dflash"
    elif what == "domino":
        dc["projector_type"] = "domino"
        cfg["architectures"] = ["DFlashDraftModel"]
    elif what == "flag":
        dc["enable_confidence_head"] = "yes"


@pytest.mark.parametrize("what,needle", [
    ("head type", "markov_head_type='lstm'"),
    ("with_markov, rank 0", "confidence_head_with_markov=true requires markov_rank"),
    ("prefixed", "dspark_block_size"),
    ("conv", "conv_kernel_size on a DSpark head"),
    ("softcap", "final_logit_softcapping on a DSpark head"),
    ("sliding", "sliding_windows on a DSpark head"),
    ("drop w2", "markov_head.markov_w2.weight missing"),
    ("conf shape", "confidence_head.proj.weight has shape (1, 32)"),
    ("projector", "projector_type='dflash'"),
    ("domino", "projector_type='domino'"),
    ("flag", "enable_confidence_head='yes'"),
])
def test_bad_dspark_is_one_line_error(what, needle, tmp_path):
    t, cfg = head()
    _edit(t, cfg, what)
    path = write_dir(tmp_path / "h", t, cfg)
    with pytest.raises(SpecjaxError) as e:
        read_external(str(path), CFG4)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg


def test_decode_cli_exits_2_on_a_bad_dspark_head(tmp_path, capsys):
    import decode
    from specjax.models.checkpoint import save_model

    target_dir = tmp_path / "target"
    save_model(target(), str(target_dir))
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7, 5, 6]}\n')
    t, cfg = head()
    cfg["dflash_config"]["markov_head_type"] = "lstm"
    bad = write_dir(tmp_path / "bad", t, cfg)
    code = decode.main([str(a) for a in ["--target", target_dir, "--prompts",
                                         tmp_path / "p.jsonl", "--max-new-tokens", 4,
                                         "--drafter", bad]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "markov_head_type='lstm'" in lines[0], lines


@pytest.mark.parametrize("extra,needle", [
    (["drafter.markov_rank=4", "drafter.selector_rank=4"], "both condition a position"),
    (["drafter.confidence_head_with_markov=true"], "needs confidence_head"),
    (["drafter.confidence_alpha=-1"], "confidence_alpha=-1"),
])
def test_train_cli_exits_2_on_bad_dspark_options(extra, needle, train_setup, tmp_path,  # noqa: F811
                                                 capsys):
    import os

    import train as train_cli

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "test_tiny_drafter.yaml")
    sets = ["objective=block", "drafter.kind=block", f"target={train_setup['target']}",
            f"data.tokens_npy={train_setup['tokens']}", "mesh.data=1", *extra]
    code = train_cli.main(["--config", tiny, "--run-dir", str(tmp_path / "run"),
                           "--no-progress", *[a for s in sets for a in ("--set", s)]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines
