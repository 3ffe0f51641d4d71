"""Drafters trained elsewhere (specjax.drafters.external / convert): random-weight EAGLE-3
(SpecForge / EAGLE layout, hot draft vocabulary with d2t/t2d) and DFlash (z-lab layout)
directories for a tiny target. Checks: draft distributions against a float64 numpy
reference written from the layouts' public definitions, greedy identity with
autoregressive decoding in the real loop and through decode.py, the round trip specjax
-> external layout -> specjax, and one-line errors (exit 2) for malformed directories."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import decode
from specjax.core.sampling import SamplingParams
from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop
from specjax.decoding.loop.prefill import prefill as _prefill
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.external import detect_layout, load_external
from specjax.errors import SpecjaxError
from specjax.testing.models import peaked_model
from tests.decoding.test_speculative_greedy import BUDGETS, CFG, PROMPT_LENS, TP, prompts, rows

CFG4 = dataclasses.replace(CFG, num_layers=4)  # V=48, D=32, N=4, K=2, H=16, F=64
V, D, N, K, H, L = CFG4.vocab_size, 32, 4, 2, 16, 4
HOT = 20  # the EAGLE-3 head's draft vocabulary
AUX = [2, 1, 3]  # capture depths = inputs of target layers 2, 1, 3 (outputs of 1, 0, 2)
DFLASH_IDS = [0, 1]  # target_layer_ids: outputs of layers 0, 1 = inputs of 1, 2
MASK, BLOCK = 1, 4  # mask_token_id, block_size (G = 3)


@functools.cache
def target():
    return peaked_model(CFG4, seed=0, scale=8.0)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from specjax.models.checkpoint import save_model

    d = tmp_path_factory.mktemp("target") / "target"
    save_model(target(), str(d))
    return d


# ----------------------------------------------------------------------------- writers

def _rand(rs, *shape, scale=0.3):
    return (scale * rs.standard_normal(shape)).astype(np.float32)


def _norm(rs, n):
    return (1 + 0.2 * rs.standard_normal(n)).astype(np.float32)


def eagle3_tensors(seed=0, qk_norm=False, ids="top"):
    """SpecForge LlamaForCausalLMEagle3 names; q/k/v read [embedding ; hidden] (2D).

    ids: where config.json says which target layers the head reads: "top" (vLLM's key,
    inputs of layers AUX), "nested" (SpecForge's eagle_config, outputs of layers AUX - 1)
    or "none" (every engine's default)."""
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
              "draft_vocab_size": HOT, "tie_word_embeddings": False}
    if ids == "top":
        config["eagle_aux_hidden_state_layer_ids"] = AUX
    elif ids == "nested":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in AUX],
                                  "use_aux_hidden_state": True}
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


# Which target layers each engine feeds a head, as capture depths (input of layer d, HF
# hidden_states[d]), written from the engines' own code, not from specjax's reading.

def vllm_eagle3_depths(cfg):
    """vllm `eagle3_utils.get_eagle3_aux_layers_from_config`: the top-level key, else the
    model's default; `LlamaModel.forward` appends hidden + residual BEFORE layer idx."""
    return list(cfg.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3])


def sglang_eagle3_depths(cfg):
    """sglang `set_eagle3_layers_to_capture(eagle_config ids)` (after PR #25454): default
    [2, L//2, L-3]; explicit ids + 1 when the first is 1; its loop captures before layer i."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [2, L // 2, L - 3]
    return [i + 1 for i in ids] if ids[0] == 1 else list(ids)


def specforge_eagle3_depths(cfg):
    """SpecForge `resolve_eagle_capture_layers` (eagle_config ids, default [1, L//2-1,
    L-4]) with HFEagle3TargetModel's forward hooks on those layers' OUTPUTS."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [i + 1 for i in (ids if ids is not None else [1, L // 2 - 1, L - 4])]


