"""DFlash2 heads (z-lab/dflash `DFlash2DraftModel`) and DFlash2's layer pieces as block
drafter options: a tiny random head written in the producer's format (config.json with
`dflash_config`, safetensors under the names and structure of z-lab's
`tests/fixtures/dflash2-{config,safetensors-header}.json`) is loaded by specjax and
checked at every block position (final-normed hidden states and logits) against a
float64 torch forward written here from the producer's code (`Qwen3DFlashDecoderLayer`,
`GroupedDynamicCausalConv` / `_grouped_dynamic_convolve`, `_attention_mask`,
`compute_logits`, `CandidateSelector.select`), with and without the convolution, the
logit transforms and a sliding window shorter than the context. Also: the greedy chain
of the selector, greedy identity with autoregressive decoding, training with train.py's
block objective (blocks packed along the query axis stay apart), the export back to the
DFlash2 layout, and one-line errors for what specjax refuses."""

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
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.attend import windowed
from specjax.drafters.external import detect_layout, load_external, read_external
from specjax.errors import SpecjaxError
from tests.decoding.test_speculative_greedy import BUDGETS, PROMPT_LENS, TP, prompts, rows
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

pytestmark = pytest.mark.timeout(300)

TAPS, GROUP, RANK, TOPK, WINDOW = 2, 8, 8, 4, 5  # W 5 < the longest context (9 positions)
BLOCK = 4  # block_size: G = 3

# z-lab's tests/fixtures/dflash2-safetensors-header.json: every layer's names, and the rest
FIXTURE_LAYER = {
    "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
    "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
    "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight",
    "self_attn.v_proj.weight"}
FIXTURE_TOP = {"candidate_selector.hidden_projection.weight",
               "candidate_selector.predecessor_codebook",
               "candidate_selector.successor_codebook", "fc.weight", "hidden_norm.weight",
               "norm.weight"}


def fixture_names(layers):
    return FIXTURE_TOP | {f"layers.{i}.{n}" for i in range(layers) for n in FIXTURE_LAYER}


# ----------------------------------------------------------------------------- writer

