"""Drafters trained elsewhere (specjax.drafters.external / convert): random-weight EAGLE-3
(SpecForge / EAGLE layout, hot draft vocabulary with d2t/t2d) and DFlash (z-lab layout)
directories for a tiny target. Checks: draft distributions against a float64 numpy
reference written from the layouts' public definitions, greedy identity with
autoregressive decoding in the real loop and through decode.py, the round trip specjax
-> external layout -> specjax, and one-line errors (exit 2) for malformed directories."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import decode
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.external import detect_layout, load_external
from specjax.errors import SpecjaxError
from specjax.generate import LoopConfig, _prefill, autoregressive_loop, speculative_loop
from specjax.sampling import SamplingParams
from specjax.testing.models import peaked_model
from tests.test_speculative_greedy import BUDGETS, CFG, PROMPT_LENS, TP, prompts, rows

CFG4 = dataclasses.replace(CFG, num_layers=4)  # V=48, D=32, N=4, K=2, H=16, F=64
V, D, N, K, H, L = CFG4.vocab_size, 32, 4, 2, 16, 4
HOT = 20  # the EAGLE-3 head's draft vocabulary
AUX = [1, 2, 3]  # eagle_aux_hidden_state_layer_ids: inputs of target layers 1, 2, 3
DFLASH_IDS = [0, 1]  # target_layer_ids: outputs of layers 0, 1 = inputs of 1, 2
MASK, BLOCK = 1, 4  # mask_token_id, block_size (G = 3)


@functools.cache
def target():
    return peaked_model(CFG4, seed=0, scale=8.0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from specjax.checkpoint import save_model

    d = tmp_path_factory.mktemp("target") / "target"
    save_model(target(), str(d))
    return d


# ----------------------------------------------------------------------------- writers

def _rand(rs, *shape, scale=0.3):
    return (scale * rs.standard_normal(shape)).astype(np.float32)


def _norm(rs, n):
    return (1 + 0.2 * rs.standard_normal(n)).astype(np.float32)


def eagle3_tensors(seed=0, qk_norm=False):
    """SpecForge LlamaForCausalLMEagle3 names; q/k/v read [embedding ; hidden] (2D)."""
    rs = np.random.RandomState(seed)
    F = 40
    used = np.sort(rs.choice(V, HOT, replace=False))
    t = {"fc.weight": _rand(rs, D, 3 * D, scale=0.1),
         "midlayer.input_layernorm.weight": _norm(rs, D),
         "midlayer.hidden_norm.weight": _norm(rs, D),
         "midlayer.self_attn.q_proj.weight": _rand(rs, N * H, 2 * D),
         "midlayer.self_attn.k_proj.weight": _rand(rs, K * H, 2 * D),
         "midlayer.self_attn.v_proj.weight": _rand(rs, K * H, 2 * D),
         "midlayer.self_attn.o_proj.weight": _rand(rs, D, N * H),
         "midlayer.post_attention_layernorm.weight": _norm(rs, D),
         "midlayer.mlp.gate_proj.weight": _rand(rs, F, D),
         "midlayer.mlp.up_proj.weight": _rand(rs, F, D),
         "midlayer.mlp.down_proj.weight": _rand(rs, D, F),
         "norm.weight": _norm(rs, D),
         "lm_head.weight": _rand(rs, HOT, D, scale=1.0),
         "d2t": (used - np.arange(HOT)).astype(np.int64),
         "t2d": np.isin(np.arange(V), used),
         "embed_tokens.weight": _rand(rs, V, D)}  # a saved copy: ignored
    if qk_norm:
        t["midlayer.self_attn.q_norm.weight"] = _norm(rs, H)
        t["midlayer.self_attn.k_norm.weight"] = _norm(rs, H)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
              "num_key_value_heads": K, "head_dim": H, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-5, "rope_theta": 500.0, "vocab_size": V,
              "draft_vocab_size": HOT, "eagle_aux_hidden_state_layer_ids": AUX,
              "tie_word_embeddings": False}
    return t, config


def dflash_tensors(seed=0, layers=2):
    """z-lab DFlashDraftModel names (Qwen3 layers, no embedding or LM head)."""
    rs = np.random.RandomState(seed)
    F = 40
    t = {"fc.weight": _rand(rs, D, len(DFLASH_IDS) * D, scale=0.1),
         "hidden_norm.weight": _norm(rs, D), "norm.weight": _norm(rs, D)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": _norm(rs, D),
                  p + "self_attn.q_proj.weight": _rand(rs, N * H, D),
                  p + "self_attn.k_proj.weight": _rand(rs, K * H, D),
                  p + "self_attn.v_proj.weight": _rand(rs, K * H, D),
                  p + "self_attn.o_proj.weight": _rand(rs, D, N * H),
                  p + "self_attn.q_norm.weight": _norm(rs, H),
                  p + "self_attn.k_norm.weight": _norm(rs, H),
                  p + "post_attention_layernorm.weight": _norm(rs, D),
                  p + "mlp.gate_proj.weight": _rand(rs, F, D),
                  p + "mlp.up_proj.weight": _rand(rs, F, D),
                  p + "mlp.down_proj.weight": _rand(rs, D, F)})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
              "num_key_value_heads": K, "head_dim": H, "num_hidden_layers": layers,
              "num_target_layers": L, "rms_norm_eps": 1e-6, "rope_theta": 2000.0,
              "vocab_size": V, "block_size": BLOCK,
              "dflash_config": {"mask_token_id": MASK, "target_layer_ids": DFLASH_IDS},
              "layer_types": ["full_attention"] * layers, "tie_word_embeddings": False}
    return t, config


def write_dir(path, tensors, config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


WRITERS = {"eagle3-hf": eagle3_tensors, "dflash": dflash_tensors}


# ----------------------------------------------------------------------------- reference

def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):  # x [T,heads,H]
    inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
    f = np.concatenate([pos[:, None] * inv] * 2, axis=-1)[:, None]
    rot = np.concatenate([-x[..., H // 2:], x[..., :H // 2]], axis=-1)
    return x * np.cos(f) + rot * np.sin(f)


def _attn(q, k, v, mask):  # q [Tq,N,H], k, v [Tk,K,H], mask [Tq,Tk]
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
    s = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(H)
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqk,knh->qnh", p, v).reshape(q.shape[0], N * H)


def _mlp(x, t, p):
    g, u = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _heads(x, n):
    return x.reshape(x.shape[0], n, H)


def eagle3_reference(t, cfg, feats, toks, n):
    """First draft distribution f64[V] of SpecForge's Eagle-3 head after a prefill of n
    tokens: entry p pairs target feature p with the embedding of token p+1."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, theta, m = cfg["rms_norm_eps"], cfg["rope_theta"], "midlayer."
    emb = np.asarray(target().embed[...], np.float64)[toks[1:n + 1]]
    h = feats @ t["fc.weight"].T  # [n,D]
    x = np.concatenate([_rms(emb, t[m + "input_layernorm.weight"], eps),
                        _rms(h, t[m + "hidden_norm.weight"], eps)], axis=-1)
    q = _heads(x @ t[m + "self_attn.q_proj.weight"].T, N)
    k = _heads(x @ t[m + "self_attn.k_proj.weight"].T, K)
    v = _heads(x @ t[m + "self_attn.v_proj.weight"].T, K)
    pos = np.arange(n, dtype=np.float64)
    a = _attn(_rope(q, pos, theta), _rope(k, pos, theta), v, np.tril(np.ones((n, n), bool)))
    h = h + a @ t[m + "self_attn.o_proj.weight"].T
    out = h + _mlp(_rms(h, t[m + "post_attention_layernorm.weight"], eps), t, m)
    logits = _rms(out[-1], t["norm.weight"], eps) @ t["lm_head.weight"].T
    full = np.full(V, -np.inf)
    full[np.arange(HOT) + t["d2t"].astype(np.int64)] = logits
    return _softmax(full)


