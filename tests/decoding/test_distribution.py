"""Exact-distribution tests of the verification rules (docs/design.md section 4).

Two levels:
- Through the real speculative loop (`speculative_loop` + `DraftLMDrafter`): the
  first N_NEW generated tokens of B identical rows must follow the target's exact
  filtered distribution, computed by enumeration in float64 numpy; biased
  verifiers injected as `LoopConfig.verify` must be rejected by the same test; the
  loop's first-step outcome (t1, tau, t2) must follow the rule's exact law.
- `specjax.decoding.verify` alone on synthetic prefix-dependent distributions: one verify step
  followed by exact target sampling must reproduce the target's joint law, and the
  law of (tau, next) must equal the rule's exact law.

The statistic is the total-variation distance between the empirical and the exact
distribution; its threshold is the 99.9% quantile of its null distribution,
simulated with multinomial draws from the exact distribution. Seeds are fixed, so
the tests are deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.decoding.loop import LoopConfig, speculative_loop
from specjax.decoding.verify import (
    Verdict,
    block_weights,
    verify_block,
    verify_greedy,
    verify_token,
)
from specjax.drafters.draft_lm import DraftLMDrafter
from specjax.testing import distribution as du

V = du.V
PROMPT = (1, 4, 2)  # Tp = 3 real tokens ...
PROMPT_WIDTH = 4  # ... right-padded to width 4 with PAD (exercises padded prefill)
PAD = 5
N_NEW = 3  # budget: generated tokens per row (drafts cross this horizon)
BATCH = 40_000  # rows (= samples) per loop call
LEVEL = 0.999

PLAIN = SamplingParams(temperature=1.0)
TOP_K = SamplingParams(temperature=1.0, top_k=3)
TOP_P = SamplingParams(temperature=1.0, top_p=0.75)
MIXED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)


def _params(sp: SamplingParams):
    return sp.temperature, sp.top_k, sp.top_p


def _id(x):
    if isinstance(x, SamplingParams):
        return f"T{x.temperature:g}-k{x.top_k}-p{x.top_p:g}"
    return None


# ----------------------------------------------------------------------------- biased rules
# Self-contained copies of the two rules with one switch each; `biased=True` plants
# a classic mistake. The correct copies are controls for the unit-level harness.


def _token_rule(draft, q, p, key, *, biased):
    """Token-level rejection sampling; biased: resample from p_i instead of
    norm(max(p_i - q_i, 0)) after a rejection."""
    B, G = draft.shape
    k_acc, k_next = jax.random.split(key)
    px = jnp.take_along_axis(p[:, :G], draft[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    accept = jax.random.uniform(k_acc, (B, G)) * qx < px
    tau = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(B)
    p_t = p[rows, tau]
    q_t = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)[rows, tau]
    dist = p_t if biased else jnp.maximum(p_t - q_t, 0.0)
    dist = jnp.where(dist.sum(-1, keepdims=True) > 0, dist, p_t)
    return Verdict(tau, jax.random.categorical(k_next, jnp.log(dist)).astype(jnp.int32))


def _block_rule(draft, q, p, key, *, biased=None):
    """Block verification; biased="no_w": residual norm(max(p - q, 0)) without w_tau;
    biased="early_stop": tau = the first failure - 1 instead of the largest pass."""
    B, G = draft.shape
    k_acc, k_next = jax.random.split(key)
    px = jnp.take_along_axis(p[:, :G], draft[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    ratio = px / jnp.maximum(qx, 1e-30)
    ws, w = [jnp.ones((B,))], jnp.ones((B,))
    for i in range(G):
        w = jnp.minimum(1.0, w * ratio[:, i])
        ws.append(w)
    w = jnp.stack(ws, axis=1)  # w_0..w_G
    hs = []
    for i in range(1, G):
        a = jnp.sum(jnp.maximum(w[:, i, None] * p[:, i] - q[:, i], 0.0), axis=-1)
        den = a + (1.0 - w[:, i])
        hs.append(jnp.where(den > 0, a / jnp.where(den > 0, den, 1.0), 1.0))
    h = jnp.stack([*hs, w[:, G]], axis=1)  # h_1..h_G
    passed = jax.random.uniform(k_acc, (B, G)) < h
    if biased == "early_stop":
        tau = jnp.sum(jnp.cumprod(passed, axis=1), axis=1)
    else:
        tau = jnp.max(jnp.where(passed, jnp.arange(1, G + 1)[None], 0), axis=1)
    tau = tau.astype(jnp.int32)
    rows = jnp.arange(B)
    p_t = p[rows, tau]
    q_t = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)[rows, tau]
    w_t = 1.0 if biased == "no_w" else w[rows, tau][:, None]
    dist = jnp.maximum(w_t * p_t - q_t, 0.0)
    dist = jnp.where(dist.sum(-1, keepdims=True) > 0, dist, p_t)
    return Verdict(tau, jax.random.categorical(k_next, jnp.log(dist)).astype(jnp.int32))


def token_resample_from_p(draft, q, p, key):
    return _token_rule(draft, q, p, key, biased=True)


def block_residual_without_w(draft, q, p, key):
    return _block_rule(draft, q, p, key, biased="no_w")


def block_early_stop(draft, q, p, key):
    return _block_rule(draft, q, p, key, biased="early_stop")


def token_control(draft, q, p, key):
    return _token_rule(draft, q, p, key, biased=False)


def block_control(draft, q, p, key):
    return _block_rule(draft, q, p, key)


BIASED = {
    "token_resample_from_p": token_resample_from_p,
    "block_residual_without_w": block_residual_without_w,
    "block_early_stop": block_early_stop,
}

# ----------------------------------------------------------------------------- the loop


@functools.cache
def _models():
    target = du.scaled_model(0, 25.0)
    draft = du.scaled_model(1, 25.0)
    graphdef, params = nnx.split(target)
    return target, draft, graphdef, params


@functools.cache
def _drafter(gamma: int, sp: SamplingParams):
    _, draft, _, _ = _models()
    return DraftLMDrafter.create(draft, gamma, sp, V)


@functools.cache
def _run(verify, gamma: int, sp: SamplingParams, budget: int = N_NEW, seed: int = 0,
         kernels: str = "off", batch: int = BATCH):
    """One loop call over `batch` copies of PROMPT -> numpy (tokens, lengths, steps, accepted)."""
    _, _, graphdef, params = _models()
    drafter, dparams = _drafter(gamma, sp)
    lc = LoopConfig(max_length=len(PROMPT) + N_NEW, prompt_width=PROMPT_WIDTH, sampling=sp,
                    verify=verify, kernels=kernels)
    prompt = np.full((PROMPT_WIDTH,), PAD, np.int32)
    prompt[: len(PROMPT)] = PROMPT
    prompts = jnp.asarray(np.tile(prompt, (batch, 1)))
    plen = jnp.full((batch,), len(PROMPT), jnp.int32)
    budgets = jnp.full((batch,), budget, jnp.int32)
    res = speculative_loop(graphdef, params, drafter, dparams, lc, prompts, plen, budgets,
                           jax.random.key(seed))
    out = tuple(np.asarray(x) for x in (res.tokens, res.lengths, res.steps, res.accepted))
    tokens, lengths, _, _ = out
    Tp = len(PROMPT)
    assert (lengths == Tp + budget).all(), "every row must emit exactly its budget"
    assert (tokens[:, :Tp] == PROMPT).all(), "the prompt must stay in the buffer"
    return out


@functools.cache
def _exact(sp: SamplingParams, n: int = N_NEW):
    target = _models()[0]
    joint, margin = du.exact_joint(target, PROMPT, n, *_params(sp))
    # Well-posed: no top-k/top-p decision within float32 noise of its boundary.
    assert margin > 1e-3, f"filter boundary margin {margin:.2e} too small for {sp}"
    return joint


def test_setup_is_discriminating():
    """Preconditions that make the loop tests meaningful: p far from uniform, depends
    on the context, and the drafter's q clearly disagrees with p."""
    target, draft, _, _ = _models()
    ctx = np.array([(*PROMPT, t1) for t1 in range(V)], np.int32)
    p = du.np_filtered_probs(du.context_logits(target, ctx)[:, -1], 1.0)  # p(t2 | t1)
    q = du.np_filtered_probs(du.context_logits(draft, ctx)[:, -1], 1.0)
    tv_pq = [du.tv(p[i], q[i]) for i in range(V)]
    assert min(tv_pq) > 0.1, tv_pq
    assert max(du.tv(p[i], p[j]) for i in range(V) for j in range(V)) > 0.2
    assert du.tv(p[0], np.full(V, 1 / V)) > 0.1