def head(variant, seed=0, layers=2):
    """(tensors, config) of a tiny head in z-lab's format.

    variant: "dflash2" (the fixture's structure: convolution, selector, output_multiplier,
      final_logit_softcapping, every layer sliding_attention with is_causal false), "conv"
      (DFlash2 without logit transforms or windows), "logits" (a DFlash head with the logit
      transforms), "window" (a DFlash head whose first layer has a sliding window)."""
    t, cfg = dflash_tensors(seed, layers)
    rs = np.random.RandomState(seed + 100)
    cfg.pop("block_size")
    dc = cfg["dflash_config"]
    dc["block_size"] = BLOCK
    cfg["is_causal"] = False
    if variant in ("dflash2", "conv"):
        cfg["architectures"] = ["DFlash2DraftModel"]
        dc.update(conv_kernel_size=TAPS, conv_group_size=GROUP, selector_rank=RANK,
                  selector_top_k=TOPK)
        for i in range(layers):
            for side in ("attention_conv", "mlp_conv"):
                base = _rand(rs, 2, TAPS, D)
                base[:, 0] += 1.0  # near the identity, as a trained one starts
                t[f"layers.{i}.{side}.base_kernel"] = base
                t[f"layers.{i}.{side}.kernel_projection.weight"] = _rand(
                    rs, 2 * TAPS * (D // GROUP), D, scale=0.1)
        t["candidate_selector.predecessor_codebook"] = _rand(rs, V, RANK, scale=1.0)
        t["candidate_selector.successor_codebook"] = _rand(rs, V, RANK, scale=1.0)
        t["candidate_selector.hidden_projection.weight"] = _rand(rs, RANK, D, scale=1.0)
    if variant in ("dflash2", "logits"):
        dc.update(output_multiplier=0.5, final_logit_softcapping=6.0)
    if variant in ("dflash2", "window"):
        cfg.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=layers)
        cfg["layer_types"] = (["sliding_attention"] * layers if variant == "dflash2" else
                              ["sliding_attention"] + ["full_attention"] * (layers - 1))
    return t, cfg


# ----------------------------------------------------------------------------- reference

def _t(x):
    return torch.as_tensor(np.asarray(x, np.float64))


def _rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T,heads,H], rotate-half
    h = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, h, 2, dtype=torch.float64) / h)
    f = torch.cat([pos[:, None] * inv] * 2, -1)[:, None]
    rot = torch.cat([-x[..., h // 2:], x[..., :h // 2]], -1)
    return x * torch.cos(f) + rot * torch.sin(f)


def _conv(y, delta, base, group):
    """y_t -> sum_j (base[j] + delta_t[j, group]) * y_{t-j}, y [S,D] along one block, zero
    before its start; delta [S,T,D/g], base [T,D]."""
    S, Dm = y.shape
    out = torch.zeros_like(y)
    for j in range(base.shape[0]):
        shifted = torch.cat([torch.zeros(j, Dm, dtype=y.dtype), y[:S - j]]) if j else y
        coef = base[j][None] + delta[:, j].repeat_interleave(group, dim=-1)
        out = out + coef * shifted
    return out


def _wrapped(h, t, p, taps, group, f):
    """z-lab's prepare -> f -> finish around one sublayer (p: "layers.i.attention_conv.")."""
    if taps is None:
        return f(h)
    delta = (h @ t[p + "kernel_projection.weight"].T).reshape(h.shape[0], 2, taps, -1)
    y = f(_conv(h, delta[:, 0], t[p + "base_kernel"][0], group))
    return _conv(y, delta[:, 1], t[p + "base_kernel"][1], group)


def reference(t, cfg, feats, pending, n, embed, lm_head):
    """(final-normed hidden [G+1,D], logits [G+1,V]) of z-lab's DFlash/DFlash2 block
    [pending, G masks] at positions n..n+G over the context features feats [n, C*D] at
    0..n-1, float64."""
    t = {k: _t(v) for k, v in t.items()}
    dc = cfg["dflash_config"]

    def value(name, default=None):  # z-lab `_draft_value`: dflash_config, then the top
        return dc.get(name, cfg.get(name, default))

    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    N, K, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    G = value("block_size") - 1
    taps, group = value("conv_kernel_size"), value("conv_group_size")
    ctx = _rms(_t(feats) @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = _t(embed)[[pending] + [value("mask_token_id")] * G]
    qpos = torch.arange(n, n + G + 1, dtype=torch.float64)
    kpos = torch.arange(n + G + 1, dtype=torch.float64)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        kind = cfg["layer_types"][i]
        causal = cfg.get("is_causal")
        assert not (kind == "sliding_attention" if causal is None else causal)
        visible = torch.ones(G + 1, n + G + 1, dtype=torch.bool)  # `_attention_mask`
        if kind == "sliding_attention" and window is not None:
            visible &= (qpos[:, None] - kpos[None]) < window
            visible &= (kpos[None] - qpos[:, None]) < window

        def attention(h, p=p, visible=visible):
            q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(-1, N, H)
            q = _rope(_rms(q, t[p + "self_attn.q_norm.weight"], eps), qpos, theta)
            k = torch.cat([ctx, h]) @ t[p + "self_attn.k_proj.weight"].T
            k = _rope(_rms(k.reshape(-1, K, H), t[p + "self_attn.k_norm.weight"], eps), kpos,
                      theta)
            v = (torch.cat([ctx, h]) @ t[p + "self_attn.v_proj.weight"].T).reshape(-1, K, H)
            k, v = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
            s = torch.einsum("qnh,knh->nqk", q, k) / H ** 0.5
            a = torch.softmax(s.masked_fill(~visible[None], -torch.inf), -1)
            o = torch.einsum("nqk,knh->qnh", a, v).reshape(-1, N * H)
            return o @ t[p + "self_attn.o_proj.weight"].T

        def mlp(h, p=p):
            g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
            return (torch.nn.functional.silu(g) * u) @ t[p + "mlp.down_proj.weight"].T

        x = x + _wrapped(_rms(x, t[p + "input_layernorm.weight"], eps), t,
                         p + "attention_conv.", taps, group, attention)
        x = x + _wrapped(_rms(x, t[p + "post_attention_layernorm.weight"], eps), t,
                         p + "mlp_conv.", taps, group, mlp)
    hidden = _rms(x, t["norm.weight"], eps)
    logits = (hidden @ _t(lm_head).T) * float(value("output_multiplier", 1.0))
    cap = value("final_logit_softcapping")
    if cap is not None and float(cap) > 0:
        logits = torch.tanh(logits / float(cap)) * float(cap)
    return hidden, logits


def reference_select(t, cfg, hidden, logits, anchor):
    """`CandidateSelector.select` at temperature 0 over block positions 1..G: the greedy
    path and the smallest gap between a position's best and second-best score."""
    k = cfg["dflash_config"]["selector_top_k"]
    unary, cand = torch.topk(logits, k, dim=-1, sorted=False)
    hp = hidden @ _t(t["candidate_selector.hidden_projection.weight"]).T
    pred = _t(t["candidate_selector.predecessor_codebook"])
    succ = _t(t["candidate_selector.successor_codebook"])
    prev, path, gap = anchor, [], np.inf
    for pos in range(hidden.shape[0]):
        s = unary[pos] + (pred[prev] * hp[pos]) @ succ[cand[pos]].T
        top2 = torch.topk(s, 2).values
        gap = min(gap, float(top2[0] - top2[1]))
        prev = int(cand[pos][torch.argmax(s)])
        path.append(prev)
    return path, gap


# ----------------------------------------------------------------------------- specjax side

@functools.cache
def _runner(drafter, G):
    """Prefill, init, the block forward at all G+1 positions (as `block_outputs` runs
    it), `block_outputs` itself and a greedy propose, jitted once per drafter."""
    g, _ = nnx.split(target())
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)

    @jax.jit
    def run(p, dparams, toks, lens):
        _, view = _prefill(nnx.merge(g, p), cfg, toks, lens, jnp.full((4,), 8, jnp.int32),
                           jax.random.key(0), G, drafter.capture)
        state = drafter.init(dparams, view, jax.random.key(1))
        net = drafter.net(dparams)
        B = lens.shape[0]
        pos = (view.lengths - 1)[:, None] + jnp.arange(G + 1, dtype=jnp.int32)
        tokens = jnp.concatenate([jnp.take_along_axis(view.tokens, pos[:, :1], axis=1),
                                  jnp.full((B, G), drafter.cfg.mask_token_id, jnp.int32)], 1)
        visible = windowed(jnp.broadcast_to(pos[:, :1] - 1, (B, G + 1)), drafter.window)
        out = net.run_block(tokens, pos, [((state.hidden.k, state.hidden.v), visible)], G + 1,
                            dparams["embed"], dparams["inv_freq"])
        block_out, block_logits = drafter.block_outputs(dparams, state, view)
        draft, _, _ = drafter.propose(dparams, state, view, jax.random.key(2))
        return dict(hidden=net.final_hidden(out), logits=drafter.logits(net, out, dparams),
                    out=out, block_out=block_out, block_logits=block_logits, draft=draft,
                    tokens=view.tokens, feats=view.hidden)

    return run


def run_head(drafter, dparams, G):
    p = nnx.split(target())[1]
    return jax.tree.map(np.asarray, _runner(drafter, G)(p, dparams, *prompts()))


def check_against_reference(t, cfg, got, selector: bool):
    """Every block position of every row against `reference`; the selector's chain
    against `reference_select`. Returns the number of positions where the selector picked
    another token than the logits' argmax."""
    embed, lm_head = np.asarray(target().embed[...]), np.asarray(target().lm_head[...])
    feats = got["feats"].astype(np.float64)  # [C,B,TP,D]
    np.testing.assert_array_equal(got["block_out"], got["out"][:, 1:])
    np.testing.assert_array_equal(got["block_logits"], got["logits"][:, 1:])
    moved = 0
    for b, n in enumerate(PROMPT_LENS):
        pending = int(got["tokens"][b, n])
        hidden, logits = reference(t, cfg, np.concatenate(list(feats[:, b, :n]), -1), pending,
                                   int(n), embed, lm_head)
        np.testing.assert_allclose(got["hidden"][b], hidden.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["logits"][b], logits.numpy(), rtol=1e-4, atol=2e-4)
        if selector:
            path, gap = reference_select(t, cfg, hidden[1:], logits[1:], pending)
            assert gap > 1e-3, gap  # no near-tie that float32 could flip
            assert got["draft"][b].tolist() == path
            moved += int((np.argmax(logits[1:].numpy(), -1) != np.array(path)).sum())
        else:
            assert got["draft"][b].tolist() == np.argmax(got["logits"][b, 1:], -1).tolist()
    return moved


@pytest.mark.parametrize("variant", ["dflash2", "conv", "logits", "window"])
def test_head_matches_torch_reference_at_every_block_position(variant, tmp_path):
    t, cfg = head(variant)
    if variant == "dflash2":
        assert set(t) == fixture_names(2)
    path = write_dir(tmp_path / variant, t, cfg)
    assert detect_layout(str(path)) == "dflash"
    drafter, dparams = load_external(str(path), target())
    dcfg = drafter.cfg
    assert drafter.gamma == BLOCK - 1 and dcfg.capture == tuple(i + 1 for i in DFLASH_IDS)
    conv = variant in ("dflash2", "conv")
    assert (dcfg.conv_kernel_size, dcfg.selector_rank) == ((TAPS, RANK) if conv else (0, 0))
    if variant in ("dflash2", "logits"):
        assert (dcfg.output_multiplier, dcfg.final_logit_softcapping) == (0.5, 6.0)
    want_w = {"dflash2": (WINDOW, WINDOW), "window": (WINDOW, 0)}.get(variant, ())
    assert dcfg.sliding_windows == want_w
    got = run_head(drafter, dparams, BLOCK - 1)
    moved = check_against_reference(t, cfg, got, selector=conv)
    if conv:
        assert moved > 0  # the selector changed some picks: the check has teeth
    if want_w:  # the window hides context from the longest row: without it, other logits
        n = int(PROMPT_LENS[0])
        feats = np.concatenate(list(got["feats"][:, 0, :n].astype(np.float64)), -1)
        _, full = reference(t, {**cfg, "use_sliding_window": False}, feats,
                            int(got["tokens"][0, n]), n, np.asarray(target().embed[...]),
                            np.asarray(target().lm_head[...]))
        assert np.abs(full.numpy() - got["logits"][0]).max() > 1e-2


# ----------------------------------------------------------------------------- loop

def _conv_drafter(seed=0, selector=False, window=True):
    """A specjax block drafter for the loop's tiny target with random (non-identity)
    convolution weights, the logit transforms and a sliding window."""
    from tests.decoding.test_speculative_greedy import models

    tgt, _ = models()
    dcfg = DrafterConfig.for_target(tgt.cfg, "block", gamma=3, mask_token_id=1)
    dcfg = dataclasses.replace(
        dcfg, conv_kernel_size=TAPS, conv_group_size=GROUP, output_multiplier=0.7,
        final_logit_softcapping=5.0,
        sliding_windows=(WINDOW, 0) if window else (),
        **(dict(selector_rank=RANK, selector_top_k=TOPK) if selector else {}))
    net = build_network(dcfg, rngs=nnx.Rngs(seed))
    rs = np.random.RandomState(seed)
    for name in ("attn_conv_base", "mlp_conv_base", "attn_conv_proj", "mlp_conv_proj"):
        p = getattr(net, name)
        p.set_value(p[...] + jnp.asarray(0.3 * rs.standard_normal(p.shape), p.dtype))
    return dcfg, net


@pytest.mark.parametrize("source", ["specjax", "specjax-bf16", "dflash2-dir"])
def test_greedy_equals_autoregressive(source, tmp_path):
    """Greedy speculative decoding with a conv drafter (specjax's, with f32 or bf16
    drafter matmuls, and a DFlash2 head loaded from its directory) is autoregressive
    decoding token for token."""
    from tests.decoding.test_speculative_greedy import models, run_ar

    if source.startswith("specjax"):
        tgt, _ = models()
        dcfg, net = _conv_drafter()
        drafter, dparams = make_drafter(dcfg, net, tgt, gamma=3, matmul_dtype=(
            jnp.bfloat16 if source.endswith("bf16") else None))
        want = rows(run_ar(BUDGETS))
    else:
        tgt = target()
        drafter, dparams = load_external(str(write_dir(tmp_path / "h", *head("dflash2"))), tgt)
        want = ar_rows()
    g, p = nnx.split(tgt)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)
    toks, lens = prompts()
    sp = speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                          jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0))
    assert rows(sp) == want
    assert (np.asarray(sp.lengths) - PROMPT_LENS).tolist() == BUDGETS


