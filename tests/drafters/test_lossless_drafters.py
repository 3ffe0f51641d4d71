"""Losslessness of every drafter over several rounds (issue 27, part 3).

Through the real speculative loop, B identical rows of a 6-token-vocabulary target
generate N_NEW = 5 tokens at G = 2: the first comes from the prefill and the other four
from at least two rounds (a round emits at most G + 1 = 3), so the later tokens follow
partial acceptances, rewinds and drafter updates. Their law must be the target's exact
filtered law over 5 tokens, enumerated in float64 (specjax/testing/distribution.py). The 6**5
joint has too many cells for a TV test of 2.5e4 samples to see a small bias, so the
statistic (`distribution.projection_test`) also looks at every position's marginal,
every adjacent pair and every run of three, one threshold for the whole family from a
simulated null. Power checks: a drafter that reports a stale q after its first round,
and the biased verifiers of tests/decoding/test_distribution.py, must fail the same test.

Every drafter: the draft LM, n-gram lookup (one-hot q), the test-only oracle drafter
(specjax/testing/oracle.py: a recording, each token kept with probability 0.7), eagle3 and hybrid (also with
--draft-stop's one-hot fillers), kv, block with context hidden / kv / both, and the two imported layouts (an EAGLE-3 head with its own
hot vocabulary, d2t; a DFlash head), both written here for the tiny 2-layer target and
read by `specjax.drafters.external.load_external`. One loop call verifies half of its
rows with token-level and half with block verification (`token_and_block`, the
library's `verify_token` / `verify_block` on the two halves), so each compiled loop
checks both rules; the cases with `LoopConfig(kernels="reference")` (the fused
verification of `pallas_kernels.verify`, decode.py's CPU default, which takes its rule
by name) run one rule each. T = 1, top-k, top-p, hot draft vocabularies and the two
kernel settings are spread over the drafters; each case asserts that its drafts are
both accepted and rejected. The default run has one case per drafter path; the rest
are `slow`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from safetensors.numpy import save_file

from specjax.core.sampling import SamplingParams
from specjax.decoding.adaptive import GammaSchedule
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.decoding.verify import Verdict, verify_block, verify_token
from specjax.drafters import DrafterConfig, build_network, make_drafter
from specjax.drafters.draft_lm import DraftLMDrafter
from specjax.drafters.external import load_external
from specjax.drafters.ngram import NgramDrafter
from specjax.testing import distribution as du
from specjax.testing.oracle import OracleDrafter
from tests.decoding.test_distribution import BIASED

V = du.V
CFG2 = dataclasses.replace(du.CFG, num_layers=2)  # D 16, N 2, K 1, H 8, F 32
PROMPT = (1, 4, 2)
PROMPT_WIDTH = 4  # right-padded with PAD
PAD = 5  # also the block drafters' mask token
N_NEW = 5
GAMMA = 2
BATCH = 25_000  # rows per rule: a `token_and_block` loop call runs twice as many
LEVEL = 0.999

PLAIN = SamplingParams(temperature=1.0)
# Filter settings far (>= 5e-3 in f64) from a decision boundary in every 5-token context.
TOP_K = SamplingParams(temperature=1.0, top_k=4)
TOP_P = SamplingParams(temperature=1.0, top_p=0.77)
HOT = (0, 2, 3, 5)  # a hot draft vocabulary: q is 0 on ids 1 and 4
EAGLE_HOT = (0, 1, 3, 4)  # the imported EAGLE-3 head's own (d2t) vocabulary


def _id(x):
    if isinstance(x, SamplingParams):
        return "plain" if x == PLAIN else ("topk" if x == TOP_K else "topp")
    if isinstance(x, tuple):
        return "hot"
    return None


# ----------------------------------------------------------------------------- models

@functools.cache
def _target():
    return du.scaled_model(1, 25.0, CFG2)


def _opinionated(net, scale=25.0):
    """Scales a random drafter's non-square matrices (as test_drafters_distribution.py)
    so its q is far from uniform and disagrees with the target's p."""
    state = nnx.state(net, nnx.Param)
    nnx.update(net, jax.tree.map(
        lambda x: x * scale if x.ndim >= 2 and x.shape[-1] != x.shape[-2] else x, state))
    return net