def zlab_dflash_depths(cfg):
    """z-lab `DFlashDraftModel`: dflash_config.target_layer_ids or build_target_layer_ids
    (L//2 for one draft layer; else spread over 1..L-3), read by extract_context_feature
    at hidden_states[id + 1]."""
    n, Lt = cfg["num_hidden_layers"], cfg.get("num_target_layers", L)
    ids = cfg["dflash_config"].get("target_layer_ids")
    if ids is None:
        ids = [Lt // 2] if n == 1 else [int(round(1 + i * (Lt - 4) / (n - 1)))
                                        for i in range(n)]
    return [i + 1 for i in ids]


def vllm_dflash_depths(cfg):
    """vllm `get_eagle3_aux_layers_from_config` for a DFlash head: the top-level EAGLE key
    first (layer inputs), else dflash_config.target_layer_ids + 1."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    return list(top) if top else [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]


def _qk_norm(x, t, name, eps):  # Qwen3: RMSNorm over each head, before RoPE
    w = t.get(f"midlayer.self_attn.{name}.weight")
    return x if w is None else _rms(x, w, eps)


def eagle3_reference(t, cfg, feats, toks, n, drafts):
    """Draft distributions f64[G,V] of an EAGLE-3 head (SafeAILab/EAGLE `cnets.py`
    topK_genrate, SpecForge `llama3_eagle.py`) after a prefill of n tokens: step 1 runs
    entries 0..n-1 (entry p pairs target feature p with the embedding of token p+1);
    step j >= 2 adds one entry at position n+j-2 pairing the previous step's pre-norm
    output with the embedding of draft token j-1 (drafts [G-1]), attending to every
    earlier entry. Optional Qwen3 q/k norms."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, theta, m = cfg["rms_norm_eps"], cfg["rope_theta"], "midlayer."
    embed = np.asarray(target().embed[...], np.float64)
    keys, vals, out = [], [], []

    def layer(emb, h, pos):  # emb, h [T,D] -> new entries' output [T,D]
        x = np.concatenate([_rms(emb, t[m + "input_layernorm.weight"], eps),
                            _rms(h, t[m + "hidden_norm.weight"], eps)], axis=-1)
        q = _qk_norm(_heads(x @ t[m + "self_attn.q_proj.weight"].T, N), t, "q_norm", eps)
        k = _qk_norm(_heads(x @ t[m + "self_attn.k_proj.weight"].T, K), t, "k_norm", eps)
        keys.append(_rope(k, pos, theta))
        vals.append(_heads(x @ t[m + "self_attn.v_proj.weight"].T, K))
        allk, allv = np.concatenate(keys), np.concatenate(vals)
        T, S = len(pos), len(allk)
        a = _attn(_rope(q, pos, theta), allk, allv, np.tril(np.ones((T, S), bool), S - T))
        h = h + a @ t[m + "self_attn.o_proj.weight"].T
        return h + _mlp(_rms(h, t[m + "post_attention_layernorm.weight"], eps), t, m)

    def dist(h):
        logits = _rms(h, t["norm.weight"], eps) @ t["lm_head.weight"].T
        full = np.full(V, -np.inf)
        full[np.arange(len(logits)) + t["d2t"].astype(np.int64)] = logits
        return _softmax(full)

    h = layer(embed[toks[1:n + 1]], feats @ t["fc.weight"].T, np.arange(n, dtype=np.float64))
    h = h[-1:]
    out.append(dist(h[0]))
    for j, d in enumerate(drafts):
        h = layer(embed[[d]], h, np.array([n + j], np.float64))
        out.append(dist(h[0]))
    return np.stack(out)