LOOP_CASES = [
    ("token", 2, PLAIN), ("token", 3, PLAIN), ("block", 2, PLAIN), ("block", 3, PLAIN),
    ("token", 3, TOP_K), ("block", 3, TOP_K),
    ("token", 2, TOP_P), ("block", 2, TOP_P),
    ("token", 3, MIXED), ("block", 3, MIXED),
]


def _loop_tv(verify, gamma, sp, calls=1, kernels="off"):
    """TV between the first N_NEW tokens of `calls` loop calls (seeds 0..calls-1, one
    compiled loop) and the exact law, and the TV's null quantile for that many samples."""
    Tp = len(PROMPT)
    tokens = np.concatenate([_run(verify, gamma, sp, seed=s, kernels=kernels)[0][:, Tp:Tp + N_NEW]
                             for s in range(calls)])
    exact = _exact(sp)
    emp = du.empirical_pmf(tokens)
    return du.tv(emp, exact), du.tv_null_quantile(exact, len(tokens), LEVEL), exact, emp


@pytest.mark.parametrize("verify,gamma,sp", LOOP_CASES, ids=_id)
def test_loop_first_tokens_follow_target(verify, gamma, sp):
    stat, thresh, exact, emp = _loop_tv(verify, gamma, sp)
    print(f"\n[loop] {verify} G={gamma} {_params(sp)}: TV={stat:.4f} thresh={thresh:.4f}")
    assert (emp[exact == 0] == 0).all(), "the loop emitted a sequence the target forbids"
    assert stat < thresh, (stat, thresh)