def _rand(rs, *shape, scale=1.0):
    return (scale * rs.standard_normal(shape)).astype(np.float32)


def _norm(rs, n):
    return (1 + 0.2 * rs.standard_normal(n)).astype(np.float32)


def _layer(rs, t, prefix, D, N, K, H, F, qk_norm, din=None):
    din = din or D
    t.update({prefix + "self_attn.q_proj.weight": _rand(rs, N * H, din),
              prefix + "self_attn.k_proj.weight": _rand(rs, K * H, din),
              prefix + "self_attn.v_proj.weight": _rand(rs, K * H, din),
              prefix + "self_attn.o_proj.weight": _rand(rs, D, N * H),
              prefix + "post_attention_layernorm.weight": _norm(rs, D),
              prefix + "mlp.gate_proj.weight": _rand(rs, F, D),
              prefix + "mlp.up_proj.weight": _rand(rs, F, D),
              prefix + "mlp.down_proj.weight": _rand(rs, D, F, scale=0.5)})
    if qk_norm:
        t[prefix + "self_attn.q_norm.weight"] = _norm(rs, H)
        t[prefix + "self_attn.k_norm.weight"] = _norm(rs, H)


def eagle3_dir(path: Path, seed=0) -> Path:
    """A SpecForge-layout EAGLE-3 head for the tiny target (LlamaForCausalLMEagle3:
    midlayer q/k/v over [embedding ; hidden], its own LM head over the hot vocabulary
    EAGLE_HOT with d2t/t2d, features at the inputs of target layers 0, 1, 2)."""
    c = CFG2
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, 24
    rs = np.random.RandomState(seed)
    used = np.asarray(EAGLE_HOT)
    t = {"fc.weight": _rand(rs, D, 3 * D, scale=0.5),
         "midlayer.input_layernorm.weight": _norm(rs, D),
         "midlayer.hidden_norm.weight": _norm(rs, D),
         "norm.weight": _norm(rs, D),
         "lm_head.weight": _rand(rs, len(used), D, scale=1.5),
         "d2t": (used - np.arange(len(used))).astype(np.int64),
         "t2d": np.isin(np.arange(V), used)}
    _layer(rs, t, "midlayer.", D, N, K, H, F, qk_norm=False, din=2 * D)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
              "num_key_value_heads": K, "head_dim": H, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-6, "rope_theta": 500.0, "vocab_size": V,
              "draft_vocab_size": len(used), "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    return _write(path, t, config)


def dflash_dir(path: Path, seed=0, hot=None) -> Path:
    """A z-lab-layout DFlash head for the tiny target (2 Qwen3 layers, block_size G+1,
    the target's embedding and LM head, features at the output of target layer 0);
    `hot`: a draft_vocab.json beside it (read by load_external's draft_vocab="auto")."""
    c = CFG2
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, 24
    rs = np.random.RandomState(seed)
    t = {"fc.weight": _rand(rs, D, D, scale=0.5), "hidden_norm.weight": _norm(rs, D),
         "norm.weight": _norm(rs, D)}
    for i in range(2):
        t[f"layers.{i}.input_layernorm.weight"] = _norm(rs, D)
        _layer(rs, t, f"layers.{i}.", D, N, K, H, F, qk_norm=True)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
              "num_key_value_heads": K, "head_dim": H, "num_hidden_layers": 2,
              "num_target_layers": c.num_layers, "rms_norm_eps": 1e-6, "rope_theta": 2000.0,
              "vocab_size": V, "block_size": GAMMA + 1,
              "dflash_config": {"mask_token_id": PAD, "target_layer_ids": [0]},
              "layer_types": ["full_attention"] * 2}
    _write(path, t, config)
    if hot is not None:
        (path / "draft_vocab.json").write_text(json.dumps({"size": len(hot), "ids": list(hot)}))
    return path