# ----------------------------------------------------------------------------- training

def test_packed_blocks_stay_apart():
    """Blocks packed along the query axis (the block objective): perturbing every input
    token of block j changes block j's outputs and leaves every other block's unchanged,
    with the convolution and a sliding window; run as one block of twice the size (the
    window off: the block must fit it), the blocks do see each other (the check can
    fail)."""
    dcfg, net = _conv_drafter(seed=1)
    B, A, G = 2, 4, dcfg.gamma
    S = G + 1
    rs = np.random.RandomState(3)
    Tctx = 14
    from specjax.drafters.attend import Limit

    hidden = jnp.asarray(rs.standard_normal((len(dcfg.capture), B, Tctx, D)), jnp.float32)
    inv = 1.0 / 10000.0 ** (jnp.arange(0, dcfg.head_dim, 2) / dcfg.head_dim)
    ctx = net.contexts(hidden, None, jnp.broadcast_to(jnp.arange(Tctx), (B, Tctx)), inv)
    anchors = jnp.asarray([[2, 5, 8, 10], [1, 4, 6, 9]], jnp.int32)
    pos = (anchors[:, :, None] + jnp.arange(S)).reshape(B, -1)
    mask = Limit(jnp.repeat(anchors, S, axis=1) - 1)
    embed = jnp.asarray(rs.standard_normal((dcfg.vocab_size, D)), jnp.float32)
    tokens = jnp.asarray(rs.randint(0, dcfg.vocab_size, (B, A * S)), jnp.int32)
    def runner(net):
        return jax.jit(lambda tk, size: net.run_block(tk, pos, [(c, mask) for c in ctx], size,
                                                      embed, inv), static_argnums=1)

    run = runner(net)
    for j in range(A):
        other = tokens.at[:, j * S:(j + 1) * S].set((tokens[:, j * S:(j + 1) * S] + 7)
                                                     % dcfg.vocab_size)
        a = np.asarray(run(tokens, S)).reshape(B, A, S, D)
        b = np.asarray(run(other, S)).reshape(B, A, S, D)
        for i in range(A):
            if i == j:
                assert np.abs(a[:, i] - b[:, i]).max() > 1e-2
            else:
                np.testing.assert_array_equal(a[:, i], b[:, i])
    run = runner(_conv_drafter(seed=1, window=False)[1])
    a = np.asarray(run(tokens, 2 * S)).reshape(B, A, S, D)  # blocks 0, 1 merged (and 2, 3)
    b = np.asarray(run(tokens.at[:, :S].set((tokens[:, :S] + 7) % dcfg.vocab_size),
                       2 * S)).reshape(B, A, S, D)
    assert np.abs(a[:, 1] - b[:, 1]).max() > 1e-2


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    """A 300-token BPE, token streams and a random tiny target (D 32, V 320), as
    tests/train/test_train_drafters.py builds them."""
    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config, write_token_corpus

    d = tmp_path_factory.mktemp("dflash2_train")
    tok, paths = write_token_corpus(str(d))
    shapes = dict(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=64)
    save_model(Transformer(tiny_config(320, **shapes), rngs=nnx.Rngs(7)), str(d / "target"),
               tokenizer=tok)
    return {**paths, "target": str(d / "target")}