@pytest.mark.parametrize("verify,gamma", [("token", 2), ("block", 3)])
def test_loop_with_fused_verification_follows_target(verify, gamma):
    """The same test through pallas_kernels.verify (LoopConfig.kernels="reference": its
    jnp path, which returns exactly what the Pallas kernels return, see below)."""
    stat, thresh, exact, emp = _loop_tv(verify, gamma, PLAIN, kernels="reference")
    print(f"\n[loop fused] {verify} G={gamma}: TV={stat:.4f} thresh={thresh:.4f}")
    assert (emp[exact == 0] == 0).all(), "the loop emitted a sequence the target forbids"
    assert stat < thresh, (stat, thresh)


@pytest.mark.parametrize("verify,sp", [
    ("token", PLAIN), ("block", PLAIN),
    pytest.param("block", SamplingParams(temperature=0.0), marks=pytest.mark.slow)])
def test_loop_pallas_kernel_equals_its_reference(verify, sp):
    """Same seed, same loop: the Pallas kernel (interpret mode) and its jnp reference
    emit identical tokens and accept identical lengths; greedy also equals kernels="off"."""
    runs = {k: _run(verify, 3, sp, budget=N_NEW, seed=0, kernels=k, batch=64)
            for k in ("reference", "pallas")}
    for a, b in zip(runs["reference"], runs["pallas"], strict=True):
        np.testing.assert_array_equal(a, b)
    if sp.greedy:
        off = _run(verify, 3, sp, budget=N_NEW, seed=0, kernels="off", batch=64)
        np.testing.assert_array_equal(off[0], runs["pallas"][0])


@pytest.mark.parametrize("name,gamma,calls", [
    ("token_resample_from_p", 2, 1), ("block_early_stop", 3, 1),
    # Dropping w only changes the correction after 1 <= tau < G with w_tau < 1: its TV
    # here is ~0.012, below the noise of 4e4 samples, so this one pools 8 calls.
    ("block_residual_without_w", 2, 8),
])
def test_loop_rejects_biased_verifier(name, gamma, calls):
    stat, thresh, _, _ = _loop_tv(BIASED[name], gamma, PLAIN, calls)
    print(f"\n[power] {name} G={gamma} n={calls * BATCH}: TV={stat:.4f} thresh={thresh:.4f}")
    assert stat > thresh, (stat, thresh)


# ----------------------------------------------------------------------------- accepted length


@pytest.mark.parametrize("gamma", [2, 3])
def test_block_accepts_at_least_token_in_loop(gamma):
    """tau = 1 + accepted/steps from the big budget-3 runs: block >= token - 3 SE."""
    taus = {}
    for rule in ("token", "block"):
        _, _, steps, accepted = _run(rule, gamma, PLAIN)
        r, se = du.ratio_mean_se(accepted.sum(1), steps)
        taus[rule] = (1 + r, se)
    (t_tok, se_tok), (t_blk, se_blk) = taus["token"], taus["block"]
    se = np.hypot(se_tok, se_blk)
    print(f"\n[tau loop] G={gamma}: token {t_tok:.4f}+-{se_tok:.4f} block {t_blk:.4f}+-{se_blk:.4f}")
    assert t_blk >= t_tok - 3 * se, taus