def _write(path: Path, tensors, config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


LEARNED = {"eagle3": ("eagle3", None), "kv": ("kv", None), "hybrid": ("hybrid", None),
           "block-hidden": ("block", "hidden"), "block-kv": ("block", "kv"),
           "block-both": ("block", "both"), "medc": ("medc", None)}


@functools.cache
def _drafter(name: str, sp: SamplingParams, hot: tuple[int, ...] | None = None):
    """(drafter, params) of one drafter path for the tiny target, drafting with sp."""
    target = _target()
    if name == "draft-lm":
        assert hot is None
        return DraftLMDrafter.create(du.scaled_model(2, 25.0), GAMMA, sp, V)
    if name == "ngram":
        assert hot is None
        return NgramDrafter(GAMMA, V, sampling=sp), ()
    if name == "oracle":  # the 8B round's controlled-acceptance drafter: one recording
        assert hot is None  # (any tokens: a proposal source) for every row
        rec = np.asarray([PROMPT + (3, 0, 2, 2, 4, 1, 0, 3)], np.int32)
        return OracleDrafter(GAMMA, V, sampling=sp), {"tokens": jnp.asarray(rec),
                                                       "acceptance": jnp.float32(0.7)}
    if name in ("eagle3-hf", "dflash"):
        with tempfile.TemporaryDirectory() as tmp:
            if name == "eagle3-hf":
                assert hot == EAGLE_HOT  # its own vocabulary, from d2t
                path = eagle3_dir(Path(tmp) / name)
            else:
                path = dflash_dir(Path(tmp) / name, hot=hot)
            drafter, params = load_external(str(path), target, gamma=GAMMA, sampling=sp,
                                            draft_vocab="auto")
        if hot is not None:
            np.testing.assert_array_equal(np.asarray(params["draft_ids"]), hot)
        else:
            assert "draft_ids" not in params
        return drafter, params
    reuse = name.endswith("-reuse")  # medc --draft-reuse, at G = 3 so that a forward
    if reuse:  # can be reused (in a step after a rejection of the first draft)
        name = name[:-len("-reuse")]
    stop = 0.0
    if name.endswith("-stop"):  # --draft-stop 1: every round stops after its first
        # draft, fillers (one-hot q) follow; with reuse 0.5, so that some rounds go on
        name, stop = name[:-len("-stop")], 0.5 if reuse else 1.0
    kind, context = LEARNED[name]
    dcfg = DrafterConfig.for_target(CFG2, kind, gamma=GAMMA, context=context,
                                    mask_token_id=PAD if kind == "block" else None)
    if dcfg.uses_kv:  # merge both target layers' K/V (for_target picks one here)
        dcfg = dataclasses.replace(dcfg, kv_layers=(0, 1))
    net = _opinionated(build_network(dcfg, rngs=nnx.Rngs(7)))
    drafter, params = make_drafter(dcfg, net, target, gamma=3 if reuse else GAMMA,
                                   sampling=sp, draft_vocab=hot, stop_below=stop)
    return (dataclasses.replace(drafter, reuse=True) if reuse else drafter), params


# ----------------------------------------------------------------------------- loop

def token_and_block(draft, q, p, key):
    """The first half of the rows verified by `verify_token`, the second half by
    `verify_block` (independent keys): one compiled loop checks both rules."""
    h = draft.shape[0] // 2
    k_tok, k_blk = jax.random.split(key)
    a = verify_token(draft[:h], q[:h], p[:h], k_tok)
    b = verify_block(draft[h:], q[h:], p[h:], k_blk)
    return Verdict(jnp.concatenate([a.num_accepted, b.num_accepted]),
                   jnp.concatenate([a.next_token, b.next_token]))


def biased_token_and_block(draft, q, p, key):
    """As `token_and_block` with the classic mistakes of tests/decoding/test_distribution.py:
    token-level resampling from p after a rejection; block verification stopping at the
    first failure."""
    h = draft.shape[0] // 2
    k_tok, k_blk = jax.random.split(key)
    a = BIASED["token_resample_from_p"](draft[:h], q[:h], p[:h], k_tok)
    b = BIASED["block_early_stop"](draft[h:], q[h:], p[h:], k_blk)
    return Verdict(jnp.concatenate([a.num_accepted, b.num_accepted]),
                   jnp.concatenate([a.next_token, b.next_token]))


VERIFY = {"both": token_and_block, "token": "token", "block": "block",
          "biased": biased_token_and_block}


@struct.dataclass
class _StaleState:
    inner: object
    last_q: jax.Array  # f32[B,G,V] the previous proposal's q
    rounds: jax.Array  # i32 proposals so far


@dataclasses.dataclass(frozen=True)
class StaleQDrafter:
    """A broken drafter for the power check: honest in its first round; from the second
    on it reports the q of its previous proposal beside its fresh draft (what a drafter
    returns when it forgets to rebuild its state after a rejection). Rounds after the
    first are then not lossless; the first-round tokens are."""

    inner: object

    @property
    def gamma(self):
        return self.inner.gamma

    @property
    def capture(self):
        return self.inner.capture

    @property
    def sampling(self):
        return self.inner.sampling

    def init(self, params, view, key):
        B = view.lengths.shape[0]
        return _StaleState(self.inner.init(params, view, key),
                           jnp.zeros((B, self.gamma, V), jnp.float32), jnp.int32(0))

    def propose(self, params, state, view, key):
        draft, q, inner = self.inner.propose(params, state.inner, view, key)
        told = jnp.where(state.rounds > 0, state.last_q, q)
        return draft, told, _StaleState(inner, q, state.rounds + 1)

    def update(self, params, state, view, num_accepted):
        return state.replace(inner=self.inner.update(params, state.inner, view, num_accepted))


@functools.cache
def _run(name, verify, sp, hot=None, kernels="off", stale=False, seed=0, batch=None,
         num_drafts=1, schedule=False):
    """One loop call over `batch` copies of PROMPT (None: BATCH per rule) -> (tokens
    i32[B,N_NEW], steps i32[B], accepted i32[B,G]). num_drafts > 1: K drafts per step,
    verified as one draft tree (`LoopConfig.num_drafts`). schedule: a random draft length
    in {0, 1, G} every step (`specjax.decoding.adaptive`, policy "random")."""
    batch = batch or BATCH * (2 if callable(VERIFY[verify]) else 1)
    drafter, dparams = _drafter(name, sp, hot)
    if stale:
        drafter = StaleQDrafter(drafter)
    g, params = nnx.split(_target())
    G = drafter.gamma
    reuse = getattr(drafter, "reuse", False)
    # under reuse the short choice drafts 2, so that a step can reuse the one before
    sched = (GammaSchedule((0, 2 if reuse else 1, G), policy="random") if schedule
             else None)
    lc = LoopConfig(max_length=len(PROMPT) + N_NEW, prompt_width=PROMPT_WIDTH, sampling=sp,
                    verify=VERIFY[verify], kernels=kernels, num_drafts=num_drafts,
                    schedule=sched)
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    res = speculative_loop(g, params, drafter, dparams, lc,
                           jnp.asarray(np.tile(prompt, (batch, 1))),
                           jnp.full((batch,), len(PROMPT), jnp.int32),
                           jnp.full((batch,), N_NEW, jnp.int32), jax.random.key(seed))
    Tp = len(PROMPT)
    tokens, lengths = np.asarray(res.tokens), np.asarray(res.lengths)
    assert (lengths == Tp + N_NEW).all(), "every row must emit exactly its budget"
    assert (tokens[:, :Tp] == PROMPT).all()
    steps = np.asarray(res.steps)
    # A round emits at most G + 1 tokens: the last N_NEW - 1 need two rounds or more at
    # G = 2 (at G = 4 a row may finish in one; the reuse check below needs later rounds).
    assert (steps >= -(-(N_NEW - 1) // (G + 1))).all()
    assert steps.min() >= 2 or G + 1 >= N_NEW - 1
    if reuse and not schedule:  # the reuse path really ran (a random schedule may
        # never draft twice in a row; tests/drafters/test_medc_reuse.py covers reuse under one)
        reused, drafted = (int(x) for x in res.drafter["reused"][:2])
        assert 0 < reused < drafted, (reused, drafted)
    if schedule:  # one schedule for the whole batch: at least two lengths in it
        assert (np.asarray(res.ext["adaptive"]["chosen"]) > 0).sum() >= 2, res.ext
    return tokens[:, Tp:Tp + N_NEW], steps, np.asarray(res.accepted)


@functools.cache
def _exact(sp: SamplingParams):
    joint, margin = du.exact_joint(_target(), PROMPT, N_NEW, sp.temperature, sp.top_k,
                                   sp.top_p)
    assert margin > 1e-3, f"filter boundary margin {margin:.2e} too small for {sp}"
    return joint


@functools.cache
def _null(sp: SamplingParams, n: int):
    return du.projection_null(_exact(sp), n, LEVEL)


def _halves(verify, batch):
    h = batch // 2
    if verify in ("both", "biased"):
        return {"token": slice(0, h), "block": slice(h, batch)}
    return {verify: slice(0, batch)}


def _check(name, verify, sp, hot=None, kernels="off", stale=False, num_drafts=1,
           schedule=False):
    """-> {rule: (statistic, threshold, worst view, acceptance of draft 1, of draft G
    (of draft 2 under reuse))}.
    Each case draws with its own seed (cases that share a drafter would otherwise
    share most of their randomness)."""
    tag = f" K={num_drafts}" if num_drafts > 1 else ""
    tag += " adaptive" if schedule else ""
    seed = zlib.crc32(f"{name} {verify} {sp} {hot} {kernels} {stale}{tag}".encode())
    tokens, steps, accepted = _run(name, verify, sp, hot, kernels, stale, seed,
                                   num_drafts=num_drafts, schedule=schedule)
    exact = _exact(sp)
    out = {}
    for rule, rows in _halves(verify, len(tokens)).items():
        seqs = tokens[rows]
        emp = du.empirical_pmf(seqs)
        assert (emp[exact == 0] == 0).all(), f"{rule}: a sequence the target forbids"
        stat, thresh, worst = du.projection_test(seqs, exact, _null(sp, len(seqs)))
        n_steps = steps[rows].sum()
        acc = accepted[rows].sum(axis=0) / n_steps  # per draft position, per round
        # with reuse (G = 3) the reused hidden states draft position 2, not G
        out[rule] = (stat, thresh, worst, acc[0], acc[1] if name.endswith("-reuse") else acc[-1])
        print(f"\n[{name}{tag} {rule} {_id(sp)} hot={hot is not None} kernels={kernels}"
              f"{' stale' if stale else ''}] z={stat:.2f} thresh={thresh:.2f} worst {worst}; "
              f"accepted per round {acc.round(3)} rounds/row {steps[rows].mean():.2f}")
    return out


def _assert_lossless(*args, **kwargs):
    for rule, (stat, thresh, worst, acc_first, acc_last) in _check(*args, **kwargs).items():
        assert stat < thresh, (rule, stat, thresh, worst)
        # Meaningful only if drafts are both accepted and rejected (under a random
        # schedule the last position is drafted only in the steps that chose G).
        assert 0.05 < acc_first < 0.95, (rule, acc_first)
        assert acc_last > 0.01 or kwargs.get("schedule"), (rule, acc_last)


# ----------------------------------------------------------------------------- cases
# (drafter, verify, sampling, hot vocabulary, kernels). Default: each drafter path once
# with both rules ("both"; the draft LM's is tests/decoding/test_distribution.py's), T=1 / top-k /
# top-p / hot vocabularies spread over them, and three drafters under
# kernels="reference" (T=1 only: top-k/top-p are not fused). Slow: the other settings.

FAST = [
    ("ngram", "both", PLAIN, None, "off"),
    ("oracle", "both", PLAIN, None, "off"),
    ("eagle3", "both", TOP_K, HOT, "off"),
    ("kv", "both", TOP_K, None, "off"),
    ("hybrid", "both", PLAIN, HOT, "off"),
    ("block-hidden", "both", TOP_P, None, "off"),
    ("block-kv", "both", TOP_P, None, "off"),
    ("block-both", "both", PLAIN, None, "off"),
    ("eagle3-hf", "both", TOP_K, EAGLE_HOT, "off"),
    ("dflash", "both", TOP_P, HOT, "off"),
    ("kv", "block", PLAIN, HOT, "reference"),
    ("ngram", "token", PLAIN, None, "reference"),
    ("dflash", "token", PLAIN, None, "reference"),
    ("medc", "both", TOP_P, None, "off"),
    ("medc-reuse", "both", TOP_K, None, "off"),
]
SLOW = [
    ("medc", "both", PLAIN, HOT, "off"),
    ("medc", "token", PLAIN, None, "reference"),
    ("medc-stop", "both", TOP_K, None, "off"),
    ("medc-reuse", "token", PLAIN, HOT, "reference"),
    ("medc-stop-reuse", "both", TOP_P, None, "off"),
    ("draft-lm", "both", TOP_K, None, "off"),
    ("draft-lm", "both", TOP_P, None, "off"),
    ("ngram", "both", TOP_P, None, "off"),
    ("eagle3", "both", PLAIN, None, "off"),
    ("eagle3", "both", TOP_P, None, "off"),
    ("kv", "both", PLAIN, HOT, "off"),
    ("hybrid", "both", TOP_P, None, "off"),
    ("block-hidden", "both", PLAIN, HOT, "off"),
    ("block-kv", "both", TOP_K, HOT, "off"),
    ("block-both", "both", TOP_P, HOT, "off"),
    ("eagle3-hf", "both", PLAIN, EAGLE_HOT, "off"),
    ("dflash", "both", TOP_K, None, "off"),
    ("draft-lm", "token", PLAIN, None, "reference"),
    ("eagle3", "token", PLAIN, HOT, "reference"),
    ("hybrid", "block", PLAIN, None, "reference"),
    ("block-hidden", "token", PLAIN, None, "reference"),
    ("block-kv", "block", PLAIN, HOT, "reference"),
    ("block-both", "token", PLAIN, HOT, "reference"),
    ("kv", "token", PLAIN, None, "reference"),
    ("ngram", "block", PLAIN, None, "reference"),
    ("eagle3-hf", "token", PLAIN, EAGLE_HOT, "reference"),
    ("eagle3-hf", "block", PLAIN, EAGLE_HOT, "reference"),
    ("dflash", "block", PLAIN, HOT, "reference"),
    ("eagle3-stop", "both", PLAIN, None, "off"),
    ("hybrid-stop", "both", TOP_K, HOT, "off"),
]
CASES = FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW]


def test_setup_is_discriminating():
    """The target's later tokens depend on the earlier ones (so a round that saw the
    wrong context shows), and the filters keep and drop tokens."""
    joint = _exact(PLAIN)
    cond = du.project(joint, (3, 4), N_NEW).reshape(V, V)
    cond = cond / cond.sum(axis=1, keepdims=True)  # p(t5 | t4)
    assert max(du.tv(cond[i], cond[j]) for i in range(V) for j in range(V)) > 0.3
    assert (_exact(TOP_K) == 0).mean() > 0.3 and (_exact(TOP_P) == 0).mean() > 0.3


@pytest.mark.parametrize("name,verify,sp,hot,kernels", CASES, ids=_id)
def test_multi_round_sampling_is_lossless(name, verify, sp, hot, kernels):
    _assert_lossless(name, verify, sp, hot, kernels)


# Draft trees (issue 30): K drafts per step from one drafter state, verified as one tree
# by the tree rules (specjax.decoding.tree_verify), the accepted path compacted into the
# caches. (drafter, rule, sampling, hot vocabulary, K).
TREE_FAST = [
    ("eagle3", "token", PLAIN, None, 2),
    ("draft-lm", "block", PLAIN, None, 2),
]
TREE_SLOW = [
    ("block-kv", "block", TOP_K, None, 3),
    ("eagle3", "block", TOP_K, HOT, 3),
    ("kv", "token", TOP_K, None, 3),
    ("hybrid", "block", PLAIN, None, 2),
    ("block-hidden", "token", PLAIN, None, 2),
    ("ngram", "token", PLAIN, None, 3),
    ("ngram", "block", PLAIN, None, 2),
    ("draft-lm", "token", TOP_P, None, 3),
    ("dflash", "block", PLAIN, HOT, 2),
    ("medc", "token", PLAIN, None, 2),
]
TREE_CASES = TREE_FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in TREE_SLOW]


@pytest.mark.parametrize("name,verify,sp,hot,num_drafts", TREE_CASES, ids=_id)
def test_draft_trees_are_lossless(name, verify, sp, hot, num_drafts):
    _assert_lossless(name, verify, sp, hot, num_drafts=num_drafts)


# Adaptive draft length (issue 32): a random length in {0, 1, G} every step, so rounds of
# different lengths (and autoregressive steps) follow each other. (drafter, rule, sampling)
SCHEDULE_FAST = [("eagle3", "both", PLAIN), ("draft-lm", "both", PLAIN)]
SCHEDULE_SLOW = [("block-kv", "both", TOP_K), ("kv", "both", PLAIN), ("hybrid", "both", TOP_P),
                 ("block-hidden", "both", PLAIN), ("block-both", "both", PLAIN),
                 ("ngram", "both", PLAIN), ("dflash", "both", PLAIN),
                 ("eagle3-hf", "token", PLAIN), ("eagle3", "token", PLAIN),
                 ("medc", "both", PLAIN), ("medc-reuse", "both", TOP_K)]
SCHEDULE_CASES = SCHEDULE_FAST + [pytest.param(*c, marks=pytest.mark.slow)
                                  for c in SCHEDULE_SLOW]


@pytest.mark.parametrize("name,verify,sp", SCHEDULE_CASES, ids=_id)
def test_random_draft_lengths_are_lossless(name, verify, sp):
    hot = EAGLE_HOT if name == "eagle3-hf" else None
    _assert_lossless(name, verify, sp, hot, schedule=True)


def test_stale_q_after_first_round_is_caught():
    """Power: a drafter that is exact in its first round and reports a stale q after
    (StaleQDrafter around kv) fails the test under both rules."""
    for rule, (stat, thresh, worst, *_) in _check("kv", "both", PLAIN, stale=True).items():
        assert stat > thresh, (rule, stat, thresh, worst)


@pytest.mark.slow
def test_biased_verifiers_are_caught():
    """Power: token-level resampling from p and block verification that stops at the
    first failure (tests/decoding/test_distribution.py's biased rules) fail the test."""
    for rule, (stat, thresh, worst, *_) in _check("block-kv", "biased", PLAIN).items():
        assert stat > thresh, (rule, stat, thresh, worst)