def test_conv_drafter_trains_with_train_py(train_setup, tmp_path):
    """train.py's block objective trains a drafter with the convolution, the selector and
    the logit transforms: the loss falls within 5 steps, and the exported drafter directory
    records the options and loads back."""
    import os

    from specjax.drafters.io import load_drafter
    from specjax.models.config import ModelConfig
    from specjax.train import load_config, train

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "test_tiny_drafter.yaml")
    args = ["objective=block", "drafter.kind=block", "drafter.num_anchors=4",
            f"drafter.conv_kernel_size={TAPS}", f"drafter.conv_group_size={GROUP}",
            "drafter.selector_rank=8", "drafter.selector_top_k=4",
            "drafter.output_multiplier=0.5", "drafter.final_logit_softcapping=8.0",
            f"target={train_setup['target']}", f"data.tokens_npy={train_setup['tokens']}",
            "mesh.data=1", "mesh.fsdp=1", "mesh.model=1"]
    res = train(load_config(tiny, args, run_dir=str(tmp_path / "run")), progress=False)
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    dcfg, params, _ = load_drafter(res.export_dir)
    assert (dcfg.conv_kernel_size, dcfg.conv_group_size, dcfg.output_multiplier,
            dcfg.final_logit_softcapping) == (TAPS, GROUP, 0.5, 8.0)
    base = np.asarray(params["attn_conv_base"].get_value())
    assert base.shape == (dcfg.num_layers, 2, TAPS, 32)
    assert not np.array_equal(base[:, :, 0], np.ones_like(base[:, :, 0]))  # it was trained
    bad = load_config(tiny, args + ["drafter.conv_group_size=7"], run_dir=str(tmp_path / "x"))
    with pytest.raises(SpecjaxError, match="conv_group_size=7"):
        bad.drafter.for_target(ModelConfig.from_dir(train_setup["target"]))