def dflash_reference(t, cfg, feats, pending, n):
    """Draft distributions f64[G,V] of z-lab's DFlash block [pending, G masks] at
    positions n..n+G over the context of positions 0..n-1."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, theta, G = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["block_size"] - 1
    embed = np.asarray(target().embed[...], np.float64)
    ctx = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embed[[pending] + [cfg["dflash_config"]["mask_token_id"]] * G]
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
        draft, q, _ = drafter.propose(dparams, state, view, jax.random.key(2))
        return q, view.tokens, view.hidden, draft

    return run


def first_proposal(drafter, dparams, G):
    """(q f32[B,G,V] of the first proposal after the real prefill at temperature 1,
    tokens i32[B,S'], target hidden states [C,B,TP,D] at drafter.capture, draft
    i32[B,G])."""
    p = nnx.split(target())[1]
    return jax.tree.map(np.asarray, _proposer(drafter, G)(p, dparams, *prompts()))


@pytest.mark.parametrize("layout,variant", [("eagle3-hf", "top"), ("eagle3-hf", "nested-qk"),
                                            ("eagle3-hf", "none"), ("dflash", "")])
def test_draft_distributions_match_numpy_reference(layout, variant, tmp_path):
    """Every draft step 1..G of a head equals the reference of its producer's code, fed
    the target layers that the engine reading its ids would capture."""
    if layout == "eagle3-hf":
        t, cfg = eagle3_tensors(qk_norm=variant.endswith("qk"), ids=variant.split("-")[0])
        depths = (vllm_eagle3_depths(cfg) if variant == "top" else
                  specforge_eagle3_depths(cfg))
        if variant != "top":  # SpecForge's key (or none: SafeAILab/EAGLE's release configs)
            assert specforge_eagle3_depths(cfg) == sglang_eagle3_depths(cfg)
        if variant == "none":
            assert depths == vllm_eagle3_depths(cfg) == [2, L // 2, L - 3]
    else:
        t, cfg = dflash_tensors()
        depths = zlab_dflash_depths(cfg)
        assert depths == vllm_dflash_depths(cfg)
    path = write_dir(tmp_path / layout, t, cfg)
    assert detect_layout(str(path)) == layout
    drafter, dparams = load_external(str(path), target(), sampling=SamplingParams(1.0))
    G = drafter.gamma
    assert G == (7 if layout == "eagle3-hf" else BLOCK - 1)
    q, toks, hidden, draft = first_proposal(drafter, dparams, G)
    assert drafter.capture == tuple(depths)
    hidden = hidden.astype(np.float64)  # [C,B,TP,D] target residual stream at those depths
    for b, n in enumerate(PROMPT_LENS):
        feats = np.concatenate(list(hidden[:, b, :n]), axis=-1)  # [n, C*D], C in order
        if layout == "eagle3-hf":
            want = eagle3_reference(t, cfg, feats, toks[b], n, draft[b, :-1])
            np.testing.assert_allclose(q[b], want, atol=2e-5)
            assert (q[b][:, ~t["t2d"]] == 0).all()  # zero outside the hot vocabulary
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
    from specjax.drafters.io import save_drafter
    from specjax.tools import convert

    if kind == "eagle3":  # G 7: EAGLE-3 configs carry none; the engines run no q/k norms
        dcfg = dataclasses.replace(DrafterConfig.for_target(CFG4, "eagle3", qk_norm=False),
                                   capture=tuple(AUX))
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
    q0, toks, hidden, _ = first_proposal(d0, p0, 3)
    q1 = first_proposal(d1, p1, 3)[0]
    np.testing.assert_allclose(q1, q0, atol=1e-6)
    if layout == "dflash":  # read back by z-lab's and vLLM's readings and forward
        from safetensors.numpy import load_file

        cfg = json.loads((dst / "config.json").read_text())
        t = load_file(str(dst / "model.safetensors"))
        assert zlab_dflash_depths(cfg) == vllm_dflash_depths(cfg) == list(dcfg.capture)
        hidden = hidden.astype(np.float64)
        for b, n in enumerate(PROMPT_LENS):
            feats = np.concatenate(list(hidden[:, b, :n]), axis=-1)
            np.testing.assert_allclose(q0[b], dflash_reference(t, cfg, feats, toks[b, n], n),
                                       atol=2e-5)
    # an existing destination is refused, and a drafter the layout cannot hold too
    assert convert.main(["--to", layout, str(src), str(dst)]) == 2
    other = "dflash" if layout == "eagle3-hf" else "eagle3-hf"
    assert convert.main(["--to", other, str(src), str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------- conventions

@pytest.mark.parametrize("top,nested,want", [
    (AUX, None, AUX),                              # vLLM's key: layer inputs
    (None, [a - 1 for a in AUX], AUX),             # SpecForge's: layer outputs (first id 1)
    ([2, 1, 3], [1, 0, 2], AUX),                   # both, naming the same layers
    ([2, 1, 3], [2, 1, 3], AUX),                   # both (SGLang: first id 2 = inputs)
    (None, None, [2, L // 2, L - 3]),              # neither: every engine's default
    (None, [2, 1, 3], "does not start at 1"),      # SpecForge outputs, SGLang inputs
    ([1, 2, 3], [1, 2, 3], "name different layers"),  # vLLM 1,2,3 but SGLang 2,3,4
    ([1, 2], None, "must be a list of 3 integer"),
    ([2, 1, 9], None, "a target of 4 layers has inputs 0..4"),
])
def test_eagle3_layer_ids_read_as_the_engines_read_them(top, nested, want, tmp_path):
    from specjax.drafters.external import read_external

    t, cfg = eagle3_tensors(ids="none")
    if top is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = top
    if nested is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": nested}
    path = write_dir(tmp_path / "h", t, cfg)
    if isinstance(want, str):
        assert want in _one_line_error(lambda: read_external(str(path), CFG4))
        return
    assert list(read_external(str(path), CFG4).dcfg.capture) == want
    # the engine that reads each key present captures those layers too
    if top is not None:
        assert vllm_eagle3_depths(cfg) == want
    if nested is not None:
        assert sglang_eagle3_depths(cfg) == want
    if top is None:
        assert sglang_eagle3_depths(cfg) == specforge_eagle3_depths(cfg) == want
    if top is None and nested is None:
        assert vllm_eagle3_depths(cfg) == want


@pytest.mark.parametrize("layers,ids,top", [(1, None, None), (2, None, None), (3, None, None),
                                            (2, [0, 1], None), (2, [0, 1], [1, 3])])
def test_dflash_layer_ids_default_and_precedence(layers, ids, top, tmp_path):
    """No target_layer_ids: z-lab's build_target_layer_ids (L//2 for one layer, not
    specjax's own L//2 - 1); a top-level EAGLE key wins as in vLLM."""
    from specjax.drafters.external import read_external

    t, cfg = dflash_tensors(layers=layers)
    n = len(ids or zlab_dflash_depths({**cfg, "dflash_config": {}}))
    t["fc.weight"] = t["fc.weight"][:, :D].repeat(len(top or [0] * n), axis=1)
    cfg["num_hidden_layers"] = layers
    if ids is None:
        del cfg["dflash_config"]["target_layer_ids"]
    else:
        cfg["dflash_config"]["target_layer_ids"] = ids
    if top is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = top
    got = list(read_external(str(write_dir(tmp_path / "h", t, cfg)), CFG4).dcfg.capture)
    assert got == vllm_dflash_depths(cfg) if ids else got == zlab_dflash_depths(cfg)
    if layers == 1 and ids is None:
        assert got == [L // 2 + 1]  # output of layer L//2


@pytest.mark.parametrize("edit,needle", [
    ("projector_type=dflash", None),  # what SpecForge writes for a plain DFlash head
    ("projector_type=dspark", None),  # loads (DSpark: tests/drafters/test_dspark.py)
    ("projector_type=domino", "projector_type='domino'"),
    ("mask_embedding.pt", "trained mask embedding is not supported"),
    ("attention_mode=mla", "attention_mode='mla'"),
    ("head_dim=8", "attention shapes"),
])
def test_dflash_what_is_not_supported_is_said(edit, needle, tmp_path):
    from specjax.drafters.external import read_external

    t, cfg = dflash_tensors()
    key, _, value = edit.partition("=")
    if key in ("projector_type", "attention_mode"):
        cfg["dflash_config"][key] = value
    elif key == "head_dim":  # a head built for another attention layout (N 8 x H 8)
        cfg.update(head_dim=8, num_attention_heads=8, num_key_value_heads=4)
        for name in list(t):
            if "q_norm" in name or "k_norm" in name:
                t[name] = t[name][:8]
    path = write_dir(tmp_path / "h", t, cfg)
    if key == "mask_embedding.pt":
        (path / key).write_bytes(b"\x80\x02")  # never unpickled
    if needle is None:
        assert read_external(str(path), CFG4).dcfg.kind == "block"
        return
    msg = _one_line_error(lambda: read_external(str(path), CFG4))
    assert needle in msg and "built for another target" not in msg, msg


# ----------------------------------------------------------------------------- export

EAGLE3_NAMES = {  # what LlamaForCausalLMEagle3 loads (SpecForge llama3_eagle.py, vllm)
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
        "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))}


def test_eagle3_export_drafts_what_specjax_drafts_in_every_engine(target_dir, tmp_path):
    """An eagle3 drafter with a hot vocabulary, exported: only LlamaForCausalLMEagle3's
    tensors, ids that vLLM, SGLang and SpecForge each read as the drafter's capture
    depths, and the producers' forward over the export drafts every step as specjax
    drafts with the source directory."""
    from safetensors.numpy import load_file

    from specjax.drafters.io import save_drafter
    from specjax.drafters.vocab import load_draft_vocab, save_draft_vocab
    from specjax.tools import convert

    dcfg = dataclasses.replace(DrafterConfig.for_target(CFG4, "eagle3", qk_norm=False),
                               capture=tuple(AUX))
    net = build_network(dcfg, rngs=nnx.Rngs(5))
    nnx.update(net, jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x,
                                 nnx.state(net, nnx.Param)))  # opinionated drafts
    src, dst = tmp_path / "specjax", tmp_path / "eagle3-hf"
    save_drafter(str(src), dcfg, nnx.split(net, nnx.Param, ...)[1], str(target_dir))
    counts = np.random.RandomState(1).randint(0, 100, V)
    save_draft_vocab(str(src), counts, HOT, "test")
    hot = load_draft_vocab(str(src), V)
    assert convert.main(["--to", "eagle3-hf", str(src), str(dst), "--dtype", "float32"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    t = load_file(str(dst / "model.safetensors"))
    assert set(t) == EAGLE3_NAMES and cfg["draft_vocab_size"] == HOT
    assert (np.arange(HOT) + t["d2t"] == hot).all() and t["t2d"].sum() == HOT
    for reader in (vllm_eagle3_depths, sglang_eagle3_depths, specforge_eagle3_depths):
        assert reader(cfg) == AUX, reader.__name__
    sp = SamplingParams(temperature=1.0)
    d0, p0 = make_drafter(dcfg, net, target(), gamma=4, sampling=sp, draft_vocab=hot)
    q, toks, hidden, draft = first_proposal(d0, p0, 4)
    hidden = hidden.astype(np.float64)
    for b, n in enumerate(PROMPT_LENS):
        feats = np.concatenate(list(hidden[:, b, :n]), axis=-1)
        want = eagle3_reference(t, cfg, feats, toks[b], n, draft[b, :-1])
        np.testing.assert_allclose(q[b], want, atol=2e-5)
    d1, p1 = load_external(str(dst), target(), gamma=4, sampling=sp)  # and specjax's reading
    np.testing.assert_allclose(first_proposal(d1, p1, 4)[0], q, atol=1e-6)


@pytest.mark.parametrize("change,needle", [
    ("qk_norm", "train it with drafter.qk_norm: false"),
    ("capture=0,2,4", "the first depth must be 2"),
    ("capture=3,1,2", "the first depth must be 2"),
])
def test_eagle3_export_refuses_what_the_engines_would_misread(change, needle, target_dir,
                                                               tmp_path, capsys):
    from specjax.drafters.io import save_drafter
    from specjax.tools import convert

    dcfg = dataclasses.replace(DrafterConfig.for_target(CFG4, "eagle3", qk_norm=False),
                               capture=tuple(AUX))
    if change == "qk_norm":
        dcfg = dataclasses.replace(dcfg, qk_norm=True)
    else:
        dcfg = dataclasses.replace(dcfg, capture=tuple(map(int, change[8:].split(","))))
    src = tmp_path / "specjax"
    save_drafter(str(src), dcfg, nnx.split(build_network(dcfg, rngs=nnx.Rngs(0)),
                                           nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", "eagle3-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


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
    ("eagle3-hf", "nan:midlayer.mlp.up_proj.weight", "up_proj.weight has NaN or Inf"),
    ("dflash", "inf:layers.1.self_attn.q_norm.weight", "q_norm.weight has NaN or Inf"),
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
    elif what in ("nan", "inf"):
        t[arg].flat[3] = np.nan if what == "nan" else -np.inf
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
            "--summary", tmp_path / "s.json", "--drafter-dtype", "float32", "--gamma", "fixed"]
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


def test_the_default_eagle3_config_exports_to_the_engines(target_dir, tmp_path):
    """What train.py makes from configs/drafters/eagle3.yaml (the README's flow) exports with
    `convert --to eagle3-hf` and reads back as the engines read it: no q/k norms by default
    for eagle3 (issue 53), the forward equal to the float64 EAGLE-3 reference."""
    from safetensors.numpy import load_file

    from specjax.drafters.io import save_drafter
    from specjax.tools import convert
    from specjax.train.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tcfg = load_config(os.path.join(root, "configs", "drafters", "eagle3.yaml"),
                       target=str(target_dir), run_dir=str(tmp_path / "run"))
    from specjax.models.config import ModelConfig

    demo = tcfg.drafter.for_target(ModelConfig.from_dir(os.path.join(root, "checkpoints",
                                                                     "demo", "target")))
    assert demo.capture[0] == 2 and demo.qk_norm is False  # exportable for the demo target
    # the same settings at this test's 4-layer target (whose default depths [0, 2, 4] the
    # engines cannot share; the demo's above they can)
    dcfg = dataclasses.replace(tcfg.drafter.for_target(CFG4), capture=tuple(AUX))
    assert dcfg.kind == "eagle3" and dcfg.qk_norm is False
    net = build_network(dcfg, rngs=nnx.Rngs(7))
    src, dst = tmp_path / "specjax", tmp_path / "eagle3-hf"
    save_drafter(str(src), dcfg, nnx.split(net, nnx.Param, ...)[1], str(target_dir))
    assert convert.main(["--to", "eagle3-hf", str(src), str(dst), "--dtype", "float32"]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    t = load_file(str(dst / "model.safetensors"))
    for reader in (vllm_eagle3_depths, sglang_eagle3_depths, specforge_eagle3_depths):
        assert reader(cfg) == list(dcfg.capture), reader.__name__
    sp = SamplingParams(temperature=1.0)
    d0, p0 = make_drafter(dcfg, net, target(), gamma=3, sampling=sp)
    q, toks, hidden, draft = first_proposal(d0, p0, 3)
    hidden = hidden.astype(np.float64)
    for b, n in enumerate(PROMPT_LENS):
        feats = np.concatenate(list(hidden[:, b, :n]), axis=-1)
        np.testing.assert_allclose(q[b], eagle3_reference(t, cfg, feats, toks[b], n,
                                                          draft[b, :-1]), atol=2e-5)
    # the default without the config's line: off for eagle3, on for the other kinds
    assert dataclasses.replace(tcfg.drafter, qk_norm=None).qk_norm is False
    assert dataclasses.replace(tcfg.drafter, kind="kv", qk_norm=None).qk_norm is True