def dflash_reference(t, cfg, feats, pending, n):
    """Draft distributions f64[G,V] of z-lab's DFlash block [pending, G masks] at
    positions n..n+G over the context of positions 0..n-1."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, theta, G = cfg["rms_norm_eps"], cfg["rope_theta"], BLOCK - 1
    embed = np.asarray(target().embed[...], np.float64)
    ctx = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embed[[pending] + [MASK] * G]
    cpos, bpos = np.arange(n, dtype=np.float64), np.arange(n, n + G + 1, dtype=np.float64)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        hn = _rms(x, t[p + "input_layernorm.weight"], eps)
        qn, kn = t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"]
        wk, wv = t[p + "self_attn.k_proj.weight"], t[p + "self_attn.v_proj.weight"]
        q = _rope(_rms(_heads(hn @ t[p + "self_attn.q_proj.weight"].T, N), qn, eps), bpos, theta)
        k = np.concatenate([_rope(_rms(_heads(ctx @ wk.T, K), kn, eps), cpos, theta),
                            _rope(_rms(_heads(hn @ wk.T, K), kn, eps), bpos, theta)])
        v = np.concatenate([_heads(ctx @ wv.T, K), _heads(hn @ wv.T, K)])
        a = _attn(q, k, v, np.ones((G + 1, n + G + 1), bool))
        x = x + a @ t[p + "self_attn.o_proj.weight"].T
        x = x + _mlp(_rms(x, t[p + "post_attention_layernorm.weight"], eps), t, p)
    head = np.asarray(target().lm_head[...], np.float64)
    return _softmax(_rms(x[1:], t["norm.weight"], eps) @ head.T)


@functools.cache
def _proposer(drafter, G):
    """One jitted prefill + init + first propose per (drafter, G): equal drafters (the
    round trip's two) share the compiled code."""
    g, _ = nnx.split(target())
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP,
                     sampling=SamplingParams(temperature=1.0))

    @jax.jit
    def run(p, dparams, toks, lens):
        _, view = _prefill(nnx.merge(g, p), cfg, toks, lens, jnp.full((4,), 8, jnp.int32),
                           jax.random.key(0), G, drafter.capture)
        state = drafter.init(dparams, view, jax.random.key(1))
        _, q, _ = drafter.propose(dparams, state, view, jax.random.key(2))
        return q, view.tokens, view.hidden

    return run