# ----------------------------------------------------------------------------- export

def test_export_writes_dflash2_and_reads_back(tmp_path):
    """A specjax conv + selector drafter exported with `convert --to dflash` is a
    DFlash2DraftModel directory with the fixture's tensor names; the torch reference over
    the exported files and specjax's reading of them draft what the source drafts."""
    from specjax.drafters.io import save_drafter
    from specjax.models.checkpoint import save_model
    from specjax.tools import convert

    target_dir = tmp_path / "target"
    save_model(target(), str(target_dir))
    dcfg = dataclasses.replace(
        DrafterConfig.for_target(CFG4, "block", gamma=BLOCK - 1, mask_token_id=MASK),
        capture=tuple(i + 1 for i in DFLASH_IDS), conv_kernel_size=TAPS,
        conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOPK,
        output_multiplier=0.5, final_logit_softcapping=6.0, sliding_windows=(WINDOW, WINDOW))
    net = build_network(dcfg, rngs=nnx.Rngs(4))
    rs = np.random.RandomState(4)
    for name in ("attn_conv_base", "mlp_conv_base", "attn_conv_proj", "mlp_conv_proj"):
        p = getattr(net, name)
        p.set_value(p[...] + jnp.asarray(0.3 * rs.standard_normal(p.shape), p.dtype))
    for name in ("sel_pred", "sel_succ", "sel_proj"):  # a new selector would change no pick
        p = getattr(net, name)
        p.set_value(jnp.asarray(rs.standard_normal(p.shape), p.dtype))
    src, dst = tmp_path / "specjax", tmp_path / "dflash2"
    save_drafter(str(src), dcfg, nnx.split(net, nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", "dflash", str(src), str(dst), "--dtype", "float32"]) == 0
    from safetensors.numpy import load_file

    cfg = json.loads((dst / "config.json").read_text())
    t = load_file(str(dst / "model.safetensors"))
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert set(t) == fixture_names(dcfg.num_layers)
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == WINDOW
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size",
                                                 "selector_rank", "selector_top_k",
                                                 "output_multiplier",
                                                 "final_logit_softcapping")} == {
        "conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK,
        "selector_top_k": TOPK, "output_multiplier": 0.5, "final_logit_softcapping": 6.0}
    assert t["candidate_selector.hidden_projection.weight"].shape == (RANK, D)
    d0, p0 = make_drafter(dcfg, net, target(), gamma=BLOCK - 1)
    d1, p1 = load_external(str(dst), target())
    assert d1.cfg == dcfg
    g0 = run_head(d0, p0, BLOCK - 1)
    np.testing.assert_allclose(run_head(d1, p1, BLOCK - 1)["logits"], g0["logits"], atol=1e-5)
    check_against_reference(t, cfg, g0, selector=True)