@functools.cache
def _first_step_exact(gamma: int, sp: SamplingParams):
    """Exact law of (t1, tau, t2) in the first loop step, f64[V, G+1, V], per rule, and
    the exact E[tau] of that step. The first step verifies drafts x ~ q after prompt + t1,
    t1 ~ p; with a budget of 2 it emits x_1 if tau >= 1, else the correction."""
    target, draft, _, _ = _models()
    Tp = len(PROMPT)
    conts = du.all_tuples(gamma + 1)  # (t1, x_1..x_G)
    ctx = np.concatenate([np.broadcast_to(np.array(PROMPT, np.int32), (len(conts), Tp)), conts], 1)
    p_all = du.np_filtered_probs(du.context_logits(target, ctx)[:, Tp - 1:], *_params(sp))
    q_all = du.np_filtered_probs(du.context_logits(draft, ctx)[:, Tp:], *_params(sp))
    out = {}
    for rule in ("token", "block"):
        law = np.zeros((V, gamma + 1, V))
        for r, (t1, *x) in enumerate(conts):
            q, p = q_all[r, :gamma], p_all[r, 1:]  # q_1..q_G, p_1..p_{G+1}
            weight = p_all[r, 0, t1] * np.prod(q[np.arange(gamma), x])
            if weight == 0:
                continue
            verdict = weight * du.exact_verdict(rule, np.array(x), q, p)  # [G+1, V]
            law[t1, 0] += verdict[0]
            law[t1, 1:, x[0]] += verdict[1:].sum(-1)
        e_tau = float(np.sum(law.sum(axis=(0, 2)) * np.arange(gamma + 1)))
        out[rule] = (law, e_tau)
    return out


@pytest.mark.parametrize("gamma,sp", [(2, PLAIN), (3, PLAIN), (3, TOP_K), (2, TOP_P)], ids=_id)
def test_first_step_matches_rule_exactly(gamma, sp):
    """Exact E[tau]: block >= token. The loop's first step (budget 2: one step per row)
    follows the exact law of (t1, tau, t2), and its mean tau matches the exact one."""
    exact = _first_step_exact(gamma, sp)
    e_tok, e_blk = exact["token"][1], exact["block"][1]
    print(f"\n[tau exact] G={gamma} {_params(sp)}: token {e_tok:.5f} block {e_blk:.5f}")
    assert e_blk >= e_tok - 1e-12
    Tp = len(PROMPT)
    for rule in ("token", "block"):
        law = exact[rule][0]
        assert abs(law.sum() - 1) < 1e-9
        tokens, _, steps, accepted = _run(rule, gamma, sp, budget=2, seed=1)
        assert (steps == 1).all()
        tau = accepted.sum(1)
        cells = (tokens[:, Tp] * (gamma + 1) + tau) * V + tokens[:, Tp + 1]
        emp = np.bincount(cells, minlength=law.size) / BATCH
        stat = du.tv(emp, law.reshape(-1))
        thresh = du.tv_null_quantile(law.reshape(-1), BATCH, LEVEL)
        mean, se = tau.mean(), tau.std(ddof=1) / np.sqrt(BATCH)
        print(f"  {rule}: TV(t1,tau,t2)={stat:.4f} thresh={thresh:.4f} "
              f"E[tau] loop {mean:.4f}+-{se:.4f} exact {exact[rule][1]:.4f}")
        assert stat < thresh, (rule, stat, thresh)
        assert abs(mean - exact[rule][1]) < 4 * se, (rule, mean, exact[rule][1], se)


# ----------------------------------------------------------------------------- verify alone