def first_proposal(drafter, dparams, G):
    """(q f32[B,G,V] of the first proposal after the real prefill at temperature 1,
    tokens i32[B,S'], target hidden states [C,B,TP,D] at drafter.capture)."""
    p = nnx.split(target())[1]
    return jax.tree.map(np.asarray, _proposer(drafter, G)(p, dparams, *prompts()))


@pytest.mark.parametrize("layout", ["eagle3-hf", "dflash"])
def test_draft_distributions_match_numpy_reference(layout, tmp_path):
    t, cfg = WRITERS[layout]()
    path = write_dir(tmp_path / layout, t, cfg)
    assert detect_layout(str(path)) == layout
    drafter, dparams = load_external(str(path), target(), sampling=SamplingParams(1.0))
    G = drafter.gamma
    assert G == (7 if layout == "eagle3-hf" else BLOCK - 1)
    q, toks, hidden = first_proposal(drafter, dparams, G)
    depths = AUX if layout == "eagle3-hf" else [i + 1 for i in DFLASH_IDS]
    assert drafter.capture == tuple(depths)
    hidden = hidden.astype(np.float64)  # [C,B,TP,D] target residual stream at those depths
    for b, n in enumerate(PROMPT_LENS):
        feats = np.concatenate(list(hidden[:, b, :n]), axis=-1)  # [n, C*D], C in order
        if layout == "eagle3-hf":
            want = eagle3_reference(t, cfg, feats, toks[b], n)
            np.testing.assert_allclose(q[b, 0], want, atol=2e-5)
            assert (q[b, 0][~t["t2d"]] == 0).all()  # zero outside the hot vocabulary
        else:
            want = dflash_reference(t, cfg, feats, toks[b, n], n)
            np.testing.assert_allclose(q[b], want, atol=2e-5)


# ----------------------------------------------------------------------------- loop

@functools.cache
def ar_rows():
    g, p = nnx.split(target())
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)
    toks, lens = prompts()
    return rows(autoregressive_loop(g, p, cfg, toks, lens, jnp.asarray(BUDGETS, jnp.int32),
                                    jax.random.key(0)))


@pytest.mark.parametrize("layout,G", [("eagle3-hf", 1), ("eagle3-hf", 3), ("dflash", 3)])
def test_greedy_equals_autoregressive(layout, G, tmp_path):
    path = write_dir(tmp_path / layout, *WRITERS[layout]())
    drafter, dparams = load_external(str(path), target(), gamma=G)
    g, p = nnx.split(target())
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP)
    toks, lens = prompts()
    sp = speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                          jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0))
    assert rows(sp) == ar_rows()
    assert (np.asarray(sp.lengths) - PROMPT_LENS).tolist() == BUDGETS