@pytest.mark.parametrize("change,needle", [
    ("selector_only", "path selector but no convolution"),
    ("two_windows", "one sliding_window"),
])
def test_export_refuses_what_no_dflash_class_runs(change, needle, tmp_path, capsys):
    from specjax.drafters.io import save_drafter
    from specjax.models.checkpoint import save_model
    from specjax.tools import convert

    target_dir = tmp_path / "target"
    save_model(target(), str(target_dir))
    dcfg = DrafterConfig.for_target(CFG4, "block", gamma=3, mask_token_id=MASK)
    dcfg = dataclasses.replace(dcfg, **(dict(selector_rank=RANK, selector_top_k=TOPK)
                                        if change == "selector_only" else
                                        dict(sliding_windows=(WINDOW, WINDOW + 2))))
    src = tmp_path / "specjax"
    save_drafter(str(src), dcfg, nnx.split(build_network(dcfg, rngs=nnx.Rngs(0)),
                                           nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", "dflash", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- errors

def test_config_options_round_trip_and_errors():
    """The DFlash2 options are absent from config.json when off (older drafter directories
    stay byte-identical), round-trip when on, and are validated in one line."""
    base = DrafterConfig.for_target(CFG4, "block", gamma=3, mask_token_id=MASK)
    raw = base.to_json_dict()
    assert not {"conv_kernel_size", "conv_group_size", "output_multiplier",
                "final_logit_softcapping", "sliding_windows"} & set(raw)
    on = dataclasses.replace(base, conv_kernel_size=TAPS, conv_group_size=GROUP,
                             output_multiplier=0.5, final_logit_softcapping=6.0,
                             sliding_windows=(WINDOW, 0))
    raw = json.loads(json.dumps(on.to_json_dict()))
    assert raw["sliding_windows"] == [WINDOW, 0] and DrafterConfig.from_json_dict(raw) == on
    for change, needle in [(dict(conv_kernel_size=2, conv_group_size=5), "multiple of"),
                           (dict(conv_kernel_size=-1), "conv_kernel_size=-1"),
                           (dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
                           (dict(output_multiplier=0.0), "output_multiplier=0.0"),
                           (dict(sliding_windows=(WINDOW,)), "one window"),
                           (dict(sliding_windows=(3, 0)), "must exceed gamma=3")]:
        with pytest.raises(SpecjaxError, match=needle):
            dataclasses.replace(base, **change)
    with pytest.raises(SpecjaxError, match="block drafter setting"):
        dataclasses.replace(DrafterConfig.for_target(CFG4, "eagle3"), conv_kernel_size=2)


def _edit(t, cfg, what):
    dc = cfg["dflash_config"]
    if what == "is_causal=true":
        cfg["is_causal"] = True
    elif what == "is_causal absent":
        del cfg["is_causal"]
    elif what == "no conv_group_size":
        del dc["conv_group_size"]
    elif what == "conv_group_size=5":
        dc["conv_group_size"] = 5
    elif what == "input_embedding_scale=2":
        dc["input_embedding_scale"] = 2.0
    elif what == "window<=G":
        cfg["sliding_window"] = BLOCK - 1
    elif what == "layer_types":
        cfg["layer_types"] = ["sliding_attention"]
    elif what == "drop selector":
        del t["candidate_selector.successor_codebook"]
    elif what == "hidden_projection [D,R]":
        t["candidate_selector.hidden_projection.weight"] = \
            t["candidate_selector.hidden_projection.weight"].T.copy()
    elif what == "suffixed codebook":
        t["candidate_selector.predecessor_codebook.weight"] = \
            t.pop("candidate_selector.predecessor_codebook")
    elif what == "block_size twice":
        cfg["block_size"] = BLOCK + 1


@pytest.mark.parametrize("what,needle", [
    ("is_causal=true", "is_causal=true"),
    ("is_causal absent", "without is_causal"),
    ("no conv_group_size", "dflash_config.conv_group_size"),
    ("conv_group_size=5", "conv_group_size=5"),
    ("input_embedding_scale=2", "input_embedding_scale=2.0"),
    ("window<=G", "sliding_window 3 is not longer than the block"),
    ("layer_types", "layer_types="),
    ("drop selector", "candidate_selector.successor_codebook missing"),
    ("hidden_projection [D,R]", "hidden_projection.weight has shape (32, 8)"),
    ("suffixed codebook", "predecessor_codebook.weight has no counterpart"),
    ("block_size twice", "block_size 5 and dflash_config.block_size 4 differ"),
])
def test_bad_dflash2_is_one_line_error(what, needle, tmp_path):
    t, cfg = head("dflash2")
    _edit(t, cfg, what)
    path = write_dir(tmp_path / "h", t, cfg)
    with pytest.raises(SpecjaxError) as e:
        read_external(str(path), CFG4)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg


def test_decode_cli_exits_2_on_a_causal_dflash2_head(tmp_path, capsys):
    import decode
    from specjax.models.checkpoint import save_model

    target_dir = tmp_path / "target"
    save_model(target(), str(target_dir))
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7, 5, 6]}\n')
    t, cfg = head("dflash2")
    cfg["is_causal"] = True
    bad = write_dir(tmp_path / "bad", t, cfg)
    code = decode.main([str(a) for a in ["--target", target_dir, "--prompts",
                                         tmp_path / "p.jsonl", "--max-new-tokens", 4,
                                         "--drafter", bad]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is_causal=true" in lines[0], lines