UV = 5  # vocabulary of the synthetic unit tests
RULES = {"greedy": verify_greedy, "token": verify_token, "block": verify_block}


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("rule", ["greedy", "token", "block"])
def test_one_hot_gives_greedy_answer(rule, gamma):
    """Temperature-0-style one-hot p and q: every rule accepts the longest prefix with
    x_i == argmax p_i and emits argmax p at the first mismatch (or the bonus)."""
    rng = np.random.default_rng(gamma)
    B = 512
    target = rng.integers(0, UV, (B, gamma + 1))
    match = rng.random((B, gamma)) < 0.7
    draft = np.where(match, target[:, :gamma], (target[:, :gamma] + rng.integers(1, UV, (B, gamma))) % UV)
    q = np.eye(UV, dtype=np.float32)[draft]
    p = np.eye(UV, dtype=np.float32)[target]
    tau = np.sum(np.cumprod(draft == target[:, :gamma], axis=1), axis=1)
    nxt = target[np.arange(B), tau]
    out = jax.jit(RULES[rule])(jnp.asarray(draft, jnp.int32), jnp.asarray(q), jnp.asarray(p),
                               jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.num_accepted), tau)
    np.testing.assert_array_equal(np.asarray(out.next_token), nxt)


def _random_dists(rng, shape, zero_frac=0.3, alpha=2.0):
    """f64[..., UV] Dirichlet(alpha) rows, a random token zeroed in `zero_frac` of them."""
    d = rng.dirichlet(np.full(UV, alpha), size=shape)
    zero = rng.random(shape) < zero_frac
    d[zero, rng.integers(0, UV, shape)[zero]] = 0.0
    return d / d.sum(-1, keepdims=True)