# ----------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("kind,layout", [("eagle3", "eagle3-hf"), ("block", "dflash")])
def test_round_trip_keeps_draft_distributions(kind, layout, target_dir, tmp_path):
    from specjax.drafters import convert
    from specjax.drafters.io import save_drafter

    if kind == "eagle3":
        dcfg = DrafterConfig.for_target(CFG4, "eagle3")  # G 7: EAGLE-3 configs carry none
    else:
        dcfg = DrafterConfig.for_target(CFG4, "block", gamma=3, mask_token_id=MASK)
    net = build_network(dcfg, rngs=nnx.Rngs(3))
    src, dst = tmp_path / "specjax", tmp_path / layout
    save_drafter(str(src), dcfg, nnx.split(net, nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", layout, str(src), str(dst), "--dtype", "float32"]) == 0
    assert detect_layout(str(dst)) == layout and detect_layout(str(src)) is None
    sp = SamplingParams(temperature=1.0)
    d0, p0 = make_drafter(dcfg, net, target(), gamma=3, sampling=sp)
    d1, p1 = load_external(str(dst), target(), gamma=3, sampling=sp)
    assert d1.cfg == dcfg and d1.gamma == 3
    q0 = first_proposal(d0, p0, 3)[0]
    q1 = first_proposal(d1, p1, 3)[0]
    np.testing.assert_allclose(q1, q0, atol=1e-6)
    # an existing destination is refused, and a drafter the layout cannot hold too
    assert convert.main(["--to", layout, str(src), str(dst)]) == 2
    other = "dflash" if layout == "eagle3-hf" else "eagle3-hf"
    assert convert.main(["--to", other, str(src), str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------- errors

def _one_line_error(fn):
    with pytest.raises(SpecjaxError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("layout,edit,needle", [
    ("eagle3-hf", "drop:midlayer.self_attn.k_proj.weight", "k_proj.weight missing"),
    ("eagle3-hf", "shape:fc.weight", "fc.weight has shape"),
    ("eagle3-hf", "shape:d2t", "tensor d2t"),
    ("eagle3-hf", "extra:fc_norm.0.weight", "fc_norm.0.weight has no counterpart"),
    ("eagle3-hf", "config:fc_norm=true", "fc_norm=True"),
    ("eagle3-hf", "config:rope_scaling=yarn", "rope_scaling type 'yarn'"),
    ("dflash", "drop:layers.1.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight missing"),
    ("dflash", "shape:layers.0.self_attn.q_norm.weight", "q_norm.weight has shape"),
    ("dflash", "config:target_layer_ids=[3]", "target_layer_ids [3]"),
    ("dflash", "config:no_rope_theta", "rope_theta is missing"),
])
def test_malformed_directory_is_one_line_error(layout, edit, needle, tmp_path):
    t, cfg = WRITERS[layout]()
    what, _, arg = edit.partition(":")
    if what == "drop":
        del t[arg]
    elif what == "shape":
        t[arg] = t[arg][..., :-1]
    elif what == "extra":
        t[arg] = np.ones(D, np.float32)
    elif arg == "fc_norm=true":
        cfg["fc_norm"] = True
    elif arg == "rope_scaling=yarn":
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    elif arg == "target_layer_ids=[3]":
        cfg["dflash_config"]["target_layer_ids"] = [3]
    else:
        del cfg["rope_theta"]
    path = write_dir(tmp_path / layout, t, cfg)
    msg = _one_line_error(lambda: load_external(str(path), target()))
    assert needle in msg, msg


def _cli(args, capsys):
    code = decode.main([str(a) for a in args])
    return code, capsys.readouterr()


@pytest.mark.parametrize("layout", ["eagle3-hf", "dflash"])
def test_decode_cli_loads_heads_and_exits_2_on_malformed(layout, target_dir, tmp_path,
                                                         capsys):
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6, 7, 5, 6]}\n{"input_ids": [9]}\n')
    t, cfg = WRITERS[layout]()
    good = write_dir(tmp_path / "good", t, cfg)
    base = ["--target", target_dir, "--prompts", tmp_path / "p.jsonl", "--max-new-tokens", 10,
            "--summary", tmp_path / "s.json", "--drafter-dtype", "float32"]
    code, cap = _cli(base + ["--drafter", good], capsys)
    assert code == 0, cap.err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["ar_identical"] is True and summary["gamma"] == (7 if layout == "eagle3-hf"
                                                                    else BLOCK - 1)
    del t["fc.weight"]
    bad = write_dir(tmp_path / "bad", t, cfg)
    code, cap = _cli(base + ["--drafter", bad], capsys)
    assert code == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "fc.weight missing" in lines[0], cap.err