def test_block_weights_in_unit_interval_and_match_reference():
    rng = np.random.default_rng(0)
    B, G = 4096, 4
    q = _random_dists(rng, (B, G), alpha=0.5)
    p = _random_dists(rng, (B, G + 1), alpha=0.5)
    p[: B // 8, 1:G] = q[: B // 8, 1:G]  # p = q rows: h's denominator can be 0
    draft = np.stack([du.sample_rows(rng, q[:, i]) for i in range(G)], axis=1)
    w, h = block_weights(jnp.asarray(draft), jnp.asarray(q, jnp.float32),
                         jnp.asarray(p, jnp.float32))
    w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
    assert np.isfinite(w).all() and np.isfinite(h).all()
    # h may exceed 1 by a few float32 ulps: `a + 1.0 - w` rounds a + 1 first (harmless,
    # u < h is then certain as it should be; see the report for `a + (1.0 - w)`).
    assert (w >= 0).all() and (w <= 1).all() and (h >= 0).all() and (h <= 1).all()
    # float64 reference
    ratio = p[np.arange(B)[:, None], np.arange(G), draft] / q[np.arange(B)[:, None], np.arange(G), draft]
    w_ref = np.ones((B, G + 1))
    for i in range(G):
        w_ref[:, i + 1] = np.minimum(1.0, w_ref[:, i] * ratio[:, i])
    w_ref = w_ref[:, 1:]
    np.testing.assert_allclose(w, w_ref, atol=1e-5)
    a = np.maximum(w_ref[:, :-1, None] * p[:, 1:G] - q[:, 1:G], 0).sum(-1)
    den = a + 1 - w_ref[:, :-1]
    h_ref = np.concatenate([np.where(den > 1e-9, a / np.maximum(den, 1e-300), 1.0), w_ref[:, -1:]], 1)
    np.testing.assert_allclose(h, h_ref, atol=1e-4)


@functools.cache
def _tables(gamma: int, seed: int = 0):
    """Prefix-dependent synthetic distributions over UV tokens: p_tab[k] f64[UV^k, UV]
    (the target's next token after k drafted tokens, k = 0..G) and q_tab[k] (k < G)."""
    rng = np.random.default_rng(seed)
    p_tab = [_random_dists(rng, (UV**k,)) for k in range(gamma + 1)]
    q_tab = [_random_dists(rng, (UV**k,)) for k in range(gamma)]
    if gamma > 1:  # a few contexts where the drafter is exact (zero residual)
        q_tab[1][:2] = p_tab[1][:2]
    return p_tab, q_tab


def _target_joint(p_tab, n):
    joint = np.ones(1)
    for k in range(n):
        joint = (joint[:, None] * p_tab[k]).reshape(-1)
    return joint


N_UNIT = 300_000


def _one_step(verify, gamma, seed=0):
    """Samples N_UNIT rows: drafts from q_tab, one verify call, then the emitted tokens
    continued with exact target sampling to G+1 tokens. -> (tau, next, seqs i32[N,G+1])."""
    p_tab, q_tab = _tables(gamma)
    rng = np.random.default_rng(seed + 1)
    N = N_UNIT
    draft = np.zeros((N, gamma), np.int32)
    q = np.zeros((N, gamma, UV))
    p = np.zeros((N, gamma + 1, UV))
    for k in range(gamma + 1):
        ctx = du.seq_index(draft[:, :k], UV)
        p[:, k] = p_tab[k][ctx]
        if k < gamma:
            q[:, k] = q_tab[k][ctx]
            draft[:, k] = du.sample_rows(rng, q[:, k])
    out = jax.jit(verify)(jnp.asarray(draft), jnp.asarray(q, jnp.float32),
                          jnp.asarray(p, jnp.float32), jax.random.key(seed))
    tau, nxt = np.asarray(out.num_accepted), np.asarray(out.next_token)
    seqs = np.concatenate([draft, np.zeros((N, 1), np.int32)], axis=1)
    seqs[np.arange(N), tau] = nxt
    for k in range(1, gamma + 1):  # continue past the emitted tokens with the target
        ctx = du.seq_index(seqs[:, :k], UV)
        fresh = du.sample_rows(rng, p_tab[k][ctx])
        seqs[:, k] = np.where(k > tau, fresh, seqs[:, k])
    return tau, nxt, seqs


def _exact_tau_next(rule, gamma):
    """f64[G+1, UV]: the exact law of (tau, next) for drafts from q_tab."""
    p_tab, q_tab = _tables(gamma)
    law = np.zeros((gamma + 1, UV))
    for x in du.all_tuples(gamma, UV):
        ctx = [int(du.seq_index(x[None, :k], UV)[0]) for k in range(gamma + 1)]
        q = np.stack([q_tab[k][ctx[k]] for k in range(gamma)])
        p = np.stack([p_tab[k][ctx[k]] for k in range(gamma + 1)])
        weight = np.prod(q[np.arange(gamma), x])
        if weight > 0:
            law += weight * du.exact_verdict(rule, x, q, p)
    return law


def _unit_stats(verify, gamma):
    p_tab, _ = _tables(gamma)
    tau, nxt, seqs = _one_step(verify, gamma)
    joint = _target_joint(p_tab, gamma + 1)
    stat = du.tv(du.empirical_pmf(seqs, UV), joint)
    thresh = du.tv_null_quantile(joint, N_UNIT, LEVEL)
    first = np.bincount(seqs[:, 0], minlength=UV) / N_UNIT
    first_stat, first_thresh = du.tv(first, p_tab[0][0]), du.tv_null_quantile(p_tab[0][0], N_UNIT, LEVEL)
    return stat, thresh, first_stat, first_thresh, tau, nxt


UNIT_CASES = [(r, g) for r in ("token", "block") for g in (1, 2, 3)]


@pytest.mark.parametrize("rule,gamma", UNIT_CASES)
def test_verify_one_step_is_lossless(rule, gamma):
    stat, thresh, f_stat, f_thresh, tau, nxt = _unit_stats(RULES[rule], gamma)
    law = _exact_tau_next(rule, gamma)
    emp = np.bincount(tau * UV + nxt, minlength=law.size) / N_UNIT
    tn_stat, tn_thresh = du.tv(emp, law.reshape(-1)), du.tv_null_quantile(law.reshape(-1), N_UNIT, LEVEL)
    print(f"\n[unit] {rule} G={gamma}: joint TV={stat:.4f}/{thresh:.4f} "
          f"first TV={f_stat:.4f}/{f_thresh:.4f} (tau,next) TV={tn_stat:.4f}/{tn_thresh:.4f}")
    assert abs(law.sum() - 1) < 1e-9
    assert stat < thresh and f_stat < f_thresh and tn_stat < tn_thresh


@pytest.mark.parametrize("verify,gamma", [(token_control, 3), (block_control, 3)])
def test_unit_harness_controls_pass(verify, gamma):
    stat, thresh, *_ = _unit_stats(verify, gamma)
    assert stat < thresh, (stat, thresh)


@pytest.mark.parametrize("name,gamma", [
    ("token_resample_from_p", 2), ("block_residual_without_w", 2),
    ("block_residual_without_w", 3), ("block_early_stop", 3),
])
def test_unit_harness_rejects_biased(name, gamma):
    stat, thresh, *_ = _unit_stats(BIASED[name], gamma)
    print(f"\n[unit power] {name} G={gamma}: TV={stat:.4f} thresh={thresh:.4f}")
    assert stat > thresh, (stat, thresh)
